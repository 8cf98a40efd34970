"""Async == legacy bitwise needs the same row counts: an async step still computes the rows of requests that finished
one step earlier (DESIGN §4), and a projection's bits depend on the number of rows (cuBLAS picks kernels by M; one
row takes the folded GEMV).  Legacy runs those rows as unlogged shadow rows (Engine.shadow_rows).  On CPU the
one-row GEMV (`FastOptions.gemv_on_cpu`) plays the part of the GPU's M-dependent kernels."""
from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.batch_invariant import run_recording_logits  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import OracleModel, zoo  # noqa: E402
from oracle.scheduler import run_trace as oracle_run_trace  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

SMALL = dict(pattern="M*M", hidden_size=32, mamba_n_heads=4, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
# a finishes by length after one decode step; b decodes on alone: legacy's next step has one row, async's two
TRACE = (Request("a", 0, (3, 9, 27, 4), 2), Request("b", 0, (11, 5, 8), 4))


@functools.cache
def _cached(mode: str, pad_decode: bool):
    return _run(mode, pad_decode)


def _run(mode: str, pad_decode: bool, shadows: bool = True, monkeypatch=None):
    cfg = zoo.tiny_config("bamba", **SMALL)
    model = FastModel(cfg, zoo.random_weights(cfg, seed=5), "cpu", torch.float32, FastOptions(gemv_on_cpu=True))
    trace = Trace(EngineConfig(2, 32, 16, mode), TRACE)
    eng = Engine(model, trace.engine, max_len=16, pad_decode=pad_decode)
    if not shadows:
        monkeypatch.setattr(eng, "shadow_rows", lambda prev: [])
    return run_recording_logits(eng, trace)


@pytest.mark.parametrize("pad_decode", [False, True], ids=["eager", "buckets"])
def test_async_matches_legacy_logits_bitwise_when_rows_finish(pad_decode):
    """Every logits row that samples a kept token is bitwise equal in the two modes, and so are the tokens."""
    leg, rows_leg = _cached("legacy", pad_decode)
    asy, rows_asy = _cached("async", pad_decode)
    assert leg.tokens == asy.tokens
    kept = {(r.id, len(r.prompt) + i) for r in TRACE for i in range(len(leg.tokens[r.id]))}
    assert kept <= rows_leg.keys() and kept <= rows_asy.keys()
    assert [k for k in sorted(kept) if not torch.equal(rows_leg[k], rows_asy[k])] == []


def test_shadow_rows_leave_the_legacy_log_as_the_oracles():
    """Shadow rows are computed, not logged: legacy's schedule log is still the oracle's."""
    leg, _ = _cached("legacy", False)
    cfg = zoo.tiny_config("bamba", **SMALL)
    ref = oracle_run_trace(OracleModel(cfg, zoo.random_weights(cfg, seed=5)), Trace(EngineConfig(2, 32, 16, "legacy"),
                                                                                        TRACE), mode="legacy")
    assert leg.digest == ref.digest
    assert all(b.kind != "shadow" for s in leg.schedule_log.steps for b in s.batch)


def test_without_shadow_rows_the_row_count_changes_the_bits(monkeypatch):
    """The control: with shadow rows switched off, legacy runs b's step after a's finish with one row
    than async, and some of their logits rows differ in the last bits (so the test above can fail)."""
    leg, rows_leg = _run("legacy", pad_decode=False, shadows=False, monkeypatch=monkeypatch)
    asy, rows_asy = _cached("async", False)
    kept = {(r.id, len(r.prompt) + i) for r in TRACE for i in range(len(leg.tokens[r.id]))}
    assert any(not torch.equal(rows_leg[k], rows_asy[k]) for k in kept)
