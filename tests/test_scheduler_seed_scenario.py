"""The seed scenario's schedule log against a table derived by hand from docs/scheduler.md (not from the code).

Derivation (R=3 rows/slots, budget 20, prefill_chunk 16; every prompt fits one piece; finishes are by length only,
so the schedule is model-independent): a request admitted at step a samples its 1st token in a (prefill) and its
m-th token at a+m-1; its slot is freed when that step is resolved at the start of step a+m. Free stack starts
[2,1,0] (top = 0). r0@0 m6 -> slot 0, last token step 5. r1@1 m3 -> slot 1, last step 3. r2@2 m8 -> slot 2,
last step 9. r3 arrives 3 but waits: at step 4 r1's slot 1 is freed (r2 moves row 2 -> 1) and r3 takes slot 1 in
row 2; last step 7. r4 arrives 5 and waits: at step 6 r0's slot 0 is freed (r3 moves row 2 -> 0), r4 takes slot
0 in row 2; m2 -> last step 7. Step 8 resolves r3 (row 0) and r4 (row 2) together; r2 moves row 1 -> 0.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from oracle.scheduler import run_request_alone, run_trace
from oracle.trace import load_trace
from test_scheduler_fake import FakeModel

TRACE = Path(__file__).resolve().parents[1] / "goldens" / "traces" / "seed_compaction.json"

D, P, X = "decode", "prefill", "extra"
# step: (admit [(req, row, slot)], batch [(row, req, slot, kind, pos, count)], sampled [(req, pos)],
#        free [(req, row, slot, reason)], moves [(from_row, to_row, req, slot)], row_to_slot after resolve)
LEGACY = {
    0: ([("r0", 0, 0)], [(0, "r0", 0, P, 0, 3)], [("r0", 3)], [], [], [0, -1, -1]),
    1: ([("r1", 1, 1)], [(0, "r0", 0, D, 3, 1), (1, "r1", 1, P, 0, 4)], [("r0", 4), ("r1", 4)], [], [],
        [0, 1, -1]),
    2: ([("r2", 2, 2)], [(0, "r0", 0, D, 4, 1), (1, "r1", 1, D, 4, 1), (2, "r2", 2, P, 0, 2)],
        [("r0", 5), ("r1", 5), ("r2", 2)], [], [], [0, 1, 2]),
    3: ([], [(0, "r0", 0, D, 5, 1), (1, "r1", 1, D, 5, 1), (2, "r2", 2, D, 2, 1)],
        [("r0", 6), ("r1", 6), ("r2", 3)], [("r1", 1, 1, "length")], [(2, 1, "r2", 2)], [0, 2, -1]),
    4: ([("r3", 2, 1)], [(0, "r0", 0, D, 6, 1), (1, "r2", 2, D, 3, 1), (2, "r3", 1, P, 0, 3)],
        [("r0", 7), ("r2", 4), ("r3", 3)], [], [], [0, 2, 1]),
    5: ([], [(0, "r0", 0, D, 7, 1), (1, "r2", 2, D, 4, 1), (2, "r3", 1, D, 3, 1)],
        [("r0", 8), ("r2", 5), ("r3", 4)], [("r0", 0, 0, "length")], [(2, 0, "r3", 1)], [1, 2, -1]),
    6: ([("r4", 2, 0)], [(0, "r3", 1, D, 4, 1), (1, "r2", 2, D, 5, 1), (2, "r4", 0, P, 0, 2)],
        [("r3", 5), ("r2", 6), ("r4", 2)], [], [], [1, 2, 0]),
    7: ([], [(0, "r3", 1, D, 5, 1), (1, "r2", 2, D, 6, 1), (2, "r4", 0, D, 2, 1)],
        [("r3", 6), ("r2", 7), ("r4", 3)], [("r3", 0, 1, "length"), ("r4", 2, 0, "length")],
        [(1, 0, "r2", 2)], [2, -1, -1]),
    8: ([], [(0, "r2", 2, D, 7, 1)], [("r2", 8)], [], [], [2, -1, -1]),
    9: ([], [(0, "r2", 2, D, 8, 1)], [("r2", 9)], [("r2", 0, 2, "length")], [], [-1, -1, -1]),
}
# async: steps 0..7 as legacy (each follows a prefill step or has a waiting request), then three overlapped steps
# launched from the device tokens before resolving the previous step; r3/r4 (finished at 7) and r2 (finished at 9)
# are computed once more as extra rows, whose tokens are discarded; step 8 uses the pre-compaction rows.
ASYNC = dict(LEGACY)
ASYNC[8] = ([], [(0, "r3", 1, X, 6, 1), (1, "r2", 2, D, 7, 1), (2, "r4", 0, X, 3, 1)], [("r2", 8)], [], [],
            [2, -1, -1])
ASYNC[10] = ([], [(0, "r2", 2, X, 9, 1)], [], [], [], [-1, -1, -1])
OVERLAPPED = {8, 9, 10}


def _table(log) -> dict:
    out = {}
    for s in log.to_json()["steps"]:
        out[s["step"]] = ([(a["request"], a["row"], a["slot"]) for a in s["admit"]],
                          [(b["row"], b["request"], b["slot"], b["kind"], b["pos"], b["count"]) for b in s["batch"]],
                          [(x["request"], x["pos"]) for x in s["sampled"]],
                          [(f["request"], f["row"], f["slot"], f["reason"]) for f in s["free"]],
                          [(m["from_row"], m["to_row"], m["request"], m["slot"]) for m in s["moves"]],
                          s["row_to_slot"])
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_seed_scenario_legacy_log_matches_hand_table(seed):
    result = run_trace(FakeModel(vocab_size=64, chunk_size=8, seed=seed), load_trace(TRACE), "legacy")
    assert _table(result.schedule_log) == LEGACY
    assert all(s.overlap == 0 for s in result.schedule_log.steps)


@pytest.mark.parametrize("seed", [0, 1])
def test_seed_scenario_async_log_matches_hand_table(seed):
    result = run_trace(FakeModel(vocab_size=64, chunk_size=8, seed=seed), load_trace(TRACE), "async")
    assert _table(result.schedule_log) == ASYNC
    assert {s.step for s in result.schedule_log.steps if s.overlap} == OVERLAPPED


def test_seed_scenario_has_three_compactions_with_moves():
    moves = [s for s in LEGACY.values() if s[4]]
    assert len(moves) >= 3


def test_seed_scenario_tokens_equal_alone_and_across_modes():
    model, trace = FakeModel(vocab_size=64, chunk_size=8, seed=5), load_trace(TRACE)
    legacy, asyn = run_trace(model, trace, "legacy"), run_trace(model, trace, "async")
    assert legacy.tokens == asyn.tokens
    for req in trace.requests:
        assert legacy.tokens[req.id] == run_request_alone(model, req)[0]
    sampled = {(x["request"], x["pos"]): x["token"] for s in legacy.schedule_log.to_json()["steps"]
               for x in s["sampled"]}
    for req in trace.requests:
        assert [sampled[(req.id, len(req.prompt) + i)] for i in range(req.max_new_tokens)] == legacy.tokens[req.id]
