"""Trace format hybridqual.trace/1: round trip, canonical dump, and a corpus of malformed traces each rejected
with a TraceError naming the field and the request id."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from oracle.trace import TraceError, check_against_model, dump_trace, load_trace, parse_trace

CORPUS = sorted((Path(__file__).resolve().parents[1] / "goldens" / "traces").glob("*.json"))

GOOD = {"schema": "hybridqual.trace/1",
        "engine": {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 8, "mode": "legacy"},
        "requests": [{"id": "a", "arrival_step": 0, "prompt": [1, 2, 3], "max_new_tokens": 4,
                      "stop_token_ids": [0], "sampling": {"kind": "greedy"}},
                     {"id": "b", "arrival_step": 2, "prompt": [4, 5], "max_new_tokens": 2,
                      "sampling": {"kind": "seeded", "temperature": 0.5, "seed": 9}}]}


def _set(path, value):
    def mutate(t):
        obj = t
        for key in path[:-1]:
            obj = obj[key]
        if value is _DELETE:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    return mutate


_DELETE = object()
R1 = ("requests", 1)
# (name, mutation, field named in the message, request id named in the message or None)
MALFORMED = [
    ("missing_schema", _set(("schema",), _DELETE), "trace.schema", None),
    ("wrong_schema", _set(("schema",), "hybridqual.trace/0"), "schema", None),
    ("unknown_top_key", _set(("extra",), 1), "trace.extra", None),
    ("budget_zero", _set(("engine", "max_tokens_per_step"), 0), "engine.max_tokens_per_step", None),
    ("max_requests_zero", _set(("engine", "max_requests"), 0), "engine.max_requests", None),
    ("prefill_chunk_float", _set(("engine", "prefill_chunk"), 8.0), "engine.prefill_chunk", None),
    ("unknown_mode", _set(("engine", "mode"), "turbo"), "engine.mode", None),
    ("unknown_engine_key", _set(("engine", "graphs"), True), "engine.graphs", None),
    ("empty_requests", _set(("requests",), []), "requests", None),
    ("duplicate_id", _set(R1 + ("id",), "a"), "requests[1].id", "a"),
    ("empty_id", _set(R1 + ("id",), ""), "requests[1].id", None),
    ("negative_arrival", _set(R1 + ("arrival_step",), -1), "requests[1].arrival_step", "b"),
    ("bool_arrival", _set(R1 + ("arrival_step",), True), "requests[1].arrival_step", "b"),
    ("empty_prompt", _set(R1 + ("prompt",), []), "requests[1].prompt", "b"),
    ("negative_token", _set(R1 + ("prompt",), [4, -5]), "requests[1].prompt[1]", "b"),
    ("string_token", _set(R1 + ("prompt",), ["4"]), "requests[1].prompt[0]", "b"),
    ("prompt_not_list", _set(R1 + ("prompt",), "4 5"), "requests[1].prompt", "b"),
    ("zero_max_new", _set(R1 + ("max_new_tokens",), 0), "requests[1].max_new_tokens", "b"),
    ("missing_max_new", _set(R1 + ("max_new_tokens",), _DELETE), "requests[1].max_new_tokens", "b"),
    ("unknown_request_key", _set(R1 + ("priority",), 1), "requests[1].priority", "b"),
    ("stop_not_int", _set(R1 + ("stop_token_ids",), [1.5]), "requests[1].stop_token_ids[0]", "b"),
    ("unknown_sampling", _set(R1 + ("sampling",), {"kind": "top_p"}), "requests[1].sampling.kind", "b"),
    ("zero_temperature", _set(R1 + ("sampling", "temperature"), 0), "requests[1].sampling.temperature", "b"),
    ("missing_seed", _set(R1 + ("sampling", "seed"), _DELETE), "requests[1].sampling.seed", "b"),
    ("huge_seed", _set(R1 + ("sampling", "seed"), 2 ** 63), "requests[1].sampling.seed", "b"),
    ("greedy_with_seed", _set(("requests", 0, "sampling", "seed"), 3), "requests[0].sampling.seed", "a"),
]


@pytest.mark.parametrize("name,mutate,field,rid", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_trace_rejected_naming_field_and_request(name, mutate, field, rid):
    bad = copy.deepcopy(GOOD)
    mutate(bad)
    with pytest.raises(TraceError) as err:
        parse_trace(bad)
    msg = str(err.value)
    assert msg.startswith(field + " ") or msg.startswith(field + ":"), msg
    assert err.value.field == field
    if rid is not None:
        assert f"(request {rid!r})" in msg and err.value.request_id == rid


def test_malformed_corpus_is_large_enough_and_good_trace_parses():
    assert len(MALFORMED) >= 12
    parse_trace(GOOD)


@pytest.mark.parametrize("field,value,named", [
    ("prompt", [1, 96], "requests[1].prompt[1]"), ("stop_token_ids", [200], "requests[1].stop_token_ids[0]")])
def test_token_id_at_or_above_vocab_rejected(field, value, named):
    bad = copy.deepcopy(GOOD)
    bad["requests"][1][field] = value
    with pytest.raises(TraceError, match=r"^" + named.replace("[", r"\[").replace("]", r"\]") + r" \(request 'b'\)"):
        parse_trace(bad, vocab_size=96)
    with pytest.raises(TraceError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_against_model(parse_trace(bad), vocab_size=96, chunk_size=8)


def test_run_time_checks_name_engine_fields():
    t = parse_trace(GOOD)
    check_against_model(t, vocab_size=96, chunk_size=8)       # 16 >= 2 - 1 + 8 and 8 >= 8
    with pytest.raises(TraceError, match=r"^engine\.prefill_chunk"):
        check_against_model(t, vocab_size=96, chunk_size=16)
    tight = copy.deepcopy(GOOD)
    tight["engine"].update(max_requests=10, prefill_chunk=8)
    with pytest.raises(TraceError, match=r"^engine\.max_tokens_per_step.*>= max_requests - 1 \+ chunk_size = 17"):
        check_against_model(parse_trace(tight), vocab_size=96, chunk_size=8)


def test_load_trace_reports_bad_json_and_missing_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    with pytest.raises(TraceError, match="^file: .*not valid JSON"):
        load_trace(p)
    with pytest.raises(TraceError, match="^file: cannot read"):
        load_trace(tmp_path / "missing.json")


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_corpus_trace_round_trips_through_canonical_dump(path):
    t = load_trace(path)
    text = dump_trace(t)
    assert parse_trace(json.loads(text)) == t
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert dump_trace(parse_trace(json.loads(text))) == text


def test_defaults_fill_optional_fields():
    obj = copy.deepcopy(GOOD)
    del obj["engine"]["mode"]
    del obj["requests"][0]["stop_token_ids"], obj["requests"][0]["sampling"]
    t = parse_trace(obj)
    assert t.engine.mode == "legacy" and t.requests[0].stop_token_ids == () and t.requests[0].sampling.kind == "greedy"
