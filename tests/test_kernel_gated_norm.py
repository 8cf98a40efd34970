"""fastpath.kernels.rms_norm_gated vs oracle/gated_norm.py in fp64, grouped and ungrouped."""
from __future__ import annotations

import os

import pytest
import torch

from kernel_tiers import TIERS, rel  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.gated_norm import rms_norm_gated  # noqa: E402
from oracle.gated_norm import rms_norm_gated as oracle_norm  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}   # docs/kernels.md


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("n_groups", [1, 2, 4])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_rms_norm_gated_matches_oracle(device, dtype, n_groups, gated):
    """[3, 5, 48] (and a 2-D view) for 1/2/4 groups, with and without the z gate, outputs poisoned first."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU tier needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(40 + n_groups + gated)
    y, z = (torch.randn(3, 5, 48, generator=gen) * 3).to(dtype), torch.randn(3, 5, 48, generator=gen).to(dtype)
    w = torch.randn(48, generator=gen)
    out = torch.full((3, 5, 48), float("nan"), dtype=dtype, device=device)
    rms_norm_gated(y.to(device), z.to(device) if gated else None, w.to(device), n_groups, 1e-5, out=out)
    ref = oracle_norm(y.double(), z.double() if gated else None, w.double(), n_groups, 1e-5)
    assert rel(out, ref) < REL[dtype]
    # grouped differs from ungrouped (so the test can tell them apart)
    if n_groups > 1:
        other = oracle_norm(y.double(), z.double() if gated else None, w.double(), 1, 1e-5)
        assert rel(out, other) > 5 * REL[dtype]


def test_rms_norm_gated_rejects_bad_groups_naming_the_field():
    """D not divisible by n_groups, a mis-shaped weight or z raise KernelInputError."""
    y = torch.randn(2, 12)
    with pytest.raises(KernelInputError, match="n_groups"):
        rms_norm_gated(y, None, torch.ones(12), 5, 1e-5)
    with pytest.raises(KernelInputError, match="weight"):
        rms_norm_gated(y, None, torch.ones(11), 1, 1e-5)
    with pytest.raises(KernelInputError, match="z"):
        rms_norm_gated(y, torch.randn(2, 11), torch.ones(12), 1, 1e-5)
