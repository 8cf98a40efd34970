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
    from tools.compare import TAU, compare_tie_aware
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
