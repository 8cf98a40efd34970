"""Fuzzed bad input (DESIGN §7 ci profile: derandomised, bounded): every mutated trace — JSON values of the wrong
type or range, missing / unknown / duplicate keys, huge ints, NaN/inf, unicode, flipped bytes in the file — is
either a TraceError naming a field or a valid Trace that round-trips and runs to completion; every hand-built
Request gets the same verdict from Engine.add_request, the oracle's Scheduler.add_request and parse_trace of its
JSON form; every hand-built EngineConfig either builds an Engine or is a TraceError / MemoryError naming it.
Validation only: the runs use the scheduler's FakeModel, never a network forward."""
from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fastpath import Engine, FastModel
from fastpath.engine import memory
from oracle import zoo
from oracle.scheduler import Scheduler
from oracle.trace import (EngineConfig, Request, Sampling, Trace, TraceError, dump_trace, load_trace, parse_trace,
                          check_against_model)
from test_scheduler_fake import FakeModel

VOCAB, CHUNK = 96, 8
GOOD = {"schema": "hybridqual.trace/1", "description": "fuzz seed",
        "engine": {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 8, "mode": "async"},
        "requests": [{"id": "a", "arrival_step": 0, "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_new_tokens": 3,
                      "stop_token_ids": [0], "sampling": {"kind": "greedy"}},
                     {"id": "b", "arrival_step": 1, "prompt": [4, 5], "max_new_tokens": 2,
                      "sampling": {"kind": "seeded", "temperature": 0.7, "seed": 11}}]}
ROOTS = ("trace", "schema", "description", "engine", "requests", "file")

WEIRD = st.one_of(
    st.sampled_from([None, True, False, 0, 1, -1, 2, 7, 95, 96, 2 ** 31, 2 ** 63, -(2 ** 63), 10 ** 30, 1.0, 0.5,
                     -0.0, 1e308, math.nan, math.inf, -math.inf, "", "a", "0", "greedy", "seeded", "legacy",
                     "\u2603\U0001F600", "\ud800", "x" * 300, [], [1], [1.0], [True], [-3], [[1]], {}, {"kind": "greedy"},
                     {"kind": "seeded", "temperature": 1.0, "seed": 1}]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(-2, 100), max_size=4))


def _paths(obj, prefix=()):
    """Every (container path, key) in the JSON tree."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix, k
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix, i
            yield from _paths(v, prefix + (i,))


ALL_PATHS = list(_paths(GOOD))


@st.composite
def mutated_traces(draw):
    """GOOD with 1-3 edits: a value replaced, a key deleted, an unknown key added, an element appended."""
    obj = copy.deepcopy(GOOD)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(obj))
        if not paths:
            break
        parent_path, key = draw(st.sampled_from(paths))
        parent = obj
        for p in parent_path:
            parent = parent[p]
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "append"]))
        if op == "replace":
            parent[key] = draw(WEIRD)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["priority", "Id", "\u00e9", "kind", "seed", "mode"]))] = draw(WEIRD)
        elif isinstance(parent.get(key) if isinstance(parent, dict) else parent[key], list):
            (parent[key]).append(draw(WEIRD))
    return obj


def _assert_clear(err: TraceError) -> None:
    assert isinstance(err.field, str) and err.field.split(".")[0].split("[")[0] in ROOTS, str(err)
    assert str(err).startswith(err.field), str(err)


def _assert_valid(t: Trace) -> None:
    """A valid trace is made of the documented types only, round-trips, and runs to completion on the oracle
    scheduler (FakeModel: no network) when its run-time checks pass and it is small enough to run here."""
    assert parse_trace(json.loads(dump_trace(t))) == t
    for r in t.requests:
        assert isinstance(r.id, str) and r.id and type(r.arrival_step) is int and type(r.max_new_tokens) is int
        assert all(type(x) is int and x >= 0 for x in r.prompt + r.stop_token_ids)
        assert r.sampling.kind == "greedy" or 0 < r.sampling.temperature < math.inf
    try:
        t = check_against_model(t, VOCAB, CHUNK)
    except TraceError as e:
        _assert_clear(e)
        return
    work = max(r.arrival_step for r in t.requests) + sum(len(r.prompt) + r.max_new_tokens for r in t.requests)
    if work <= 400:
        result = Scheduler(FakeModel(VOCAB, CHUNK), t, t.engine.mode).run(max_steps=work + 10)
        assert set(result.tokens) == {r.id for r in t.requests}


def _canonical(obj) -> str:
    """Type-strict JSON text of a trace object with the optional fields filled in (1 and 1.0 differ)."""
    obj = copy.deepcopy(obj)
    obj.setdefault("description", "")
    if not obj["description"]:
        del obj["description"]
    obj["engine"].setdefault("mode", "legacy")
    for r in obj["requests"]:
        r.setdefault("stop_token_ids", [])
        r.setdefault("sampling", {"kind": "greedy"})
        if r["sampling"]["kind"] == "seeded" and type(r["sampling"]["temperature"]) is int:
            r["sampling"]["temperature"] = float(r["sampling"]["temperature"])
    return json.dumps(obj, sort_keys=True)


@given(mutated_traces())
def test_mutated_trace_json_is_a_named_trace_error_or_a_valid_trace(obj):
    """... and a valid Trace says exactly what the JSON said (no float truncated to an int, no field dropped)."""
    try:
        t = parse_trace(obj, vocab_size=VOCAB)
    except TraceError as e:
        _assert_clear(e)
        return
    assert json.dumps(t.to_json(), sort_keys=True) == _canonical(obj)
    _assert_valid(t)


@given(mutated_traces(), st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), max_size=4),
       st.booleans())
def test_mutated_trace_files_bytes_flipped_are_a_named_trace_error_or_a_valid_trace(obj, flips, truncate):
    """The same through load_trace, from the bytes of the file: flipped bytes (bad UTF-8, broken JSON) too."""
    try:
        data = bytearray(json.dumps(obj, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (ValueError, UnicodeEncodeError):
        return
    for at, b in flips:
        data[at % len(data)] = b
    if truncate:
        data = data[: len(data) // 2]
    fd, path = tempfile.mkstemp(suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(data))
        try:
            t = load_trace(path, vocab_size=VOCAB)
        except TraceError as e:
            _assert_clear(e)
            return
        _assert_valid(t)
    finally:
        os.unlink(path)


# ------------------------------------------------------------------------------ hand-built requests, three ways

@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg = zoo.tiny_config("bamba")
    return Engine(FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32),
                  EngineConfig(2, 16, 8), max_len=32)


INTS = st.one_of(st.integers(-3, 100), st.sampled_from([2 ** 63, 10 ** 20, True, 1.0, 2.5, math.nan, "3", None,
                                                         np.int64(4), np.float64(4.0), np.int32(-1)]))
TOKENS = st.one_of(st.lists(INTS, max_size=5), st.lists(INTS, max_size=3).map(tuple),
                   st.sampled_from(["12", None, 5, np.array([1, 2])]))
TEMPS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([None, 0, 1, True, "1.0",
                                                                                   np.float32(0.5)]))
SAMPLINGS = st.builds(Sampling, st.sampled_from(["greedy", "seeded", "seeded", "top_p", "", None, 3]), TEMPS,
                      st.one_of(INTS, st.sampled_from([2 ** 63 - 1, 2 ** 64])))
FIELDS = {"id": st.one_of(st.text(max_size=4), st.sampled_from([None, 3, b"r", "\ud800", "\u2603"])),
          "arrival_step": INTS, "prompt": TOKENS, "max_new_tokens": INTS, "stop_token_ids": TOKENS,
          "sampling": st.one_of(SAMPLINGS, st.sampled_from([None, "greedy", {"kind": "greedy"}]))}


@st.composite
def requests(draw):
    """A valid request (greedy or seeded, plain lists) with 0-2 of its fields replaced by fuzzed values."""
    fields = dict(id="r", arrival_step=draw(st.integers(0, 3)), prompt=[1, 2, 3], max_new_tokens=3,
                  stop_token_ids=[0], sampling=draw(st.sampled_from([Sampling(), Sampling("seeded", 0.7, 5)])))
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        fields[name] = draw(FIELDS[name])
    return Request(**fields)


def _verdict(submit, req):
    try:
        submit(req)
    except TraceError as e:
        _assert_clear(e)
        return e.field, str(e)
    return None, None


def _json_form(req: Request):
    """The request as trace JSON, or None if a field is not a JSON value (NumPy scalars, tuples, bytes...)."""
    def plain(v):
        return v is None or type(v) in (bool, int, float, str) or (type(v) is list and all(map(plain, v)))
    s = req.sampling
    if not isinstance(s, Sampling) or not all(map(plain, (req.id, req.arrival_step, req.prompt, req.max_new_tokens,
                                                          req.stop_token_ids, s.kind, s.temperature, s.seed))):
        return None
    samp = {"kind": s.kind, **{k: v for k, v in (("temperature", s.temperature), ("seed", s.seed)) if v is not None}}
    return {"id": req.id, "arrival_step": req.arrival_step, "prompt": req.prompt,
            "max_new_tokens": req.max_new_tokens, "stop_token_ids": req.stop_token_ids, "sampling": samp}


@settings(max_examples=150)
@given(requests())
def test_hand_built_request_gets_one_verdict_from_engine_oracle_and_parse_trace(engine, req):
    """The streaming APIs validate exactly as run_trace / parse_trace: same accept/reject, same field named
    (the engine alone also rejects what its KV length max_len=32 cannot hold, naming max_new_tokens)."""
    engine.reset()
    oracle = Scheduler(FakeModel(VOCAB, CHUNK), Trace(engine.ec, ()), "legacy")
    fast_field, fast_msg = _verdict(engine.add_request, req)
    oracle_field, _ = _verdict(oracle.add_request, req)
    if fast_field != oracle_field:
        assert oracle_field is None and fast_field == "requests[0].max_new_tokens" and "max_len" in fast_msg
    obj = _json_form(req)
    if obj is not None:
        trace = {"schema": "hybridqual.trace/1", "engine": engine.ec.to_json(), "requests": [obj]}
        json_field, _ = _verdict(lambda o: parse_trace(o, vocab_size=VOCAB), trace)
        assert json_field == oracle_field
    if oracle_field is None:
        got = oracle.requests[req.id].req
        assert all(type(x) is int for x in got.prompt + got.stop_token_ids + (got.arrival_step, got.max_new_tokens))
        assert got.sampling.kind in ("greedy", "seeded")


CONFIG_INTS = st.one_of(st.integers(-2, 70), st.sampled_from([65535, 65536, 10 ** 6, 10 ** 12, True, 8.0, None,
                                                              "8", np.int64(16)]))


@settings(max_examples=60)
@given(st.builds(EngineConfig, CONFIG_INTS, CONFIG_INTS, CONFIG_INTS,
                 st.sampled_from(["legacy", "async", "turbo", None, 1])),
       st.one_of(st.integers(-1, 64), st.sampled_from([2 ** 20, 2 ** 40, 2.0, True, None])))
def test_hand_built_engine_config_builds_an_engine_or_names_the_field(ec, max_len):
    """Every EngineConfig / max_len either builds an Engine that can make progress or is a clear error; with
    64 MiB "free", a bank that would not fit is a MemoryError before allocation."""
    cfg = zoo.tiny_config("bamba")
    model = _model(cfg)
    with mock.patch.object(memory, "available_bytes", lambda device: 64 * 2 ** 20):
        try:
            eng = Engine(model, ec, max_len=max_len)
        except TraceError as e:
            assert e.field.split(".")[0] == "engine_config", str(e)
            return
        except MemoryError as e:
            assert str(e).startswith("engine_config/max_len:"), str(e)
            return
        except (TypeError, ValueError) as e:
            assert str(e).startswith("max_len:"), str(e)
            return
    assert eng.ec.prefill_chunk >= CHUNK and eng.ec.max_tokens_per_step >= eng.R - 1 + CHUNK
    assert memory.bank_bytes(cfg, eng.R, max_len, torch.float32) == eng.bank.nbytes() <= 64 * 2 ** 20


_MODELS: dict = {}


def _model(cfg) -> FastModel:
    if "m" not in _MODELS:
        _MODELS["m"] = FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32)
    return _MODELS["m"]
