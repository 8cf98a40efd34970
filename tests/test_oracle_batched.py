"""The batched oracle pass (oracle/batched.py): many segments through one pass over the weights give each segment
exactly what OracleModel.forward gives it alone (CPU, segment-wise rows), and the stacked GEMMs stay within fp64
rounding of it; the batched scheduler's tokens, logs and digests equal the per-row scheduler's."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from oracle import batched as oracle_batched, zoo
from oracle.batched import Segment, forward_segments
from oracle.checkpoint import load_checkpoint
from oracle.model import OracleModel
from oracle.scheduler import run_trace
from oracle.trace import load_trace

GOLDENS = Path(__file__).parent.parent / "goldens"

ARCHS = ["bamba", "nemotron_h", "mamba2", "granitemoehybrid"]


def _model(arch: str, seed: int = 0) -> OracleModel:
    cfg = zoo.tiny_config(arch)
    return OracleModel(cfg, zoo.random_weights(cfg, seed=seed))


def _mixed_segments(model: OracleModel, rng: random.Random) -> list[Segment]:
    """Fresh prefills, prefill pieces continuing a state, and decode tokens, of several lengths."""
    V, segs = model.config.vocab_size, []
    for kind in ("fresh", "piece", "decode", "fresh", "decode", "piece"):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 21))]
        if kind == "fresh":
            segs.append(Segment(prompt, None))
            continue
        _, state = model.forward(prompt, None, "chunked")[:2]
        if kind == "piece":
            segs.append(Segment([rng.randrange(V) for _ in range(rng.randint(1, 13))], state))
        else:
            segs.append(Segment([rng.randrange(V)], state, "recurrence"))
    return segs


def _states_equal(a, b) -> bool:
    same = lambda x, y: x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # noqa: E731
    return a.position == b.position and same(a.conv, b.conv) and same(a.ssm, b.ssm) and same(a.k, b.k) and \
        same(a.v, b.v)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_pass_is_bitwise_each_segment_alone(arch):
    model = _model(arch)
    segs = _mixed_segments(model, random.Random(7))
    got = forward_segments(model, segs, stacked=False)
    for s, (logits, state) in zip(segs, got):
        ref_logits, ref_state, _ = model.forward(s.tokens, s.state, s.scan)
        assert torch.equal(logits, ref_logits)
        assert _states_equal(state, ref_state)


@pytest.mark.parametrize("arch", ARCHS)
def test_stacked_gemms_stay_within_fp64_rounding_of_each_segment_alone(arch):
    model = _model(arch, seed=1)
    segs = _mixed_segments(model, random.Random(11))
    for s, (logits, state) in zip(segs, forward_segments(model, segs, stacked=True)):
        ref_logits, ref_state, _ = model.forward(s.tokens, s.state, s.scan)
        assert torch.allclose(logits, ref_logits, rtol=1e-10, atol=1e-10)
        assert state.position == ref_state.position
        for i in ref_state.ssm:
            assert torch.allclose(state.ssm[i], ref_state.ssm[i], rtol=1e-10, atol=1e-10)


def test_batched_pass_does_not_touch_the_states_it_continues_from():
    model = _model("bamba")
    segs = _mixed_segments(model, random.Random(3))
    before = [None if s.state is None else s.state.clone() for s in segs]
    forward_segments(model, segs)
    for s, b in zip(segs, before):
        assert (s.state is None and b is None) or _states_equal(s.state, b)


def test_a_bad_segment_is_named():
    model = _model("mamba2")
    with pytest.raises(ValueError, match=r"segments\[1\]\.tokens: empty"):
        forward_segments(model, [Segment([1], None), Segment([], None)])
    with pytest.raises(ValueError, match=r"segments\[0\]\.tokens: ids \[96\]"):
        forward_segments(model, [Segment([96], None)])


def test_scheduler_steps_with_one_pass_give_the_per_row_tokens_and_log(monkeypatch):
    cfg, tensors = load_checkpoint(GOLDENS / "models" / "zoo-bamba")
    trace = load_trace(GOLDENS / "traces" / "seed_compaction.json")
    batched, per_row = OracleModel(cfg, tensors), OracleModel(cfg, tensors)
    per_row.stack_rows = None                 # a model that does not batch: every row on its own
    calls = []
    real = oracle_batched.forward_segments
    monkeypatch.setattr("oracle.scheduler.forward_segments",
                        lambda m, segs, *a: calls.append(len(segs)) or real(m, segs, *a))
    for mode in ("legacy", "async"):
        a, b = run_trace(batched, trace, mode), run_trace(per_row, trace, mode)
        assert a.tokens == b.tokens and a.digest == b.digest
    assert calls and max(calls) >= 2          # the steps really shared passes


def test_qualify_prefetch_scores_every_request_in_one_pass_bitwise_as_alone():
    from hybridqual.qualify.compare import teacher_forced_logits
    from hybridqual.qualify.context import OracleRows
    cfg, tensors = load_checkpoint(GOLDENS / "models" / "zoo-bamba")
    model = OracleModel(cfg, tensors)
    trace = load_trace(GOLDENS / "traces" / "seed_compaction.json")
    tokens = run_trace(model, trace, "legacy").tokens
    rows = OracleRows(model)
    rows.prefetch(trace, tokens)
    assert len(rows.cache) == sum(1 for r in trace.requests if tokens[r.id])
    for r in trace.requests:
        assert torch.equal(rows.get(r, tokens[r.id]), teacher_forced_logits(model, r.prompt, tokens[r.id]))
