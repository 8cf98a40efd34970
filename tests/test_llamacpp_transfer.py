"""State transfer through llama.cpp (DESIGN §19): the worker runs one llama.cpp context per engine instance in lock
step and hands a request's sequence state over with llama_state_seq_get_data / set_data. The default tier drives the
worker's instances over a stand-in for llama.cpp (a wrong or missing import changes the tokens); marker llamacpp runs
qualify on the shipped transfer_handover trace through the real llama.cpp."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import oracle
from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp import worker
from hybridqual.qualify.truth import schedule_model
from oracle.scheduler import run_trace
from oracle.trace import load_trace
from llamacpp_standin import StandIn

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "goldens" / "models"
HANDOVER = ROOT / "goldens" / "traces" / "transfer_handover.json"
needs_venv = pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))


def _requests(trace, transfers: bool = True) -> list[dict]:
    return [{"id": r.id, "arrival_step": r.arrival_step, "prompt": list(r.prompt), "max_new_tokens": r.max_new_tokens,
             "stop_token_ids": list(r.stop_token_ids),
             **({"transfer": [t.to_json() for t in r.transfer]} if transfers and r.transfer else {})}
            for r in trace.requests]


def _busy_trace(tmp_path: Path) -> Path:
    """One slot per instance: a hand-over mid-prefill (a: prompt 20 > prefill_chunk 8) and back while the receiver's
    slot is taken (it waits in transit, ahead of e's arrival), one while still waiting (b), one mid-decode (c)."""
    reqs = [{"id": "a", "arrival_step": 0, "prompt": list(range(3, 23)), "max_new_tokens": 6,
             "transfer": [{"step": 1, "to": "x"}, {"step": 4, "to": "main"}]},
            {"id": "b", "arrival_step": 0, "prompt": [40, 41, 42, 43, 44, 45], "max_new_tokens": 4,
             "transfer": [{"step": 1, "to": "x"}]},
            {"id": "c", "arrival_step": 1, "prompt": [50, 52, 54, 56, 58], "max_new_tokens": 6,
             "transfer": [{"step": 3, "to": "y"}]},
            {"id": "d", "arrival_step": 2, "prompt": [60, 61, 62, 63, 64, 65, 66], "max_new_tokens": 3},
            {"id": "e", "arrival_step": 3, "prompt": [70, 71, 72, 73], "max_new_tokens": 2}]
    out = tmp_path / "busy.json"
    out.write_text(json.dumps({"schema": "hybridqual.trace/1", "engine": {"max_requests": 1, "max_tokens_per_step": 8,
                                                                          "prefill_chunk": 8}, "requests": reqs}))
    return out


def _oracle_placements(log) -> dict[str, list[tuple]]:
    """(engine, step, imported) of every admission in the oracle's schedule log, per request."""
    out: dict[str, list[tuple]] = {}
    for name, steps in [("main", [r.to_json() for r in log.steps])] + [
            (n, [r.to_json() if hasattr(r, "to_json") else r for r in recs]) for n, recs in log.instances.items()]:
        for rec in steps:
            for a in rec["admit"]:
                out.setdefault(a["request"], []).append((name, rec["step"], a.get("imported")))
    return {rid: sorted(v, key=lambda t: t[1]) for rid, v in out.items()}


@pytest.mark.parametrize("which", ["handover", "busy"])
def test_the_worker_hands_over_where_and_when_the_oracle_does_and_tokens_continue(which, tmp_path):
    path = HANDOVER if which == "handover" else _busy_trace(tmp_path)
    trace = load_trace(path)
    model = oracle.load(MODELS / "zoo-mamba2")
    e, chunk = trace.engine, model.config.chunk_size
    n = min(e.max_requests, len(trace.requests))
    moved = StandIn(model.config.vocab_size).run(_requests(trace), n, e.max_tokens_per_step, e.prefill_chunk, chunk)
    alone = {r["id"]: StandIn(model.config.vocab_size).run([{**r, "arrival_step": 0}], 1, e.max_tokens_per_step,
                                                             e.prefill_chunk, chunk)["tokens"][r["id"]]
             for r in _requests(trace, transfers=False)}
    assert moved["tokens"] == alone                              # continuity: each request's run alone
    truth = run_trace(schedule_model(model), trace, "legacy", forced_tokens=moved["tokens"])
    want = _oracle_placements(truth.schedule_log)
    got = {rid: [(p["engine"], p["step"], p.get("imported")) for p in ps] for rid, ps in moved["placements"].items()}
    assert got == want
    assert any(imp for ps in want.values() for _, _, imp in ps)  # some state was imported
    if which == "handover":                                      # r1 lands in the receiver's seq id r0 finished in
        assert moved["placements"]["r1"][-1] == {"engine": "decode", "seq": 0, "step": 6, "imported": 14}
        assert moved["placements"]["r0"][-1]["seq"] == 0


def test_a_missing_import_breaks_continuity():
    """The stand-in's check has teeth: a receiver that does not write the moved state decodes from an empty one."""
    trace = load_trace(HANDOVER)
    eng = StandIn(96)
    eng.peer("decode").restore = lambda data, seq: None
    e = trace.engine
    with pytest.raises(AssertionError, match="row at position"):
        eng.run(_requests(trace), 2, e.max_tokens_per_step, e.prefill_chunk, 8)


def test_the_adapters_declare_state_transfer():
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter, LlamaCppFlashAttnAdapter
    assert all(cls.capabilities("cpu").state_transfer for cls in (LlamaCppAdapter, LlamaCppFlashAttnAdapter))


def _qualify(model: str, out: Path) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", "llamacpp", "--model", model,
                        "--trace", str(HANDOVER), "--mode", "legacy", "--quiet", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    report = json.loads((out / "report.json").read_text())
    return r.returncode, {c["name"].split(" (")[0]: c for c in report["checks"]}


@pytest.mark.llamacpp
@needs_venv
def test_transfer_handover_qualifies_through_llamacpp(tmp_path):
    """zoo-granitemoehybrid (a GGUF that is the model; zoo-bamba's is not: docs/findings.md L1): with r0 handed over
    after its prefill and r1 mid-decode, every request's tokens and logits equal the fp64 oracle's."""
    rc, lines = _qualify("zoo-granitemoehybrid", tmp_path)
    assert "legacy: engine runs the trace" not in lines, lines.get("legacy: engine runs the trace")   # a FAIL/SKIP
    for name in ("legacy: tokens match the truth", "legacy: logits match the oracle's"):
        assert lines[name]["status"] == "PASS", (name, lines[name]["detail"])
    assert rc == 0, {n: c["status"] for n, c in lines.items()}

