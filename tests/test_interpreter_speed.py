"""fastpath.kernels._interpreter_speed: under the Triton interpreter a @triton.jit helper called inside a kernel no
longer re-patches triton.language (once per program of the grid), and the kernel's results are the same bits as
with the interpreter's own repeat patching."""
from __future__ import annotations

import pytest
import torch

from kernel_tiers import skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastpath.kernels._common import sigmoid, softplus  # noqa: E402  (under the interpreter: applies the shim)


@triton.jit
def helpers(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, softplus(v) * sigmoid(v) + v * (v > 1.0))


def test_a_helper_call_skips_the_repeat_patch_and_the_bits_are_the_same(monkeypatch):
    skip_cpu_without_interpreter("cpu")
    from triton.runtime import interpreter as interp
    if not getattr(interp._patch_lang, "_hq_once", False):
        pytest.skip("this Triton's interpreter does not have the shape the shim relies on (left unwrapped)")

    x = torch.linspace(-10.0, 30.0, 64, dtype=torch.float32)
    real = interp._patch_lang._hq_original          # the interpreter's own _patch_lang
    calls = []

    def counted(fn):
        calls.append(fn.__name__)
        return real(fn)

    def run() -> tuple[torch.Tensor, list[str]]:
        calls.clear()
        out = torch.empty_like(x)
        helpers[(4,)](x, out, BLOCK=16)
        return out, list(calls)

    # the interpreter's own patching, counted, then the shim applied around the counting one
    monkeypatch.setattr(interp.GridExecutor, "__call__", interp.GridExecutor.__call__._hq_original)
    monkeypatch.setattr(interp, "_patch_lang", counted)
    plain, plain_calls = run()                      # the interpreter's own way: a patch per helper call
    from fastpath.kernels import _interpreter_speed
    assert _interpreter_speed.apply()               # wraps the counting _patch_lang
    wrapped, wrapped_calls = run()
    assert plain_calls == ["helpers"] + ["softplus", "sigmoid"] * 4, plain_calls
    assert wrapped_calls == ["helpers"], wrapped_calls     # the grid patches once; its helpers reuse it
    assert torch.equal(plain, wrapped)
    ref = torch.nn.functional.softplus(x) * torch.sigmoid(x) + x * (x > 1.0)
    torch.testing.assert_close(wrapped, ref, rtol=1e-6, atol=1e-6)
