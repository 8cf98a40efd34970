"""Async overlap with a compaction while a step is in flight, then a drain before admission — against a table
derived by hand from docs/scheduler.md §3-5 (length-only finishes, so the schedule is model-independent).

Derivation (R=2, free stack [1,0], top 0): step 0 admits a (row 0, slot 0) and b (row 1, slot 1) and prefills
both. Step 1 decodes both; a's 2nd token finishes it. Step 2 is overlapped (step 1 was decode-only, c arrives
only at 4): launched with rows as they were, a is an extra row; resolving step 1 frees a (slot 0 pushed) and moves
b row 1 -> 0, and b's step-2 output moves with it. Step 3 is overlapped (launched from row 0); resolving step 2
gives b its 3rd token. Step 4: c has arrived, so no overlap: drain (resolve 3: b's 4th token, b frees slot 1, stack
[0, 1]), then admit c into slot 1 — the slot the drained step wrote. Steps 5 and 6 as at the end of any run.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from oracle.scheduler import run_request_alone, run_trace
from oracle.trace import load_trace
from test_scheduler_fake import FakeModel
from test_scheduler_seed_scenario import _table

TRACE = Path(__file__).resolve().parents[1] / "goldens" / "traces" / "async_drain.json"
D, P, X = "decode", "prefill", "extra"

ASYNC = {
    0: ([("a", 0, 0), ("b", 1, 1)], [(0, "a", 0, P, 0, 2), (1, "b", 1, P, 0, 2)], [("a", 2), ("b", 2)], [], [],
        [0, 1]),
    1: ([], [(0, "a", 0, D, 2, 1), (1, "b", 1, D, 2, 1)], [("a", 3), ("b", 3)], [("a", 0, 0, "length")],
        [(1, 0, "b", 1)], [1, -1]),
    2: ([], [(0, "a", 0, X, 3, 1), (1, "b", 1, D, 3, 1)], [("b", 4)], [], [], [1, -1]),
    3: ([], [(0, "b", 1, D, 4, 1)], [("b", 5)], [("b", 0, 1, "length")], [], [-1, -1]),
    4: ([("c", 0, 1)], [(0, "c", 1, P, 0, 3)], [("c", 3)], [], [], [1, -1]),
    5: ([], [(0, "c", 1, D, 3, 1)], [("c", 4)], [("c", 0, 1, "length")], [], [-1, -1]),
    6: ([], [(0, "c", 1, X, 4, 1)], [], [], [], [-1, -1]),
}
LEGACY = {k: v for k, v in ASYNC.items() if k != 6}
LEGACY[2] = ([], [(0, "b", 1, D, 3, 1)], [("b", 4)], [], [], [1, -1])


@pytest.mark.parametrize("seed", [0, 7])
def test_async_drain_log_matches_hand_table(seed):
    model, trace = FakeModel(vocab_size=64, chunk_size=8, seed=seed), load_trace(TRACE)
    asyn, legacy = run_trace(model, trace), run_trace(model, trace, "legacy")     # the trace's mode is async
    assert asyn.schedule_log.mode == "async"
    assert _table(asyn.schedule_log) == ASYNC
    assert [s.overlap for s in asyn.schedule_log.steps] == [0, 0, 1, 1, 0, 0, 1]
    assert _table(legacy.schedule_log) == LEGACY
    assert asyn.tokens == legacy.tokens
    for req in trace.requests:
        assert asyn.tokens[req.id] == run_request_alone(model, req)[0]
