"""GPU tier of the engine: bf16 on the corpus traces — async == legacy bitwise, tokens tie-aware vs the oracle,
schedule log == the oracle's wherever the tokens agree."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oracle import zoo
from oracle.model import OracleModel
from oracle.scheduler import run_trace as oracle_run_trace
from oracle.trace import load_trace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# The oracle (fp64, CPU) bounds this test's time: corpus traces up to 120 tokens of work (as the CPU tier's Triton runs).
CORPUS = [p for p in sorted((Path(__file__).parent.parent / "goldens" / "traces").glob("*.json"))
          if sum(len(r.prompt) + r.max_new_tokens for r in load_trace(p).requests) <= 120]


@pytest.fixture(scope="module")
def models():
    from fastpath import FastModel
    cfg = zoo.tiny_config("bamba")
    w = zoo.random_weights(cfg, seed=3)
    return OracleModel(cfg, w, dtype=torch.float64), FastModel(cfg, w, "cuda", torch.bfloat16)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_bf16_engine_async_equals_legacy_and_tracks_oracle(models, path, graphs):
    from fastpath import Engine
    from hybridqual.qualify.compare import TAU, compare_tie_aware
    oracle_model, fast = models
    trace = load_trace(path)
    eng = Engine(fast, trace.engine, max_len=96, graphs=graphs)
    legacy, async_ = eng.run_trace(trace, "legacy"), eng.run_trace(trace, "async")
    assert legacy.tokens == async_.tokens
    want = oracle_run_trace(oracle_model, trace, "legacy")
    for req in trace.requests:
        if req.sampling.kind != "greedy":
            continue
        v = compare_tie_aware(oracle_model, req.id, req.prompt, legacy.tokens[req.id], req.stop_token_ids,
                              req.max_new_tokens, TAU[torch.bfloat16])
        assert v.ok, f"{req.id}: {v.failure} {v.note}"
    if legacy.tokens == want.tokens:
        assert legacy.digest == want.digest
        assert async_.digest == oracle_run_trace(oracle_model, trace, "async").digest


def _kept_logits(eng, trace, mode):
    from fastpath.batch_invariant import run_recording_logits
    result, rows = run_recording_logits(eng, trace, mode)
    kept = {(r.id, len(r.prompt) + i) for r in trace.requests for i in range(len(result.tokens[r.id]))}
    return result, {k: rows[k] for k in kept}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_bf16_async_matches_legacy_logits_bitwise(models, path, graphs):
    """Not only the tokens: every kept logits row is bitwise equal in the two modes (legacy's shadow rows give
    both the same row counts, so the same cuBLAS kernels / GEMV / graph buckets: docs/engine.md)."""
    from fastpath import Engine
    _, fast = models
    trace = load_trace(path)
    eng = Engine(fast, trace.engine, max_len=96, graphs=graphs)
    leg, rows_leg = _kept_logits(eng, trace, "legacy")
    asy, rows_asy = _kept_logits(eng, trace, "async")
    assert leg.tokens == asy.tokens
    assert rows_leg.keys() == rows_asy.keys()
    assert [k for k in sorted(rows_leg) if not torch.equal(rows_leg[k], rows_asy[k])] == []


def test_bf16_without_shadow_rows_async_and_legacy_logits_differ(models, monkeypatch):
    """The control on the GPU: with legacy's shadow rows switched off, a finish that leaves one row sends legacy's
    next step through the one-row GEMV and async's through cuBLAS, and their logits rows differ."""
    from fastpath import Engine
    _, fast = models
    from oracle.trace import EngineConfig, Request, Trace
    # a finishes after one decode step; b then decodes alone: one row in legacy, two (a's extra) in async
    trace = Trace(EngineConfig(2, 32, 16, "legacy"), (Request("a", 0, (3, 9, 27, 4), 2), Request("b", 0, (11, 5, 8), 4)))
    eng = Engine(fast, trace.engine, max_len=96)
    asy, rows_asy = _kept_logits(eng, trace, "async")
    monkeypatch.setattr(eng, "shadow_rows", lambda prev: [])
    leg, rows_leg = _kept_logits(eng, trace, "legacy")
    assert any(not torch.equal(rows_leg[k], rows_asy[k]) for k in rows_leg if k in rows_asy)
