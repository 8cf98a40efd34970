"""Pad rows of padded decode buckets (slot -1) never touch a live request's state, when the batch shrinks too.

tests/test_engine_graphs.py covers a pad row whose position never held a real row; here a bucket is reused
after the batch shrank (4 live rows -> 3), so a stale slot left in a pad row, or a kernel that clamps -1 to
slot 0, would write the state of a request that is still running.  Plain-torch stand-ins (ops backend
"torch") keep this fast; the padding logic under test is the engine's, identical on both backends.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

SMALL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_shrinking_padded_batches_leave_live_requests_untouched(mode):
    """Slot 0's request outlives the others (so a -1 -> 0 clamp hits a live slot); the batch goes 4 -> 3 -> 2 -> 1
    rows in buckets 4, 4, 2, 1: padded tokens and schedule equal the unpadded engine's."""
    cfg = zoo.tiny_config("bamba", **SMALL)
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=7), "cpu", torch.float32, FastOptions(backend="torch"))
    reqs = tuple(Request(f"r{i}", 0, (3 + i, 17, 40 + 5 * i), n) for i, n in enumerate((12, 3, 6, 9)))
    trace = Trace(EngineConfig(4, 32, 16, mode), reqs)
    plain = Engine(fast, trace.engine, max_len=32).run_trace(trace)
    padded_engine = Engine(fast, trace.engine, max_len=32, pad_decode=True)
    padded = padded_engine.run_trace(trace)
    sizes = {len(s["batch"]) for s in padded.schedule_log.to_json()["steps"]}
    assert {4, 3} <= sizes, f"the trace must shrink from 4 to 3 decode rows, saw batch sizes {sorted(sizes)}"
    assert padded.tokens == plain.tokens
    assert padded.digest == plain.digest
