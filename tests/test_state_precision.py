"""Reduced-precision recurrent state (DESIGN §20): the fast path's state bank in float16 / bfloat16 (torch kernels),
judged with constants measured for that state dtype, never fp32's; an fp32-declared bank keeps fp32's error."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracle  # noqa: E402
from fastpath import Engine  # noqa: E402
from fastpath.batch_invariant import run_recording_logits  # noqa: E402
from fastpath.options import FastOptions, OptionsError  # noqa: E402
from oracle.trace import load_trace  # noqa: E402
from hybridqual.qualify.compare import LOGITS_C, logit_scale, teacher_forced_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "goldens" / "models"


def _worst_scaled_error(model: str, trace: str, options: FastOptions) -> tuple[float, bool, torch.dtype]:
    """Largest |Δlogit| / max(1, std(oracle row)) of the fast path against the fp64 oracle, teacher-forced on the
    engine's tokens; whether the tokens equal the oracle's; the bank's SSM dtype."""
    t = load_trace(ROOT / "goldens" / "traces" / f"{trace}.json")
    truth = oracle.load(MODELS / model)
    eng = Engine.from_pretrained(MODELS / model, t.engine, device="cpu", dtype=torch.float32, max_len=64,
                                 options=options)
    res, rows = run_recording_logits(eng, t, "legacy")
    worst = 0.0
    for req in t.requests:
        ref = teacher_forced_logits(truth, req.prompt, res.tokens[req.id])
        for i in range(len(res.tokens[req.id])):
            d = float((rows[(req.id, len(req.prompt) + i)].double() - ref[i]).abs().max())
            worst = max(worst, d / logit_scale(ref[i]))
    same = res.tokens == oracle.run_trace(truth, t, "legacy").tokens
    return worst, same, eng.bank.ssm_state.dtype


def test_fp32_state_bank_stays_within_the_fp32_logits_constant():
    """The default bank (fp32, declared so) on nemotron_h: the logits check's fp32 c holds with room (an SSM state
    rounded to float16 behind that declaration breaks it)."""
    worst, same, dtype = _worst_scaled_error("zoo-nemotron_h", "chunked_prefill", FastOptions(backend="torch"))
    assert dtype == torch.float32 and same
    assert worst <= LOGITS_C[torch.float32] / 2, worst


@pytest.mark.parametrize("state", ["float16", "bfloat16"])
def test_reduced_state_bank_is_that_dtype_and_judged_by_its_own_constants(state):
    """A float16 / bfloat16 bank holds that dtype, keeps the oracle's greedy tokens on the trace, and its logit error
    exceeds what fp32's constant allows (so fp32's constants must never judge it) while staying inside the
    constants measured for it (hybridqual.adapters.state_precision)."""
    from hybridqual.adapters.state_precision import STATE_PRECISION
    worst, same, dtype = _worst_scaled_error("zoo-nemotron_h", "chunked_prefill",
                                             FastOptions(backend="torch", state_dtype=state))
    assert dtype == getattr(torch, state) and same
    assert worst > LOGITS_C[torch.float32], worst
    assert worst <= STATE_PRECISION[state].logits_c, worst


def test_reduced_state_on_the_triton_kernels_is_refused_by_name():
    t = load_trace(ROOT / "goldens" / "traces" / "chunked_prefill.json")
    with pytest.raises(OptionsError, match=r"options\.state_dtype"):
        Engine.from_pretrained(MODELS / "zoo-bamba", t.engine, device="cpu", dtype=torch.float32, max_len=64,
                               options=FastOptions(state_dtype="float16"))
    with pytest.raises(OptionsError, match=r"options\.state_dtype"):
        FastOptions(state_dtype="int8")
