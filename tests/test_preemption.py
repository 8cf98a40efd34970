"""Preemption by recompute (DESIGN §18): a KV budget (engine.kv_tokens) the decoding requests outgrow; the request
admitted last gives its slot back, waits, and prefills prompt + output again; its tokens equal the unpreempted run's."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracle  # noqa: E402
from fastpath import Engine  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle.scheduler import run_request_alone, run_trace  # noqa: E402
from oracle.schedule_log import first_difference  # noqa: E402
from oracle.trace import Trace, TraceError, load_trace, parse_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BAMBA = ROOT / "goldens" / "models" / "zoo-bamba"
TRACE = ROOT / "goldens" / "traces" / "preempt_recompute.json"


@pytest.fixture(scope="module")
def truth():
    return oracle.load(BAMBA)


def _steps(result) -> dict[int, dict]:
    return {s["step"]: s for s in result.schedule_log.to_json()["steps"]}


def test_victim_is_the_last_admitted_and_resumes_by_recompute(truth):
    """r2 (admitted last) is preempted when the three decoding requests outgrow 40 positions, keeps its 6 tokens, is
    admitted again when r0's finish frees room, into r0's freed slot, and prefills its 7 prompt + 6 generated tokens
    in one piece; r3 queues behind it (arrival order)."""
    res = run_trace(truth, load_trace(TRACE), "legacy")
    pre = [(k, p) for k, s in _steps(res).items() for p in s.get("preempt", [])]
    assert [(p["request"], p["slot"], p["generated"]) for _, p in pre] == [("r2", 2, 6)]
    k0 = pre[0][0]
    again = [(k, a) for k, s in _steps(res).items() for a in s["admit"] if a["request"] == "r2" and k > k0]
    k1, adm = again[0]
    freed_r0 = [f["slot"] for s in _steps(res).values() for f in s["free"] if f["request"] == "r0"]
    assert adm["resumed"] == 6 and adm["slot"] == freed_r0[0] != 2
    piece = [b for b in _steps(res)[k1]["batch"] if b["request"] == "r2"]
    assert piece == [{"row": adm["row"], "request": "r2", "slot": adm["slot"], "kind": "prefill", "pos": 0,
                      "count": 13}]
    assert [a["request"] for a in _steps(res)[k1]["admit"]] == ["r2", "r3"]


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_resumed_tokens_equal_the_unpreempted_run(truth, mode):
    """Every request's tokens equal its run alone and the same trace without a KV budget (nothing preempted)."""
    t = load_trace(TRACE)
    free = Trace(dataclasses.replace(t.engine, kv_tokens=None), t.requests, t.description)
    got, unpreempted = run_trace(truth, t, mode), run_trace(truth, free, mode)
    assert not any("preempt" in s for s in unpreempted.schedule_log.to_json()["steps"])
    assert got.tokens == unpreempted.tokens
    for req in t.requests:
        assert got.tokens[req.id] == run_request_alone(truth, req)[0], req.id


def test_fast_path_preempts_as_the_oracle_does(truth):
    """The fast path (torch kernels): the schedule log (preemptions, re-admissions, recompute pieces) and tokens equal
    the oracle's in both modes."""
    t = load_trace(TRACE)
    eng = Engine.from_pretrained(BAMBA, t.engine, device="cpu", dtype=torch.float32, max_len=64,
                                 options=FastOptions(backend="torch"))
    for mode in ("legacy", "async"):
        got, want = eng.run_trace(t, mode), run_trace(truth, t, mode)
        assert first_difference(got.schedule_log, want.schedule_log) is None, mode
        assert got.tokens == want.tokens


@pytest.mark.slow
def test_fast_path_preempts_as_the_oracle_does_on_the_triton_kernels(truth):
    t = load_trace(TRACE)
    eng = Engine.from_pretrained(BAMBA, t.engine, device="cpu", dtype=torch.float32, max_len=64)
    got, want = eng.run_trace(t, "legacy"), run_trace(truth, t, "legacy")
    assert first_difference(got.schedule_log, want.schedule_log) is None and got.tokens == want.tokens


def _obj(**engine) -> dict:
    return {"schema": "hybridqual.trace/1",
            "engine": {"max_requests": 2, "max_tokens_per_step": 32, "prefill_chunk": 16, **engine},
            "requests": [{"id": "a", "arrival_step": 0, "prompt": [1, 2, 3], "max_new_tokens": 4}]}


def test_bad_kv_budgets_are_refused_by_name():
    with pytest.raises(TraceError, match=r"engine\.kv_tokens"):
        parse_trace(_obj(kv_tokens=0))
    with pytest.raises(TraceError, match=r"engine\.kv_tokens"):
        parse_trace(_obj(kv_tokens=16, prefix_cache={"block_size": 8, "capacity": 1}))
    with pytest.raises(TraceError, match=r"requests\[0\]\.max_new_tokens"):
        from oracle.trace import check_against_model
        check_against_model(parse_trace(_obj(kv_tokens=6)), 64, 8)
