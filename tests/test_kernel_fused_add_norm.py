"""fastpath.kernels.add_rms_norm (residual add + RMSNorm in one kernel) vs the fp64 math it fuses."""
from __future__ import annotations

import pytest
import torch

from kernel_tiers import TIERS, rel, skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.fused_add_norm import add_rms_norm  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}


def _oracle(h, d, w, eps, m):
    """fp64: s = h + m·d; rmsnorm(s)·w."""
    s = h.double() + (m * d.double() if d is not None else 0.0)
    return s, w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("mult", [1.0, 0.22], ids=["m1", "granite-m"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_add_rms_norm_matches_fp64_math(device, dtype, with_delta, mult):
    """[7, 48] (and 40, not a power of two): stream and normed output, both NaN-poisoned first."""
    skip_cpu_without_interpreter(device)
    for D in (48, 40):
        gen = torch.Generator().manual_seed(11 + D + with_delta + int(10 * mult))
        h, d = torch.randn(7, D, generator=gen) * 2, torch.randn(7, D, generator=gen)
        w = torch.randn(D, generator=gen)
        ho = torch.full((7, D), float("nan"), dtype=dtype, device=device)
        out = torch.full((7, D), float("nan"), dtype=dtype, device=device)
        hn, _ = add_rms_norm(h.to(device, dtype), d.to(device, dtype) if with_delta else None, w.to(device, dtype),
                             1e-5, mult, h_out=ho, out=out)
        s, ref = _oracle(h.to(dtype), d.to(dtype) if with_delta else None, w.to(dtype), 1e-5, mult)
        assert rel(out, ref) < REL[dtype]
        if with_delta:
            assert hn is ho and rel(ho, s) < REL[dtype]
            # the add is really there: the norm of h alone is far off
            assert rel(out, _oracle(h.to(dtype), None, w.to(dtype), 1e-5, mult)[1]) > 0.05
        else:
            assert hn is None and torch.isnan(ho).all()


@pytest.mark.parametrize("device,dtype", TIERS)
def test_add_rms_norm_rows_select_sources(device, dtype):
    """rows = [4, 0, 4]: output row j is the fused add+norm of source row rows[j]; the stream is not written."""
    skip_cpu_without_interpreter(device)
    gen = torch.Generator().manual_seed(5)
    h, d, w = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen), torch.randn(32, generator=gen)
    rows = torch.tensor([4, 0, 4], dtype=torch.int64, device=device)
    out = torch.full((3, 32), float("nan"), dtype=dtype, device=device)
    hn, _ = add_rms_norm(h.to(device, dtype), d.to(device, dtype), w.to(device, dtype), 1e-6, rows=rows, out=out)
    _, ref = _oracle(h.to(dtype), d.to(dtype), w.to(dtype), 1e-6, 1.0)
    assert hn is None
    assert rel(out, ref[[4, 0, 4]]) < REL[dtype]


def test_add_rms_norm_stream_is_the_exact_sum():
    """fp32 stream + a bf16-valued delta (residual_in_fp32): the stored stream is exactly h + delta."""
    skip_cpu_without_interpreter("cpu")
    gen = torch.Generator().manual_seed(9)
    h, d, w = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen), torch.ones(16)
    ho = torch.full((3, 16), float("nan"))
    # the interpreter computes bf16 arithmetic wrongly, so only the fp32 stream is checked exactly here
    hn, u = add_rms_norm(h, d.bfloat16().float(), w, 1e-5, h_out=ho)
    assert torch.equal(hn, h + d.bfloat16().float()) and u.dtype == torch.float32


def test_add_rms_norm_rejects_bad_inputs_naming_the_field():
    """Mis-shaped delta / weight / out and a non-contiguous h raise KernelInputError naming them."""
    h = torch.randn(2, 12)
    with pytest.raises(KernelInputError, match="delta"):
        add_rms_norm(h, torch.randn(2, 11), torch.ones(12), 1e-5)
    with pytest.raises(KernelInputError, match="weight"):
        add_rms_norm(h, None, torch.ones(11), 1e-5)
    with pytest.raises(KernelInputError, match="out"):
        add_rms_norm(h, None, torch.ones(12), 1e-5, out=torch.empty(3, 12))
    with pytest.raises(KernelInputError, match="`h`"):
        add_rms_norm(torch.randn(12, 2).T, None, torch.ones(12), 1e-5)
