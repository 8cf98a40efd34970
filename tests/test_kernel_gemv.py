"""fastpath.kernels.gemv (the bs1 decode projection) vs the fp64 product."""
from __future__ import annotations

import pytest
import torch

from kernel_tiers import TIERS, rel, skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.gemv import gemv  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_matches_fp64_product(device, dtype, bias):
    """N × K with N not a multiple of the row block and K both even and ragged; output NaN-poisoned."""
    skip_cpu_without_interpreter(device)
    for N, K in ((37, 64), (600, 200), (8, 2100)):
        gen = torch.Generator().manual_seed(N + K + bias)
        x, w = torch.randn(1, K, generator=gen).to(dtype), torch.randn(N, K, generator=gen).to(dtype)
        b = torch.randn(N, generator=gen).to(dtype) if bias else None
        out = torch.full((1, N), float("nan"), dtype=dtype, device=device)
        gemv(x.to(device), w.to(device), b.to(device) if bias else None, out=out)
        ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
        assert rel(out, ref) < REL[dtype]
        assert rel(out, x.double() @ w.double()[torch.arange(N).roll(1)].T) > 0.1   # rows not permuted
        split = torch.full((1, N), float("nan"), dtype=dtype, device=device)   # fixed K split, partials summed
        gemv(x.to(device), w.to(device), b.to(device) if bias else None, out=split, rule=dict(SPLIT=3, BLOCK_K=64))
        assert rel(split, ref) < REL[dtype]


def test_gemv_rejects_bad_inputs_naming_the_field():
    """Two rows, a K mismatch, a mis-shaped bias raise KernelInputError naming them."""
    with pytest.raises(KernelInputError, match="`x`"):
        gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(KernelInputError, match="weight"):
        gemv(torch.randn(1, 8), torch.randn(4, 9))
    with pytest.raises(KernelInputError, match="bias"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5))
