"""Prefix caching × speculative decoding through the llama.cpp adapter (DESIGN §17): with `store_decoded` the worker
snapshots a decode or verify row's sequence at every generated-token block boundary it passes and files only the
boundaries its step proved verified (pos < p <= pos + emitted), never a lookahead one; speculation's backoff pauses
as the oracle's. The default tier drives the worker's scheduler over a stand-in for llama.cpp (a state over a
rejected draft changes the tokens of the request that hits it); marker llamacpp qualifies the prefix_spec traces,
built for each model from its own greedy tokens, through the real llama.cpp."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import oracle
from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp import worker
from hybridqual.qualify.prefix_checks import CacheEvents, check_cache_policy, events_from_log
from hybridqual.qualify.truth import schedule_model
from hybridqual.scenarios import prefix_spec as scenario
from oracle.schedule_log import verify_rows
from oracle.scheduler import run_trace
from oracle.trace import parse_trace
from llamacpp_standin import StandIn

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "goldens" / "models"
TRACES = ROOT / "goldens" / "traces"
NAMES = ["prefix_spec", "prefix_spec_async"]
needs_venv = pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))


def _requests(obj: dict) -> list[dict]:
    return [{"id": r["id"], "arrival_step": r["arrival_step"], "prompt": list(r["prompt"]),
             "max_new_tokens": r["max_new_tokens"], "stop_token_ids": list(r.get("stop_token_ids", []))}
            for r in obj["requests"]]


def _run(obj: dict, vocab: int, cache: bool = True, spec: bool = True) -> dict:
    e = obj["engine"]
    return StandIn(vocab).run(_requests(obj), e["max_requests"], e["max_tokens_per_step"], e["prefill_chunk"], 8,
                              e.get("prefix_cache") if cache else None, e.get("speculative") if spec else None)


def _standin_instance(name: str, vocab: int) -> dict:
    """The shipped trace with the stand-in's greedy tokens where zoo-bamba's were (tools/scenarios/prefix_spec.py's
    drafts: the same acceptance pattern, so the same steps and arrivals); b<p>'s prompts its tokens [0:p] + a few."""
    obj = json.loads((TRACES / f"{name}.json").read_text())
    long = next(r for r in obj["requests"] if r["id"] == "long")
    alone = {"engine": obj["engine"], "requests": [{**long, "arrival_step": 0}]}
    o = _run(alone, vocab, cache=False, spec=False)["tokens"]["long"]
    make = scenario._legacy_proposals if name == "prefix_spec" else scenario._async_proposals
    obj["engine"]["speculative"]["proposer"]["proposals"] = {"long": make(o, vocab)}
    full = list(long["prompt"]) + o
    for r in obj["requests"]:
        if r["id"].startswith("b") and r["id"][1:].isdigit():
            p = int(r["id"][1:])
            r["prompt"] = full[:p] + r["prompt"][p:]
    return obj


def _oracle_replay(obj: dict, tokens: dict):
    model = oracle.load(MODELS / "zoo-bamba")
    trace = parse_trace(obj, model.config.vocab_size)
    return run_trace(schedule_model(model), trace, "legacy", forced_tokens=tokens)


@pytest.mark.parametrize("name", NAMES)
def test_decode_stores_and_their_hits_are_the_policys_and_keep_each_requests_tokens(name):
    """Cache and speculation on give the tokens and logits of both off (the stand-in's logits are a function of the
    sequence's whole token list); the stores, evictions and hits equal the oracle's policy replayed on those tokens,
    decode-stored checkpoints among them and hit by b<p>; the proposed/accepted counts are the oracle's."""
    vocab = oracle.load(MODELS / "zoo-bamba").config.vocab_size
    obj = _standin_instance(name, vocab)
    on, off = _run(obj, vocab), _run(obj, vocab, cache=False, spec=False)
    assert on["tokens"] == off["tokens"] and on["logits"] == off["logits"]
    truth = _oracle_replay(obj, on["tokens"])
    expected = events_from_log(truth.schedule_log)
    check = check_cache_policy(name, expected, CacheEvents.from_report(on["prefix_cache"]))
    assert check.status == "PASS", check.detail
    decode_stored = {p for rid, p in expected.stored if rid == "long" and p > 6}
    hits = {rid: p for rid, p in expected.hits.items() if rid.startswith("b")}
    assert decode_stored and hits and set(hits.values()) <= decode_stored, (expected.stored, hits)
    want: dict[str, list[int]] = {}
    for v in verify_rows(truth.schedule_log):
        c = want.setdefault(v["request"], [0, 0])
        c[0], c[1] = c[0] + len(v["proposals"]), c[1] + v["accepted"]
    got = {rid: [c["proposed"], c["accepted"]] for rid, c in on["speculation"].items()}
    assert got == want and any(c[1] < c[0] for c in want.values())
    if name == "prefix_spec":                          # full acceptance at n=8; the async drafts all miss (backoff)
        assert any(c[1] for c in want.values())


def test_storing_a_lookahead_boundary_is_caught(monkeypatch):
    """A worker that files every boundary a verify row fed (the rejected drafts' lookahead too, vLLM PR #48375's
    class) stores a state over a rejected draft: the request that hits it gets other tokens, and the stores are not
    the policy's."""
    vocab = oracle.load(MODELS / "zoo-bamba").config.vocab_size
    obj = _standin_instance("prefix_spec", vocab)
    resolve = worker.Engine._resolve

    def all_verified(self, props, *a):
        fed = {rid: len(d[0]) + 1 for rid, d in props.items()}
        resolve(self, props, *a)
        return fed
    monkeypatch.setattr(worker.Engine, "_resolve", all_verified)
    on, off = _run(obj, vocab), _run(obj, vocab, cache=False, spec=False)
    assert on["tokens"] != off["tokens"]
    truth = _oracle_replay(obj, on["tokens"])
    check = check_cache_policy("prefix_spec", events_from_log(truth.schedule_log),
                               CacheEvents.from_report(on["prefix_cache"]))
    assert check.status == "FAIL", check.detail


def test_backoff_pauses_proposals_as_the_oracle():
    """spec_backoff's engine (k 2, backoff 4) with an ngram proposer on a small vocabulary (drafts miss often): the
    worker's proposed/accepted counts equal the oracle's scheduler and backoff replayed on its tokens, and backoff
    proposes less than the same trace without it."""
    obj = json.loads((TRACES / "spec_backoff.json").read_text())
    for r in obj["requests"]:
        r.pop("sampling", None)
    obj["engine"]["speculative"]["proposer"] = {"kind": "ngram", "min_n": 1, "max_n": 2}
    vocab = 10
    for r in obj["requests"]:
        r["prompt"] = [t % vocab for t in r["prompt"]]
    got = _run(obj, vocab)
    truth = run_trace(schedule_model(oracle.load(MODELS / "zoo-mamba2")), parse_trace(obj, vocab), "legacy",
                      forced_tokens=got["tokens"])
    want: dict[str, list[int]] = {}
    for v in verify_rows(truth.schedule_log):
        c = want.setdefault(v["request"], [0, 0])
        c[0], c[1] = c[0] + len(v["proposals"]), c[1] + v["accepted"]
    assert {rid: [c["proposed"], c["accepted"]] for rid, c in got["speculation"].items()} == want
    no_backoff = {**obj, "engine": {**obj["engine"], "speculative": {**obj["engine"]["speculative"], "backoff": 0}}}
    free = _run(no_backoff, vocab)
    assert free["tokens"] == got["tokens"]
    total = sum(c["proposed"] for c in got["speculation"].values())
    assert 0 < total < sum(c["proposed"] for c in free["speculation"].values())


LINES = ("legacy: tokens match the truth", "legacy: logits match the oracle's",
         "legacy: prefix cache events as the policy predicts", "legacy: speculation counts match the oracle's")


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("model", ["zoo-granitemoehybrid", "zoo-mamba2"])
def test_prefix_spec_traces_qualify_through_llama_cpp(model, tmp_path):
    """prefix_spec and prefix_spec_async built from the model's own greedy tokens (legacy mode: llama.cpp has no
    async one): tokens, logits, cache events and speculation counts all PASS, with hits on decode stores."""
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    from oracle.trace import load_trace
    from test_llamacpp_prefix_cache import _qualify
    files = scenario.write(MODELS / model, tmp_path / "traces")
    rc, checks = _qualify("llamacpp", model, tmp_path / "out", [str(f) for f in files])
    assert rc == 0, checks
    for f in files:
        lines = checks[f"{model}/{f.stem}"]
        for name in LINES:
            assert lines[name]["status"] == "PASS", (f.stem, name, lines[name]["detail"])
        run = LlamaCppAdapter(MODELS / model, load_trace(f), "legacy").run_trace()
        hits = {a["request"]: a["cached_tokens"] for a in run.prefix_cache["admit"] if a["request"][1:].isdigit()}
        assert hits and all(p == int(rid[1:]) for rid, p in hits.items()), hits    # b<p> hits long's decode store


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("name", NAMES)
def test_bamba_cache_and_speculation_on_equal_both_off(name):
    """zoo-bamba's GGUF is not the model (docs/findings.md L1), but on the shipped traces llama.cpp with decode stores,
    hits and rollbacks gives the tokens and logits of llama.cpp with neither, and the oracle's events and counts."""
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    from hybridqual.qualify.prefix_checks import without_cache
    from hybridqual.qualify.spec_checks import without_speculation
    from oracle.trace import load_trace
    folder, trace = MODELS / "zoo-bamba", load_trace(TRACES / f"{name}.json")
    a = LlamaCppAdapter(folder, trace, "legacy")
    on = a.run_trace()
    off = LlamaCppAdapter(folder, without_speculation(without_cache(trace)), "legacy").run_trace()
    assert on.tokens == off.tokens
    for r in trace.requests:
        assert (on.logits[r.id] - off.logits[r.id]).abs().max().item() < 1e-4, r.id
    truth = run_trace(schedule_model(oracle.load(folder)), trace, "legacy", forced_tokens=on.tokens)
    check = check_cache_policy(name, events_from_log(truth.schedule_log), CacheEvents.from_report(on.prefix_cache))
    assert check.status == "PASS", check.detail
    if name == "prefix_spec":         # async: llama.cpp's other tokens (L1) leave b24's prompt no cached prefix
        assert CacheEvents.from_report(on.prefix_cache).hits, on.prefix_cache
