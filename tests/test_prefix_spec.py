"""Prefix caching × speculative decoding (DESIGN §17): decode stores hold verified state only, on both sides.

The shipped traces goldens/traces/prefix_spec{,_async}.json are built for zoo-bamba from its greedy tokens
(tools/scenarios/prefix_spec.py): `long` verifies scripted drafts so its generated block boundaries fall on a
snapshot, inside accepted inputs, one past the emitted tokens and in the lookahead; `b<p>` hit them.
"""
from __future__ import annotations

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
from oracle.trace import TraceError, load_trace, parse_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BAMBA = ROOT / "goldens" / "models" / "zoo-bamba"
TRACES = ("prefix_spec", "prefix_spec_async")


@pytest.fixture(scope="module")
def truth():
    return oracle.load(BAMBA)


def _trace(name: str):
    return load_trace(ROOT / "goldens" / "traces" / f"{name}.json")


def _events(result, kind: str) -> dict[int, list[tuple[str, int]]]:
    return {s["step"]: [(e["request"], e["pos"]) for e in s["prefix_cache"][kind]]
            for s in result.schedule_log.to_json()["steps"] if s["prefix_cache"][kind]}


def _verify(result) -> dict[int, int]:
    return {s["step"]: s["verify"][0]["accepted"] for s in result.schedule_log.to_json()["steps"] if s.get("verify")}


def test_decode_stores_keep_only_verified_state_in_the_oracle(truth):
    """Boundaries 8 (a rejection's rollback target) and 16 (inside three accepted inputs) are stored by their verify
    steps; 24 (one past the emitted tokens) and 32 (lookahead) are not stored by theirs but by the decode step whose
    own token reaches them; every b<p> hits p; tokens are each request's alone."""
    t = _trace("prefix_spec")
    res = run_trace(truth, t, "legacy")
    stored, verify = _events(res, "stored"), _verify(res)
    at = {p: step for step, ev in stored.items() for _, p in ev}
    assert verify[at[8]] == 0 and verify[at[16]] == 3
    assert at[24] not in verify and at[32] not in verify              # stored by plain decode rows, later
    before = lambda p: verify[max(s for s in verify if s < at[p])]   # noqa: E731  the verify step it fell in
    assert before(24) == 2 and before(32) == 0
    hits = {r: p for ev in _events(res, "hits").values() for r, p in ev}
    assert hits == {"b8": 8, "b16": 16, "b24": 24, "b32": 32}
    for req in t.requests:
        assert res.tokens[req.id] == run_request_alone(truth, req)[0], req.id


def test_async_boundary_step_is_not_overlapped_and_equals_legacy(truth):
    """With store_decoded, the decode-only step whose row reaches boundary 24 is followed by a draining step (its
    store reads the state the row left); overlapped steps elsewhere; async == legacy tokens and cache events."""
    t = _trace("prefix_spec_async")
    leg, asy = run_trace(truth, t, "legacy"), run_trace(truth, t, "async")
    steps = {s["step"]: s for s in asy.schedule_log.to_json()["steps"]}
    at = {p: step for step, ev in _events(asy, "stored").items() for _, p in ev}
    assert steps[at[24]]["overlap"] == 1 and steps[at[24] + 1]["overlap"] == 0
    assert sum(s["overlap"] for s in steps.values()) >= 5
    assert leg.tokens == asy.tokens and _events(leg, "stored") == _events(asy, "stored")


@pytest.mark.parametrize("name", TRACES)
def test_fast_path_decode_stores_equal_the_oracle(truth, name):
    """The fast path (torch kernels, fp32) runs both traces in both modes: schedule log (cache events, verify counts,
    overlap flags) and tokens equal the oracle's."""
    t = _trace(name)
    eng = Engine.from_pretrained(BAMBA, t.engine, device="cpu", dtype=torch.float32, max_len=48,
                                 options=FastOptions(backend="torch"))
    for mode in ("legacy", "async"):
        got, want = eng.run_trace(t, mode), run_trace(truth, t, mode)
        g, w = got.schedule_log.to_json()["steps"], want.schedule_log.to_json()["steps"]
        for a, b in zip(g, w):
            assert a == b, f"{name} {mode}: schedule log differs at step {b['step']}"
        assert len(g) == len(w) and got.tokens == want.tokens


def test_fast_path_decode_checkpoint_is_the_verified_state(truth):
    """The pool slot holding long's 16-block (stored inside a verify row that accepted 3 drafts: a snapshot) equals
    a cold prefill of the same 16 tokens to fp32 step-vs-scan rounding, not the slot's state after the row."""
    t = _trace("prefix_spec")
    eng = Engine.from_pretrained(BAMBA, t.engine, device="cpu", dtype=torch.float32, max_len=48,
                                 options=FastOptions(backend="torch"))
    res = eng.run_trace(t, "legacy")
    e = next(x for x in eng.prefix.entries.values() if x.pos == 16 and x.owner == "long")
    got = eng.bank.ssm_state[:, eng.bank.pool_slot(e.index)].clone()
    toks = list(t.requests[0].prompt) + res.tokens["long"]
    cold = Engine.from_pretrained(BAMBA, parse_trace({"schema": "hybridqual.trace/1", "engine": {
        "max_requests": 1, "max_tokens_per_step": 16, "prefill_chunk": 16},
        "requests": [{"id": "c", "arrival_step": 0, "prompt": toks[:16], "max_new_tokens": 1}]}).engine,
        device="cpu", dtype=torch.float32, max_len=48, options=FastOptions(backend="torch"))
    cold.run_trace(parse_trace({"schema": "hybridqual.trace/1", "engine": {
        "max_requests": 1, "max_tokens_per_step": 16, "prefill_chunk": 16},
        "requests": [{"id": "c", "arrival_step": 0, "prompt": toks[:16], "max_new_tokens": 1}]}), "legacy")
    want = cold.bank.ssm_state[:, 0]          # the decode of the 1 sampled token is not run (length 1 finishes)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_store_decoded_must_be_a_bool():
    obj = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 1, "max_tokens_per_step": 16,
           "prefill_chunk": 16, "prefix_cache": {"block_size": 8, "capacity": 1, "store_decoded": "yes"}},
           "requests": [{"id": "a", "arrival_step": 0, "prompt": [1, 2], "max_new_tokens": 1}]}
    with pytest.raises(TraceError, match=r"engine\.prefix_cache\.store_decoded"):
        parse_trace(obj)
