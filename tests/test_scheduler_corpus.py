"""Every corpus trace: legacy and async give every request the same tokens, equal to the request run alone
through the oracle model (whole prompt in one prefill), for every tiny zoo architecture and the fake model."""
from __future__ import annotations

from pathlib import Path

import pytest

from oracle import zoo
from oracle.schedule_log import canonical_json, digest
from oracle.scheduler import run_request_alone, run_trace
from oracle.trace import load_trace
from test_scheduler_fake import FakeModel

CORPUS = sorted((Path(__file__).resolve().parents[1] / "goldens" / "traces").glob("*.json"))
MODELS = {"fake": lambda: FakeModel(vocab_size=96, chunk_size=8, seed=0),    # 96: the zoo vocab the corpus is written for
          **{arch: (lambda a=arch: zoo.build(a, seed=0)) for arch in zoo.ARCHS}}


def test_corpus_covers_the_required_scenarios():
    names = {p.stem for p in CORPUS}
    assert {"seed_compaction", "chunked_prefill", "slot_exhaustion", "stop_tokens"} <= names
    chunked = load_trace(CORPUS[[p.stem for p in CORPUS].index("chunked_prefill")])
    assert max(len(r.prompt) for r in chunked.requests) > chunked.engine.max_tokens_per_step


# The scheduler is model-agnostic: the default tier runs the fake model and bamba; other architectures are slow.
MODEL_PARAMS = [m if m in ("fake", "bamba") else pytest.param(m, marks=pytest.mark.slow)
                for m in sorted(MODELS)]


@pytest.mark.parametrize("model_name", MODEL_PARAMS)
@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_async_matches_legacy_and_each_request_alone(path, model_name):
    model, trace = MODELS[model_name](), load_trace(path)
    from hybridqual.qualify.spec_checks import unfit_reason
    if unfit_reason(trace, model.config.vocab_size):          # speculative traces made for the zoo's vocab
        pytest.skip(unfit_reason(trace, model.config.vocab_size))
    legacy, asyn = run_trace(model, trace, "legacy"), run_trace(model, trace, "async")
    assert legacy.tokens == asyn.tokens
    assert legacy.finish_reasons == asyn.finish_reasons
    for req in trace.requests:
        alone, reason = run_request_alone(model, req)
        assert legacy.tokens[req.id] == alone, req.id
        assert legacy.finish_reasons[req.id] == reason
    assert legacy.digest == digest(legacy.schedule_log) != asyn.digest
    assert canonical_json(legacy.schedule_log) == canonical_json(legacy.schedule_log.to_json())


def test_stop_token_trace_finishes_some_requests_by_stop_and_appends_the_stop_token():
    trace = load_trace(CORPUS[[p.stem for p in CORPUS].index("stop_tokens")])
    result = run_trace(zoo.build("bamba", seed=0), trace, "async")
    stopped = [rid for rid, why in result.finish_reasons.items() if why == "stop"]
    assert stopped
    for rid in stopped:
        toks = result.tokens[rid]
        assert toks[-1] in trace.request(rid).stop_token_ids
        assert not any(t in trace.request(rid).stop_token_ids for t in toks[:-1])
    assert any(s.overlap for s in result.schedule_log.steps)


def test_chunked_prefill_pieces_are_chunk_aligned_with_real_chunk_size():
    model = zoo.build("bamba", seed=0)
    trace = load_trace(CORPUS[[p.stem for p in CORPUS].index("chunked_prefill")])
    C = model.config.chunk_size
    pieces = [(b.request, b.pos, b.count) for s in run_trace(model, trace, "legacy").schedule_log.steps
              for b in s.batch if b.kind == "prefill"]
    long_pieces = [(p, n) for rid, p, n in pieces if rid == "long"]
    assert len(long_pieces) >= 3
    assert sum(n for _, n in long_pieces) == 45
    for p, n in long_pieces[:-1]:
        assert p % C == 0 and (p + n) % C == 0
