"""State transfer between engine instances (DESIGN §19): the `transfer` request field, the oracle's hand-over (the
sender frees the slot with reason "transfer", the receiver admits into a zeroed slot of its own with "imported"),
and the fast path's export/import of a row's whole state. Truth is continuity: tokens equal the request alone."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from oracle.scheduler import run_request_alone, run_trace
from oracle.schedule_log import canonical_json, first_difference, from_json
from oracle.trace import Trace, TraceError, Transfer, dump_trace, load_trace, parse_trace

BASE = {"schema": "hybridqual.trace/1",
        "engine": {"max_requests": 2, "max_tokens_per_step": 32, "prefill_chunk": 16},
        "requests": [{"id": "a", "arrival_step": 1, "prompt": [1, 2], "max_new_tokens": 4}]}


def _with(transfer, **engine):
    obj = copy.deepcopy(BASE)
    obj["requests"][0]["transfer"] = transfer
    obj["engine"].update(engine)
    return obj


def test_transfer_field_round_trips_and_is_absent_when_empty():
    """A transfer list parses to Transfer values and dumps back; a trace without one keeps its bytes."""
    t = parse_trace(_with([{"step": 3, "to": "e1"}, {"step": 5, "to": "main"}]))
    assert t.requests[0].transfer == (Transfer(3, "e1"), Transfer(5, "main"))
    assert parse_trace(json.loads(dump_trace(t))) == t
    assert "transfer" not in dump_trace(parse_trace(BASE))
    assert parse_trace(_with([])).requests[0].transfer == ()


@pytest.mark.parametrize("transfer, engine, field, words", [
    ("x", {}, "requests[0].transfer", "must be a list"),
    ([{"step": 0, "to": "e1"}], {}, "requests[0].transfer[0].step", ">= the arrival step 1"),
    ([{"step": 3, "to": "e1"}, {"step": 3, "to": "e2"}], {}, "requests[0].transfer[1].step", "previous transfer"),
    ([{"step": 3, "to": "main"}], {}, "requests[0].transfer[0].to", "already on engine 'main'"),
    ([{"step": 3, "to": "e1"}, {"step": 4, "to": "e1"}], {}, "requests[0].transfer[1].to", "already on engine 'e1'"),
    ([{"step": 3}], {}, "requests[0].transfer[0].to", "missing required field"),
    ([{"step": 3, "to": "e1", "when": 1}], {}, "requests[0].transfer[0].when", "unknown field"),
    ([{"step": True, "to": "e1"}], {}, "requests[0].transfer[0].step", "must be an integer"),
    ([{"step": 3, "to": ""}], {}, "requests[0].transfer[0].to", "engine id"),
    ([{"step": 3, "to": 7}], {}, "requests[0].transfer[0].to", "engine id"),
    ([{"step": 3, "to": "e1"}], {"kv_tokens": 64}, "requests[0].transfer", "not combined"),
])
def test_bad_transfer_is_an_error_naming_the_field(transfer, engine, field, words):
    """Every malformed transfer is a TraceError naming the field and the request."""
    with pytest.raises(TraceError) as e:
        parse_trace(_with(transfer, **engine))
    assert e.value.field == field and e.value.request_id == "a" and words in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------------ the oracle

ROOT = Path(__file__).resolve().parents[1]
BAMBA = ROOT / "goldens" / "models" / "zoo-bamba"
TRACE = ROOT / "goldens" / "traces" / "transfer_handover.json"


@pytest.fixture(scope="module")
def truth():
    import oracle
    return oracle.load(BAMBA)


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_handed_over_tokens_equal_each_request_alone(truth, mode):
    """Continuity: a request handed to another instance mid-decode (and one right after its prefill) emits the tokens
    of its run alone on one engine."""
    t = load_trace(TRACE)
    res = run_trace(truth, t, mode)
    assert res.tokens == {r.id: run_request_alone(truth, r)[0] for r in t.requests}


def test_log_records_the_transfer_on_both_instances(truth):
    """The sender frees the slot with reason "transfer" in the step the request was last computed (r1 from row 0,
    slot 1 after compaction); the receiver admits it at the next step into the slot r0 left there (LIFO), with
    "imported" = the positions moved, and decodes on from there without a prefill; the log's JSON round-trips."""
    res = run_trace(truth, load_trace(TRACE), "legacy")
    j = res.schedule_log.to_json()
    main, dec = {s["step"]: s for s in j["steps"]}, {s["step"]: s for s in j["instances"]["decode"]}
    assert {"request": "r0", "row": 0, "slot": 0, "reason": "transfer"} in main[0]["free"]
    assert {"request": "r1", "row": 0, "slot": 1, "reason": "transfer"} in main[5]["free"]
    assert not any(b["request"] == "r1" for s in j["steps"] if s["step"] > 5 for b in s["batch"])
    assert [f["slot"] for f in dec[3]["free"] if f["request"] == "r0"] == [0]
    assert dec[6]["admit"] == [{"request": "r1", "row": 0, "slot": 0, "imported": 14}]
    assert [(b["kind"], b["pos"]) for b in dec[6]["batch"]] == [("decode", 14)]
    assert not any(b["kind"] == "prefill" for s in j["instances"]["decode"] for b in s["batch"])
    assert from_json(json.loads(canonical_json(res.schedule_log))).to_json() == j
    assert first_difference(res.schedule_log, run_trace(truth, load_trace(TRACE), "legacy").schedule_log) is None


def test_async_overlaps_no_step_after_a_hand_over(truth):
    """The step after a transfer step drains on the sender (its state is read after the step's resolve): async logs
    an overlapped step nowhere right after a transfer."""
    j = run_trace(truth, load_trace(TRACE), "async").schedule_log.to_json()
    main = {s["step"]: s for s in j["steps"]}
    assert main[1]["overlap"] == 0 and main[6]["overlap"] == 0 and main[2]["overlap"] == 1


def test_a_transfer_outside_run_trace_is_refused(truth):
    """The one-instance Scheduler and streaming add_request refuse a request with a transfer, naming the field."""
    from oracle.scheduler import Scheduler
    t = load_trace(TRACE)
    with pytest.raises(TraceError, match=r"requests\[0\]\.transfer"):
        Scheduler(truth, t, "legacy")
    s = Scheduler(truth, Trace(t.engine, ()), "legacy")
    with pytest.raises(TraceError, match=r"requests\[0\]\.transfer"):
        s.add_request(t.requests[0])


# --------------------------------------------------------------------------------------------------- the fast path

def _fast_engine(t, backend: str | None = "torch"):
    import torch
    from fastpath import Engine
    from fastpath.options import FastOptions
    return Engine.from_pretrained(BAMBA, t.engine, device="cpu", dtype=torch.float32, max_len=64,
                                  options=FastOptions(backend=backend) if backend else None)


def test_fast_path_hands_over_as_the_oracle_does(truth):
    """The fast path (torch kernels), legacy and async: the schedule log of every instance (the sender's transfer
    free, the receiver's imported admission into the slot r0 left) and the tokens equal the oracle's."""
    t = load_trace(TRACE)
    eng = _fast_engine(t)
    for mode in ("legacy", "async"):
        got, want = eng.run_trace(t, mode), run_trace(truth, t, mode)
        assert first_difference(got.schedule_log, want.schedule_log) is None, mode
        assert got.tokens == want.tokens and got.digest == want.digest, mode


def test_imported_slot_holds_exactly_the_senders_state():
    """export_state then import_state into a slot that held another request's state: conv windows, SSM states and
    K/V of [0, positions) are the sender's, bitwise (the zeroing by admission comes first)."""
    import torch
    from fastpath.engine.bank import StateBank
    from fastpath.engine.transfer import export_state, import_state
    from oracle.checkpoint import load_checkpoint
    cfg, _ = load_checkpoint(BAMBA)
    g = torch.Generator().manual_seed(5)
    a, b = StateBank(cfg, 2, 16), StateBank(cfg, 2, 16)
    for bank in (a, b):
        for x in (bank.conv_state, bank.ssm_state, bank.k_cache, bank.v_cache):
            x.copy_(torch.randn(x.shape, generator=g))
    s = export_state(a, 1, 11)
    b.zero_slot(0)
    import_state(b, 0, s)
    assert torch.equal(b.conv_state[:, 0], a.conv_state[:, 1]) and torch.equal(b.ssm_state[:, 0], a.ssm_state[:, 1])
    assert torch.equal(b.k_cache[:, 0, :11], a.k_cache[:, 1, :11])
    assert torch.equal(b.v_cache[:, 0, :11], a.v_cache[:, 1, :11])


def test_fast_path_streaming_refuses_a_transfer():
    """Engine.add_request (streaming) refuses a request with a transfer, naming the field."""
    t = load_trace(TRACE)
    with pytest.raises(TraceError, match=r"requests\[0\]\.transfer"):
        _fast_engine(t).add_request(t.requests[0])


@pytest.mark.slow
def test_fast_path_hands_over_as_the_oracle_does_on_the_triton_kernels(truth):
    t = load_trace(TRACE)
    got, want = _fast_engine(t, None).run_trace(t, "legacy"), run_trace(truth, t, "legacy")
    assert first_difference(got.schedule_log, want.schedule_log) is None and got.tokens == want.tokens


def test_qualify_skips_a_transfer_trace_for_an_adapter_without_state_transfer():
    """An adapter whose Capabilities lack state_transfer gets a SKIP naming why and the requests that move; one that
    declares it runs the trace."""
    from hybridqual.adapters.base import Capabilities
    from hybridqual.qualify.checks import context, run_mode
    t = load_trace(TRACE)
    lines = []
    ctx = context(None, BAMBA, t, None, caps=Capabilities(("greedy",), ("legacy",)), mode="legacy")
    assert run_mode(ctx, lines.append) is None
    assert [c.status for c in lines] == ["SKIP"] and "state_transfer" in lines[0].detail, lines
    assert "(transfers: r0, r1)" in lines[0].detail
    from hybridqual.adapters.fastpath import FastpathAdapter
    assert FastpathAdapter.capabilities("cpu").state_transfer


def test_mid_prefill_and_waiting_requests_are_handed_over_as_the_oracle_says(truth):
    """One slot per instance: a is handed over after its first 16-token prefill piece (imported 16, the receiver
    prefills the rest), b while still waiting (it joins the receiver's queue, nothing logged, a fresh admission);
    tokens equal each request alone and the fast path's log equals the oracle's, both modes."""
    obj = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 1, "max_tokens_per_step": 16, "prefill_chunk": 16},
           "requests": [{"id": "a", "arrival_step": 0, "prompt": [(7 * j + 3) % 90 for j in range(20)],
                         "max_new_tokens": 3, "transfer": [{"step": 0, "to": "e1"}]},
                        {"id": "b", "arrival_step": 0, "prompt": [5, 9, 14], "max_new_tokens": 3,
                         "transfer": [{"step": 0, "to": "e1"}]}]}
    t = parse_trace(obj)
    eng = _fast_engine(t)
    for mode in ("legacy", "async"):
        want = run_trace(truth, t, mode)
        assert want.tokens == {r.id: run_request_alone(truth, r)[0] for r in t.requests}
        e1 = {s["step"]: s for s in want.schedule_log.to_json()["instances"]["e1"]}
        assert e1[1]["admit"] == [{"request": "a", "row": 0, "slot": 0, "imported": 16}]
        assert [(b["kind"], b["pos"], b["count"]) for b in e1[1]["batch"]] == [("prefill", 16, 4)]
        assert [a for s in e1.values() for a in s["admit"] if a["request"] == "b"] == [
            {"request": "b", "row": 0, "slot": 0}]
        got = eng.run_trace(t, mode)
        assert first_difference(got.schedule_log, want.schedule_log) is None, mode
        assert got.tokens == want.tokens
