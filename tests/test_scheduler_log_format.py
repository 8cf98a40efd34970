"""Schedule log format: canonical JSON is exact (ints and strings only), round-trips, and diffs name the field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from oracle.schedule_log import canonical_json, digest, first_difference, from_json
from oracle.scheduler import run_trace
from oracle.trace import load_trace
from test_scheduler_fake import FakeModel

TRACE = Path(__file__).resolve().parents[1] / "goldens" / "traces" / "seed_compaction.json"


def _log(mode="legacy"):
    return run_trace(FakeModel(vocab_size=64, chunk_size=8, seed=0), load_trace(TRACE), mode).schedule_log


def test_canonical_json_is_sorted_compact_and_round_trips():
    log = _log("async")
    text = canonical_json(log)
    assert " " not in text
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    back = from_json(json.loads(text))
    assert canonical_json(back) == text and digest(back) == digest(log)
    assert len(digest(log)) == 64 and digest(log) == digest(log.to_json())


@pytest.mark.parametrize("bad", [1.0, True, None])
def test_canonical_json_rejects_floats_booleans_nulls(bad):
    obj = _log().to_json()
    obj["steps"][0]["batch"][0]["pos"] = bad
    with pytest.raises(ValueError, match=r"log\.steps\[0\]\.batch\[0\]\.pos"):
        canonical_json(obj)


def test_first_difference_names_step_and_field():
    a, b = _log().to_json(), _log().to_json()
    assert first_difference(a, b) is None
    b["steps"][4]["batch"][2]["slot"] = 0
    assert first_difference(a, b) == "steps[4].batch[2].slot: 1 != 0"
    assert digest(a) != digest(b)
    assert first_difference(_log("legacy"), _log("async")) == "mode: 'legacy' != 'async'"


def test_streaming_add_request_validates_and_runs():
    from oracle.scheduler import Scheduler
    from oracle.trace import EngineConfig, Request, Trace, TraceError
    model = FakeModel(vocab_size=16, chunk_size=4, seed=0)
    s = Scheduler(model, Trace(EngineConfig(2, 8, 4), ()), "async")
    s.add_request(Request("x", 0, (1, 2, 3), 3))
    with pytest.raises(TraceError, match=r"^requests\[1\]\.id \(request 'x'\)"):
        s.add_request(Request("x", 0, (1,), 1))
    with pytest.raises(TraceError, match=r"^requests\[1\]\.stop_token_ids\[0\] \(request 'y'\)"):
        s.add_request(Request("y", 0, (1,), 1, (16,)))
    assert s.step() and s.step()
    with pytest.raises(TraceError, match=r"^requests\[1\]\.arrival_step \(request 'z'\)"):
        s.add_request(Request("z", 1, (1,), 1))
    s.add_request(Request("z", 2, (5, 6), 2))
    result = s.run()
    assert {k: len(v) for k, v in result.tokens.items()} == {"x": 3, "z": 2}
