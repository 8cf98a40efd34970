"""fastpath.kernels._interpreter_speed: under the Triton interpreter a language module is patched once per process —
neither a later launch nor a @triton.jit helper call inside a kernel (ours, or Triton's own tl.sum / tl.max)
re-patches it — and the kernel's results are the bits of the interpreter's own patch-per-call way."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_tiers import skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastpath.kernels._common import sigmoid, softplus  # noqa: E402  (under the interpreter: applies the shim)

HERE = os.path.dirname(os.path.abspath(__file__))


@triton.jit
def helpers(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    y = softplus(v) * sigmoid(v) + v * (v > 1.0)
    tl.store(out_ptr + offs, y + tl.max(y, axis=0) * 0.5 + tl.sum(v, axis=0) * 0.25)


def run_helpers() -> torch.Tensor:
    x = torch.linspace(-10.0, 30.0, 64, dtype=torch.float32)
    out = torch.empty_like(x)
    helpers[(4,)](x, out, BLOCK=16)
    return out


def test_a_language_module_is_patched_once_per_process_and_the_bits_are_the_same(monkeypatch):
    skip_cpu_without_interpreter("cpu")
    from triton.runtime import interpreter as interp
    if not getattr(interp._patch_lang, "_hq_once", False):
        pytest.skip("this Triton's interpreter does not have the shape the shim relies on (left unwrapped)")
    real = interp._patch_lang._hq_original          # the interpreter's own _patch_lang
    calls: list[str] = []

    def counted(fn):
        calls.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(interp, "_patch_lang", counted)
    from fastpath.kernels import _interpreter_speed
    assert _interpreter_speed.apply()               # a fresh shim around the counting one
    runs = []
    for _ in range(3):
        calls.clear()
        runs.append((run_helpers(), list(calls)))
    # the first launch patches tl (the kernel's module) and tl.core (tl.max / tl.sum's module) once; then nothing
    assert runs[0][1][0] == "helpers" and set(runs[0][1][1:]) <= {"max", "sum"} and len(runs[0][1]) <= 2, runs[0][1]
    assert runs[1][1] == [] and runs[2][1] == []
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][0], runs[2][0])

    # the interpreter's own way (a patch per launch and per helper call, restored after the grid), in a process
    # where the shim is never applied: the same bits
    code = ("import sys, json, torch; sys.path.insert(0, sys.argv[1]);"
            "from triton.runtime import interpreter as I; I._patch_lang._hq_once = True;"   # apply() then declines
            "import test_interpreter_speed as t;"
            "from triton.runtime import interpreter as J; assert not hasattr(J._patch_lang, '_hq_original');"
            "print(json.dumps(t.run_helpers().view(torch.int32).tolist()))")
    p = subprocess.run([sys.executable, "-c", code, HERE], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    plain = torch.tensor(json.loads(p.stdout.strip().splitlines()[-1]), dtype=torch.int32)
    assert torch.equal(plain, runs[0][0].view(torch.int32))
    v = torch.linspace(-10.0, 30.0, 64).view(4, 16)
    y = torch.nn.functional.softplus(v) * torch.sigmoid(v) + v * (v > 1.0)
    ref = y + y.amax(dim=1, keepdim=True) * 0.5 + v.sum(dim=1, keepdim=True) * 0.25
    torch.testing.assert_close(runs[0][0].view(4, 16), ref, rtol=1e-5, atol=1e-4)


@triton.jit
def int_arith(x_ptr, out_ptr, K, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, (v * K + offs) - K)     # int32: the K chosen below overflows on some lanes


def run_int_arith() -> torch.Tensor:
    x = torch.arange(-32, 32, dtype=torch.int32) * 40_000_000
    out = torch.empty_like(x)
    int_arith[(4,)](x, out, 97, BLOCK=16)
    return out


def test_the_overflow_checks_dropped_are_ones_whose_asserts_the_interpreter_discards():
    """With the interpreter's sanitiser on and `debug` off (its options), an int32 overflow raises nothing and the
    result is the wrapped int32 value: the sanitiser's work is discarded, so dropping it changes no bit."""
    skip_cpu_without_interpreter("cpu")
    import dataclasses

    from triton.runtime import interpreter as interp
    from fastpath.kernels import _interpreter_speed
    b = interp.interpreter_builder
    if not dataclasses.is_dataclass(b.options):
        pytest.skip("this Triton's interpreter options are not a dataclass (left as they are)")
    saved = b.options
    try:
        b.options = dataclasses.replace(saved, sanitize_overflow=True, debug=False)
        checked = run_int_arith()                          # overflows on some lanes, raises nothing
        assert _interpreter_speed.drop_dead_overflow_checks()
        assert b.options.sanitize_overflow is False and b.options.debug is False
        assert not _interpreter_speed.drop_dead_overflow_checks()      # already off: nothing to do
        unchecked = run_int_arith()
        b.options = dataclasses.replace(saved, sanitize_overflow=True, debug=True)
        assert not _interpreter_speed.drop_dead_overflow_checks()      # debug on: the checks would fire; kept
        assert b.options.sanitize_overflow is True
    finally:
        b.options = saved
    x = torch.arange(-32, 32, dtype=torch.int64) * 40_000_000
    wrapped = ((x * 97 + torch.arange(64)) - 97 + 2**31) % 2**32 - 2**31
    assert (x * 97).abs().max() > 2**31                    # the case does overflow int32
    assert torch.equal(checked, unchecked) and torch.equal(checked.to(torch.int64), wrapped)


def test_the_interpreter_runs_without_the_dead_overflow_checks():
    skip_cpu_without_interpreter("cpu")
    from triton.runtime import interpreter as interp
    opts = interp.interpreter_builder.options
    if getattr(opts, "debug", True):
        pytest.skip("the interpreter's debug is on: its overflow asserts fire, so the checks are kept")
    assert opts.sanitize_overflow is False


def test_the_np_dtype_answers_kept_are_the_interpreters_own():
    """Every dtype's memoized NumPy dtype is the interpreter's table's answer, first call and repeat alike, and a
    block type (unhashable) still gets its answer."""
    skip_cpu_without_interpreter("cpu")
    from triton.runtime import interpreter as interp
    f = interp._get_np_dtype
    if not getattr(f, "_hq_memo", False):
        pytest.skip("this Triton's interpreter has no _get_np_dtype to wrap (left as it is)")
    original = f._hq_original
    kinds = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
             tl.bfloat16, tl.float32, tl.float64, tl.pointer_type(tl.float32), tl.pointer_type(tl.int64)]
    for t in kinds:
        assert f(t) == original(t) and f(t) == original(t), t
    assert f(tl.int32) != f(tl.float32) and f(tl.bfloat16) == original(tl.bfloat16)
    block = tl.block_type(tl.float32, [4, 8])
    assert f(block) == original(block)
    assert run_helpers().dtype == torch.float32 and torch.equal(run_helpers(), run_helpers())
