"""The RMSNorm kernels put eps inside the square root, x / sqrt(mean x² + eps), where it matters: rows whose mean
square is comparable to eps (a gate z ≪ 0 makes y·silu(z) that small). At the scale of the other kernel tests
(mean square ~ 1) eps outside the root changes the output by ~4e-6 relative, below their tolerance."""
from __future__ import annotations

import pytest
import torch

from kernel_tiers import TIERS, rel, skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels.fused_add_norm import add_rms_norm  # noqa: E402
from fastpath.kernels.gated_norm import rms_norm_gated  # noqa: E402
from oracle.gated_norm import rms_norm as oracle_rms_norm, rms_norm_gated as oracle_gated  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}   # docs/kernels.md, as in the kernels' own tests
EPS = 1e-5


def _small_rows(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows whose mean square is about eps (|x| ~ 3e-3)."""
    return torch.randn(*shape, generator=gen) * EPS ** 0.5


def _eps_outside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The wrong placement, fp64: x / (sqrt(mean x²) + eps) · w (to show the inputs tell the two apart)."""
    x = x.double()
    return w.double() * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + EPS)


@pytest.mark.parametrize("device,dtype", TIERS)
def test_add_rms_norm_keeps_eps_inside_the_root_for_rows_near_zero(device, dtype):
    """Fused residual add + RMSNorm of rows with mean square ~ eps equals the oracle's rms_norm of the sum."""
    skip_cpu_without_interpreter(device)
    gen = torch.Generator().manual_seed(7)
    h, d = _small_rows(gen, (5, 40)).to(dtype), _small_rows(gen, (5, 40)).to(dtype)
    w = torch.randn(40, generator=gen).to(dtype)
    out = torch.full((5, 40), float("nan"), dtype=dtype, device=device)
    add_rms_norm(h.to(device), d.to(device), w.to(device), EPS, out=out)
    s = h.double() + d.double()
    ref = oracle_rms_norm(s, w.double(), EPS)
    assert rel(out, ref) < REL[dtype]
    assert rel(_eps_outside(s, w), ref) > 10 * REL[dtype]      # the placement is visible on these rows (10× the tol)


@pytest.mark.parametrize("n_groups", [1, 2])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_rms_norm_gated_keeps_eps_inside_the_root_for_rows_near_zero(device, dtype, n_groups):
    """Gated RMSNorm where the gate z ≪ 0 makes y·silu(z) ~ sqrt(eps): equals the oracle's, per group."""
    skip_cpu_without_interpreter(device)
    gen = torch.Generator().manual_seed(8 + n_groups)
    y = torch.randn(4, 48, generator=gen).to(dtype)
    z = (torch.randn(4, 48, generator=gen) * 0.3 - 7.0).to(dtype)            # silu(z) ~ -6e-3
    w = torch.randn(48, generator=gen).to(dtype)
    out = torch.full((4, 48), float("nan"), dtype=dtype, device=device)
    rms_norm_gated(y.to(device), z.to(device), w.to(device), n_groups, EPS, out=out)
    ref = oracle_gated(y.double(), z.double(), w.double(), n_groups, EPS)
    assert rel(out, ref) < REL[dtype]
    g = (y.double() * torch.nn.functional.silu(z.double())).view(4, n_groups, -1)
    wrong = _eps_outside(g, w.double().view(n_groups, -1)).view(4, 48)
    assert rel(wrong, ref) > 10 * REL[dtype]
