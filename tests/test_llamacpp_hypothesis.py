"""Generated traces through the in-process llama.cpp adapter against the fp64 oracle (marker llamacpp; a few seeded
hypothesis examples): staggered arrivals, slot reuse, stop ids, prompts sharing prefixes, most of them with a
prefix cache — tokens as each request alone (tie-aware at float32's τ), logits rows within f32 rounding, and the
cache's hits, stores and evictions as the oracle's policy."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

import oracle
from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.qualify.compare import compare_tie_aware, tau_for, teacher_forced_logits
from hybridqual.qualify.prefix_checks import CacheEvents, check_cache_policy, events_from_log
from hybridqual.qualify.truth import schedule_model
from oracle.scheduler import run_trace
from oracle.trace import (EngineConfig, PrefixCacheConfig, Request, Trace, TraceError, check_against_model,
                          model_positions)

pytestmark = [pytest.mark.llamacpp,
              pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))]
MODELS = Path(__file__).resolve().parents[1] / "goldens" / "models"
C, VOCAB = 8, 96                     # the zoo models' chunk size and vocabulary


@st.composite
def traces(draw) -> Trace:
    """2-5 requests cut from 1-2 base prompts (so prefixes are shared) plus a few own tokens, arrivals 0-5, 1-3
    sequences, pieces of one or two chunks, a stop id sometimes; a prefix cache (block 1-2 chunks, 1-3 entries)
    two times in three."""
    R = draw(st.integers(1, 3))
    P = draw(st.sampled_from([C, 2 * C]))
    budget = draw(st.integers(R - 1 + P, R - 1 + 3 * C))
    bases = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=2 * C, max_size=4 * C))
             for _ in range(draw(st.integers(1, 2)))]
    reqs = []
    for i in range(draw(st.integers(2, 5))):
        base = draw(st.sampled_from(bases))
        prompt = base[:draw(st.integers(1, len(base)))] + draw(st.lists(st.integers(1, VOCAB - 1), max_size=5))
        stops = tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=1)))
        reqs.append(Request(f"r{i}", draw(st.integers(0, 5)), tuple(prompt), draw(st.integers(1, 4)), stops))
    cache = PrefixCacheConfig(C * draw(st.integers(1, 2)), draw(st.integers(1, 3))) if draw(st.sampled_from([True, True, False])) else None
    return Trace(EngineConfig(R, budget, P, "legacy", prefix_cache=cache), tuple(reqs))


@pytest.mark.parametrize("name", ["zoo-granitemoehybrid", "zoo-mamba2"])
@settings(max_examples=16, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(trace=traces())
def test_generated_traces_match_the_oracle(name, trace):
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    folder = MODELS / name
    model = _model(folder)
    try:
        trace = check_against_model(trace, VOCAB, C, model_positions(model.config))
    except TraceError:
        assume(False)
    run = LlamaCppAdapter(folder, trace, "legacy").run_trace()
    for r in trace.requests:
        got = run.tokens[r.id]
        v = compare_tie_aware(model, r.id, r.prompt, got, r.stop_token_ids, r.max_new_tokens, tau_for(torch.float32))
        assert v.ok, (r.id, v.failure, trace)
        err = (run.logits[r.id].double() - teacher_forced_logits(model, r.prompt, got)).abs().max().item()
        assert err < 1e-4, (r.id, err)
    if trace.engine.prefix_cache is not None:
        truth = run_trace(schedule_model(model), trace, "legacy", forced_tokens=run.tokens)
        check = check_cache_policy("generated", events_from_log(truth.schedule_log),
                                   CacheEvents.from_report(run.prefix_cache))
        assert check.status == "PASS", (check.detail, trace)
        event(f"prefix cache, {len(CacheEvents.from_report(run.prefix_cache).hits)} hits")
    else:
        assert run.prefix_cache is None
        event("no prefix cache")
    event(f"{len(trace.requests)} requests on {trace.engine.max_requests} sequences")


_MODELS: dict = {}


def _model(folder: Path):
    if folder not in _MODELS:
        _MODELS[folder] = oracle.load(folder)
    return _MODELS[folder]
