"""fastpath.kernels.greedy_sample: argmax into a preallocated int64 buffer for BF16/FP32 logits."""
from __future__ import annotations

import pytest
import torch

from fastpath.kernels._common import KernelInputError
from fastpath.kernels.sampling import greedy_sample
from oracle.sampling import greedy

GPU = pytest.mark.gpu
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[GPU, NO_CUDA])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_sample_matches_oracle_with_ties_in_place(device, dtype):
    """Rows with planted ties (lowest index must win) equal oracle.sampling.greedy; the buffer keeps its address."""
    gen = torch.Generator().manual_seed(50)
    logits = torch.randn(6, 1000, generator=gen).to(dtype)
    for r in range(6):
        top = logits[r].max()
        a, b = sorted(torch.randperm(1000, generator=gen)[:2].tolist())
        logits[r, a] = logits[r, b] = top + 1                      # a tie between two positions
    buf = torch.full((6,), -7, dtype=torch.int64, device=device)
    ptr = buf.data_ptr()
    got = greedy_sample(logits.to(device), buf)
    assert got.data_ptr() == ptr and buf.data_ptr() == ptr
    assert buf.cpu().tolist() == [greedy(logits[r]) for r in range(6)]


def test_greedy_sample_rejects_wrong_dtypes_naming_the_field():
    """fp16 logits, an int32 buffer or a wrong-length buffer raise KernelInputError."""
    with pytest.raises(KernelInputError, match="logits"):
        greedy_sample(torch.randn(2, 5).half(), torch.empty(2, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="out"):
        greedy_sample(torch.randn(2, 5), torch.empty(2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="out"):
        greedy_sample(torch.randn(2, 5), torch.empty(3, dtype=torch.int64))
