"""The llama.cpp adapter's prefix cache (DESIGN §12) on llama.cpp's own sequence-state snapshots: the worker's
scheduler files and hits checkpoints as the oracle's policy does (default tier, a stand-in for llama.cpp), and the
shipped prefix traces qualify through the real llama.cpp with every prefix-cache line a PASS (marker llamacpp)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import oracle
from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp import worker
from hybridqual.qualify.prefix_checks import CacheEvents, check_cache_policy, events_from_log
from hybridqual.qualify.truth import schedule_model
from oracle.scheduler import run_trace
from oracle.trace import load_trace
from llamacpp_standin import StandIn

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "goldens" / "models"
TRACES = ["prefix_shared_system", "prefix_eviction", "prefix_multi_turn", "prefix_lru"]
needs_venv = pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))


def _requests(trace) -> list[dict]:
    return [{"id": r.id, "arrival_step": r.arrival_step, "prompt": list(r.prompt), "max_new_tokens": r.max_new_tokens,
             "stop_token_ids": list(r.stop_token_ids)} for r in trace.requests]


@pytest.mark.parametrize("name", TRACES)
def test_the_worker_files_and_hits_checkpoints_as_the_oracle_policy(name):
    model = oracle.load(MODELS / "zoo-mamba2")
    trace = load_trace(ROOT / "goldens" / "traces" / f"{name}.json")
    e = trace.engine
    got = StandIn(model.config.vocab_size).run(_requests(trace), min(e.max_requests, len(trace.requests)),
                                                 e.max_tokens_per_step, e.prefill_chunk, model.config.chunk_size,
                                                 e.prefix_cache.to_json())
    truth = run_trace(schedule_model(model), trace, "legacy", forced_tokens=got["tokens"])
    expected = events_from_log(truth.schedule_log)
    check = check_cache_policy(name, expected, CacheEvents.from_report(got["prefix_cache"]))
    assert check.status == "PASS", check.detail
    assert expected.hits and expected.stored                     # the trace exercises the cache


def test_cache_off_runs_no_snapshots_and_reports_nothing():
    trace = load_trace(ROOT / "goldens" / "traces" / "prefix_lru.json")
    eng = StandIn(96)
    eng.snapshot = None                                          # a snapshot taken would fail here
    got = eng.run(_requests(trace), 3, trace.engine.max_tokens_per_step, trace.engine.prefill_chunk, 8, None)
    assert "prefix_cache" not in got and all(got["tokens"].values())


def test_the_adapters_declare_prefix_cache_reporting():
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter, LlamaCppFlashAttnAdapter
    for cls in (LlamaCppAdapter, LlamaCppFlashAttnAdapter):
        caps = cls.capabilities("cpu")
        assert caps.prefix_cache_reporting and "prefix_cache_reporting" not in dict(caps.notes)


def _qualify(engine: str, model: str, out: Path, traces: list[str]) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", engine, "--model", model,
                        "--trace", *traces, "--mode", "legacy", "--quiet", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    report = json.loads((out / "report.json").read_text())
    checks: dict = {}
    for c in report["checks"]:
        checks.setdefault(c["trace"].split(" ")[0], {})[c["name"].split(" (")[0]] = c
    return r.returncode, checks


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("model", ["zoo-mamba2", "zoo-granitemoehybrid"])
def test_the_prefix_traces_qualify_with_the_cache_checks_passing(model, tmp_path):
    rc, checks = _qualify("hybridqual.adapters.llamacpp.adapter:LlamaCppAdapter", model, tmp_path, TRACES)
    assert rc == 0, checks
    assert len(checks) == len(TRACES), sorted(checks)
    for trace, lines in checks.items():
        for name in ("legacy: tokens match the truth", "legacy: logits match the oracle's",
                     "legacy: prefix cache events as the policy predicts"):
            assert lines[name]["status"] == "PASS", (trace, name, lines[name]["detail"])


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("name", TRACES)
def test_bamba_cache_on_equals_off_and_hits_as_the_policy(name):
    """zoo-bamba's GGUF is not the model (docs/findings.md L1: its tokens FAIL against the oracle), but llama.cpp
    with checkpoints restored gives the tokens and logits of llama.cpp recomputing every prefix, with the hits,
    stores and evictions of the oracle's policy."""
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    from hybridqual.qualify.prefix_checks import without_cache
    folder = MODELS / "zoo-bamba"
    trace = load_trace(ROOT / "goldens" / "traces" / f"{name}.json")
    on = LlamaCppAdapter(folder, trace, "legacy").run_trace()
    off = LlamaCppAdapter(folder, without_cache(trace), "legacy").run_trace()
    assert off.prefix_cache is None and on.tokens == off.tokens
    for r in trace.requests:
        assert (on.logits[r.id] - off.logits[r.id]).abs().max().item() < 1e-4, r.id
    truth = run_trace(schedule_model(oracle.load(folder)), trace, "legacy", forced_tokens=on.tokens)
    check = check_cache_policy(name, events_from_log(truth.schedule_log), CacheEvents.from_report(on.prefix_cache))
    assert check.status == "PASS" and CacheEvents.from_report(on.prefix_cache).hits, check.detail
