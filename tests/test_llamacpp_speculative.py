"""Speculative decoding through the llama.cpp adapter (DESIGN §13): scripted and ngram proposals verified in
llama.cpp's own batches, a rejection rolled back to the sequence-state snapshot taken before the step. The worker's
scheduler on a stand-in for llama.cpp gives the tokens of plain decode (default tier); the shipped speculative traces
qualify through the real llama.cpp (marker llamacpp)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp.adapter import speculative_config
from oracle.trace import load_trace
from test_llamacpp_prefix_cache import _qualify, _requests, _StandIn

ROOT = Path(__file__).resolve().parents[1]
TRACES = ["spec_accept", "spec_scripted", "spec_ngram"]
needs_venv = pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))


def _run(trace, spec: dict | None) -> dict:
    e = trace.engine
    eng = _StandIn(10)                      # a small vocab: ngram matches come often
    return eng.run(_requests(trace), e.max_requests, e.max_tokens_per_step, e.prefill_chunk, 8, None, spec)


@pytest.mark.parametrize("name", TRACES)
def test_verified_proposals_give_the_tokens_of_plain_decode_and_rejections_roll_back(name):
    """The stand-in's logits are a function of the sequence's whole token list and it asserts every row's position,
    so a kept rejected draft, a missing restore or a wrong re-decode changes the tokens or fails."""
    trace = load_trace(ROOT / "goldens" / "traces" / f"{name}.json")
    spec = speculative_config(trace.engine.speculative)
    assert spec is not None
    plain, fast = _run(trace, None), _run(trace, spec)
    assert fast["tokens"] == plain["tokens"] and fast["logits"] == plain["logits"]
    counts = fast["speculation"]
    assert sum(c["proposed"] for c in counts.values()) > 0
    assert sum(c["rollbacks"] for c in counts.values()) > 0          # random logits: drafts are rejected


def test_full_acceptance_keeps_the_verify_state_and_emits_the_bonus():
    """Scripted drafts equal to plain decode's own tokens: all accepted, no rollback, the bonus token emitted."""
    trace = load_trace(ROOT / "goldens" / "traces" / "spec_scripted.json")
    plain = _run(trace, None)
    k = 3
    table = {rid: {str(n): toks[n:n + k] for n in range(1, len(toks) - 1, k + 1)}
             for rid, toks in plain["tokens"].items()}
    spec = {"k": k, "proposer": {"kind": "scripted", "proposals": table}}
    fast = _run(trace, spec)
    assert fast["tokens"] == plain["tokens"]
    counts = fast["speculation"]
    assert sum(c["accepted"] for c in counts.values()) == sum(c["proposed"] for c in counts.values()) > 0
    assert all(c["rollbacks"] == 0 for c in counts.values())


def test_a_draft_model_trace_runs_without_speculation():
    trace = load_trace(ROOT / "goldens" / "traces" / "spec_draft.json")
    assert speculative_config(trace.engine.speculative) is None
    assert speculative_config(dataclasses.replace(trace.engine, speculative=None).speculative) is None


def _greedy(name: str):
    """A shipped speculative trace with every request greedy (the llama.cpp adapter samples greedily only)."""
    from oracle.trace import parse_trace
    obj = load_trace(ROOT / "goldens" / "traces" / f"{name}.json").to_json()
    for r in obj["requests"]:
        r["sampling"] = {"kind": "greedy"}
    return parse_trace(obj)


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("model", ["zoo-mamba2", "zoo-granitemoehybrid"])
def test_spec_accept_qualifies_through_llama_cpp(model, tmp_path):
    rc, checks = _qualify("hybridqual.adapters.llamacpp.adapter:LlamaCppAdapter", model, tmp_path, ["spec_accept"])
    assert rc == 0, checks
    lines = checks[f"{model}/spec_accept"]
    for name in ("legacy: tokens match the truth", "legacy: logits match the oracle's"):
        assert lines[name]["status"] == "PASS", (name, lines[name]["detail"])


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("name", TRACES)
@pytest.mark.parametrize("model", ["zoo-mamba2", "zoo-granitemoehybrid"])
def test_llama_cpp_speculation_equals_plain_decode_and_rolls_back(model, name):
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    from hybridqual.qualify.spec_checks import without_speculation
    folder, trace = ROOT / "goldens" / "models" / model, _greedy(name)
    a = LlamaCppAdapter(folder, trace, "legacy")
    on = a.run_trace()
    off = LlamaCppAdapter(folder, without_speculation(trace), "legacy").run_trace()
    assert on.tokens == off.tokens
    for rid, lg in off.logits.items():
        assert (on.logits[rid] - lg).abs().max().item() < 1e-4, rid
    counts = a.speculation
    assert sum(c["proposed"] for c in counts.values()) > 0, counts
    assert on.schedule_facts == [{"speculation": counts}]
    if name == "spec_accept":         # full acceptance and rejections at the last draft, on the model's own tokens
        assert sum(c["rollbacks"] for c in counts.values()) > 0, counts
