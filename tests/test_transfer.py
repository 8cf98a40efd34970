"""State transfer between engine instances (DESIGN §19): the `transfer` request field, the oracle's hand-over (the
sender frees the slot with reason "transfer", the receiver admits into a zeroed slot of its own with "imported"),
and the fast path's export/import of a row's whole state. Truth is continuity: tokens equal the request alone."""
from __future__ import annotations

import copy

import pytest

from oracle.trace import TraceError, Transfer, dump_trace, parse_trace

BASE = {"schema": "hybridqual.trace/1",
        "engine": {"max_requests": 2, "max_tokens_per_step": 32, "prefill_chunk": 16},
        "requests": [{"id": "a", "arrival_step": 1, "prompt": [1, 2], "max_new_tokens": 4}]}


def _with(transfer, **engine):
    obj = copy.deepcopy(BASE)
    obj["requests"][0]["transfer"] = transfer
    obj["engine"].update(engine)
    return obj


def test_transfer_field_round_trips_and_is_absent_when_empty():
    """A transfer list parses to Transfer values and dumps back; a trace without one keeps its bytes."""
    t = parse_trace(_with([{"step": 3, "to": "e1"}, {"step": 5, "to": "main"}]))
    assert t.requests[0].transfer == (Transfer(3, "e1"), Transfer(5, "main"))
    import json
    assert parse_trace(json.loads(dump_trace(t))) == t
    assert "transfer" not in dump_trace(parse_trace(BASE))
    assert parse_trace(_with([])).requests[0].transfer == ()


@pytest.mark.parametrize("transfer, engine, field, words", [
    ("x", {}, "requests[0].transfer", "must be a list"),
    ([{"step": 0, "to": "e1"}], {}, "requests[0].transfer[0].step", ">= the arrival step 1"),
    ([{"step": 3, "to": "e1"}, {"step": 3, "to": "e2"}], {}, "requests[0].transfer[1].step", "previous transfer"),
    ([{"step": 3, "to": "main"}], {}, "requests[0].transfer[0].to", "already on engine 'main'"),
    ([{"step": 3, "to": "e1"}, {"step": 4, "to": "e1"}], {}, "requests[0].transfer[1].to", "already on engine 'e1'"),
    ([{"step": 3}], {}, "requests[0].transfer[0].to", "missing required field"),
    ([{"step": 3, "to": "e1", "when": 1}], {}, "requests[0].transfer[0].when", "unknown field"),
    ([{"step": True, "to": "e1"}], {}, "requests[0].transfer[0].step", "must be an integer"),
    ([{"step": 3, "to": ""}], {}, "requests[0].transfer[0].to", "engine id"),
    ([{"step": 3, "to": 7}], {}, "requests[0].transfer[0].to", "engine id"),
    ([{"step": 3, "to": "e1"}], {"kv_tokens": 64}, "requests[0].transfer", "not combined"),
])
def test_bad_transfer_is_an_error_naming_the_field(transfer, engine, field, words):
    """Every malformed transfer is a TraceError naming the field and the request."""
    with pytest.raises(TraceError) as e:
        parse_trace(_with(transfer, **engine))
    assert e.value.field == field and e.value.request_id == "a" and words in str(e.value), str(e.value)
