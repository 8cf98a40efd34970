"""fastpath.kernels.act_mul (gated-MLP activation over the fused gate_up output) vs fp64 math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_tiers import TIERS, rel, skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.act_mul import act_mul  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}


def _oracle(gu: torch.Tensor, act: str) -> torch.Tensor:
    g, u = gu.double().chunk(2, dim=-1)
    return (F.silu(g) if act == "silu" else F.relu(g).square()) * u


@pytest.mark.parametrize("act", ["silu", "relu2"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_act_mul_matches_fp64_math(device, dtype, act):
    """F = 1500 (crosses a 1024 block, not a power of two) and F = 24; output NaN-poisoned first."""
    skip_cpu_without_interpreter(device)
    for T, Fd in ((3, 1500), (5, 24)):
        gen = torch.Generator().manual_seed(Fd + len(act))
        gu = (torch.randn(T, 2 * Fd, generator=gen) * 3).to(dtype)
        out = torch.full((T, Fd), float("nan"), dtype=dtype, device=device)
        act_mul(gu.to(device), act, out=out)
        assert rel(out, _oracle(gu, act)) < REL[dtype]
        # gate and up are not swapped
        assert rel(out, _oracle(gu.roll(Fd, dims=-1), act)) > 0.1


def test_act_mul_strided_rows():
    """A row-strided view (the last dim contiguous) reads the right rows."""
    skip_cpu_without_interpreter("cpu")
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(4, 40, generator=gen)
    out = act_mul(big[:, :32])
    assert rel(out, _oracle(big[:, :32], "silu")) < REL[torch.float32]


def test_act_mul_rejects_bad_inputs_naming_the_field():
    """Odd width, an unknown activation, a wrong out shape raise KernelInputError naming them."""
    with pytest.raises(KernelInputError, match="gate_up"):
        act_mul(torch.randn(2, 7))
    with pytest.raises(KernelInputError, match="act"):
        act_mul(torch.randn(2, 8), "gelu")
    with pytest.raises(KernelInputError, match="out"):
        act_mul(torch.randn(2, 8), out=torch.empty(2, 5))
