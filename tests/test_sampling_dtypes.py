"""Greedy sampling decides on the logits as given: FP32 and BF16 accepted without casts or mismatched buffers."""
from __future__ import annotations

import pytest
import torch

from fastpath.kernels.sampling import greedy_sample
from oracle.sampling import greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_sample_accepts_fp32_and_bf16_logits(dtype):
    """Both logit dtypes go through the int64 buffer without error (no dtype-fixed values buffer) and match the oracle."""
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(5, 300, generator=gen).to(dtype)
    out = torch.full((5,), -1, dtype=torch.int64)
    try:
        greedy_sample(logits, out)
    except RuntimeError as e:           # e.g. torch.max(out=(bf16 values, idx)) rejects fp32 logits
        pytest.fail(f"greedy_sample rejected {dtype} logits: {e}")
    assert out.tolist() == [greedy(logits[r]) for r in range(5)]


def test_greedy_fp32_logits_decide_on_fp32_values():
    """Two logits equal in bf16 but not in fp32, the larger at the higher index: the fp32 winner is chosen."""
    gen = torch.Generator().manual_seed(22)
    logits = torch.randn(4, 200, generator=gen) - 5.0
    for r in range(4):
        lo, hi = sorted(torch.randperm(200, generator=gen)[:2].tolist())
        logits[r, lo] = 3.0
        logits[r, hi] = 3.0 + 2.0 ** -12          # below bf16 resolution at 3.0 (2^-6)
        assert logits[r, lo].bfloat16() == logits[r, hi].bfloat16()
        assert greedy(logits[r]) == hi
    out = torch.full((4,), -1, dtype=torch.int64)
    greedy_sample(logits, out)
    assert out.tolist() == [greedy(logits[r]) for r in range(4)]
