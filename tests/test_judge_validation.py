"""The adapter boundary (hybridqual.qualify.validate): every RunResult is checked before a check reads it, and any
malformed result is a FAIL line naming the request and the field, never a PASS and never a crash in a later check.

Property tests on the validator itself (hypothesis, seeded), then the FAIL lines of check_instance for hostile
adapters (the fp64 oracle behind a corrupting adapter, on a small two-request trace; no interpreter).
"""
import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import oracle
from oracle.trace import parse_trace
from hybridqual.adapters import Engine, EngineOptions, RunResult
from hybridqual.goldens import regen as goldens
from hybridqual.qualify.checks import check_instance
from hybridqual.qualify.validate import validate_result
from hybridqual.scenarios.plan import Instance

import broken_engines as be

VOCAB = 96
MODEL = goldens.MODELS / "zoo-bamba"
TRACE = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 16},
         "requests": [{"id": "r0", "arrival_step": 0, "prompt": [1, 5, 9], "max_new_tokens": 3},
                      {"id": "r1", "arrival_step": 1, "prompt": [4, 4, 7, 2], "max_new_tokens": 4,
                       "stop_token_ids": [3]}]}


def trace_of(reqs):
    return parse_trace({"schema": "hybridqual.trace/1", "engine": TRACE["engine"], "requests": reqs})


@st.composite
def trace_and_result(draw):
    """A random trace and a well-formed result for it (each output ends by length or on a stop token)."""
    n = draw(st.integers(1, 4))
    reqs, tokens, reasons = [], {}, {}
    for i in range(n):
        max_new = draw(st.integers(1, 6))
        stops = draw(st.lists(st.integers(0, VOCAB - 1), max_size=2, unique=True))
        plain = [t for t in range(VOCAB) if t not in stops]
        stop_early = bool(stops) and draw(st.booleans())
        length = draw(st.integers(1, max_new)) if stop_early else max_new
        out = [draw(st.sampled_from(plain)) for _ in range(length - 1)]
        out.append(draw(st.sampled_from(stops)) if stop_early else draw(st.sampled_from(plain + stops)))
        rid = f"q{i}"
        reqs.append({"id": rid, "arrival_step": 0, "prompt": [1, 2], "max_new_tokens": max_new,
                     "stop_token_ids": stops})
        tokens[rid] = out
        reasons[rid] = "stop" if out[-1] in stops else "length"
    return trace_of(reqs), tokens, reasons


def as_kind(toks, kind):
    return {"list": list, "tuple": tuple, "numpy": lambda t: [np.int64(x) for x in t],
            "torch": lambda t: [torch.tensor(x) for x in t], "tensor": lambda t: torch.tensor(t, dtype=torch.long),
            "ndarray": lambda t: np.array(t, dtype=np.int32)}[kind](toks)


@seed(31)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace_and_result(), st.sampled_from(["list", "tuple", "numpy", "torch", "tensor", "ndarray"]), st.booleans())
def test_well_formed_results_pass_and_are_normalised_to_int_lists(case, kind, with_reasons):
    trace, tokens, reasons = case
    logits = {r: torch.randn(len(t), VOCAB) for r, t in tokens.items()}
    res = RunResult({r: as_kind(t, kind) for r, t in tokens.items()}, reasons if with_reasons else {}, logits=logits,
                    streamed={r: as_kind(t, kind) for r, t in tokens.items()} if with_reasons else None)
    clean, problems = validate_result(trace, res, VOCAB)
    assert problems == []
    assert clean.tokens == tokens and all(type(x) is int for t in clean.tokens.values() for x in t)


def corruptions(trace, tokens, reasons):
    """(name, the field the FAIL must name, a corrupted RunResult) for one well-formed case."""
    r0 = trace.requests[0]
    rid = r0.id
    out = []

    def with_tokens(**change):
        return RunResult({**copy.deepcopy(tokens), **change}, dict(reasons))
    out.append(("extra id", "'ghost\\x1b[31m' is not in the trace",
                with_tokens(**{"ghost\x1b[31m": [1]})))
    out.append(("missing id", f"request {rid!r} of the trace is missing",
                RunResult({k: v for k, v in tokens.items() if k != rid})))
    out.append(("float token", f"request {rid!r} tokens[0]: token ids must be ints, got float",
                with_tokens(**{rid: [float(t) for t in tokens[rid]]})))
    out.append(("bool token", f"request {rid!r} tokens[0]: token ids must be ints, got bool",
                with_tokens(**{rid: [True] + tokens[rid][1:]})))
    out.append(("float tensor", f"request {rid!r} tokens[0]: token ids must be ints",
                with_tokens(**{rid: [torch.tensor(1.0)] + tokens[rid][1:]})))
    out.append(("negative id", f"request {rid!r} tokens[0]: token id -1 outside [0, vocab {VOCAB})",
                with_tokens(**{rid: [-1] + tokens[rid][1:]})))
    out.append(("id >= vocab", f"request {rid!r} tokens[0]: token id {VOCAB} outside",
                with_tokens(**{rid: [VOCAB] + tokens[rid][1:]})))
    out.append(("empty", f"request {rid!r} tokens: empty", with_tokens(**{rid: []})))
    plain = next(t for t in range(VOCAB) if t not in r0.stop_token_ids)
    longer = tokens[rid] + [plain] * (r0.max_new_tokens + 1)
    if tokens[rid][-1] not in r0.stop_token_ids:
        out.append(("too long", f"request {rid!r} tokens: {len(longer)} tokens, more than max_new_tokens",
                    with_tokens(**{rid: longer})))
    else:
        out.append(("token after stop", f"request {rid!r} tokens[{len(tokens[rid])}]: a token after the stop token",
                    with_tokens(**{rid: tokens[rid] + [plain]})))
    if len(tokens[rid]) > 1 and tokens[rid][-1] not in r0.stop_token_ids:
        out.append(("cut short", f"request {rid!r} tokens: ends after {len(tokens[rid]) - 1} of max_new_tokens",
                    with_tokens(**{rid: tokens[rid][:-1]})))
    wrong = "length" if reasons[rid] == "stop" else "stop"
    out.append(("finish reason", f"request {rid!r} finish_reasons: {wrong!r}",
                RunResult(tokens, {**reasons, rid: wrong})))
    out.append(("finish reason word", f"request {rid!r} finish_reasons: 'eos' is neither",
                RunResult(tokens, {**reasons, rid: "eos"})))
    out.append(("extra finish id", "RunResult.finish_reasons: request id 'zz' is not in the trace",
                RunResult(tokens, {**reasons, "zz": "stop"})))
    n = len(tokens[rid])
    good = {r: torch.randn(len(t), VOCAB) for r, t in tokens.items()}
    nan = {**good, rid: good[rid].clone()}
    nan[rid][n - 1, 3] = float("nan")
    out.append(("nan logits", f"request {rid!r} logits[{n - 1}]: not finite", RunResult(tokens, logits=nan)))
    inf = {**good, rid: good[rid].clone()}
    inf[rid][0, 0] = float("inf")
    out.append(("inf logits", f"request {rid!r} logits[0]: not finite", RunResult(tokens, logits=inf)))
    out.append(("logits shape", f"request {rid!r} logits: shape ({n + 1}, {VOCAB}), expected [len(tokens), vocab]",
                RunResult(tokens, logits={**good, rid: torch.randn(n + 1, VOCAB)})))
    out.append(("logits vocab", f"request {rid!r} logits: shape ({n}, {VOCAB - 1})",
                RunResult(tokens, logits={**good, rid: torch.randn(n, VOCAB - 1)})))
    out.append(("int logits", f"request {rid!r} logits: must be a float tensor",
                RunResult(tokens, logits={**good, rid: torch.zeros(n, VOCAB, dtype=torch.long)})))
    streamed = copy.deepcopy(tokens)
    out.append(("streamed token dropped", f"request {rid!r} streamed: {n - 1} tokens delivered, the output has {n}",
                RunResult(tokens, streamed={**streamed, rid: tokens[rid][:-1]})))
    out.append(("streamed token twice", f"request {rid!r} streamed: {n + 1} tokens delivered",
                RunResult(tokens, streamed={**streamed, rid: tokens[rid] + tokens[rid][-1:]})))
    other = (tokens[rid][0] + 1) % VOCAB
    out.append(("streamed token differs", f"first difference at [0]: streamed {other}, output {tokens[rid][0]}",
                RunResult(tokens, streamed={**streamed, rid: [other] + tokens[rid][1:]})))
    out.append(("streamed id missing", f"RunResult.streamed: request {rid!r} of the trace is missing",
                RunResult(tokens, streamed={k: v for k, v in streamed.items() if k != rid})))
    out.append(("not a dict", "RunResult.tokens: must be a dict", RunResult([list(t) for t in tokens.values()])))
    return out


@seed(31)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace_and_result())
def test_every_malformed_result_is_refused_naming_the_request_and_the_field(case):
    for name, words, res in corruptions(*case):
        _, problems = validate_result(case[0], res, VOCAB)
        assert any(words in p for p in problems), (name, words, problems)


def test_a_result_that_is_not_a_run_result_is_refused():
    tr = trace_of(TRACE["requests"])
    for bad in (None, {"r0": [1, 2, 3]}, "tokens"):
        _, problems = validate_result(tr, bad, VOCAB)
        assert problems and "not a hybridqual.adapters.RunResult" in problems[0], problems


# ------------------------------------------------------------------------------------- as qualify's FAIL lines

@pytest.fixture(scope="module")
def omodel():
    return oracle.load(MODEL, dtype=torch.float64)


def run_checks(engine_cls, omodel, modes=("legacy",)):
    tr = parse_trace(TRACE)
    inst = Instance("judge_boundary", "test", tr, None, tr.to_json())
    return check_instance(engine_cls, MODEL, inst, list(modes), omodel, "cpu")


def hostile(fn) -> Engine:
    """The hostile oracle rewriting its results with `fn(result, trace)`."""
    return Engine(be.HostileOracle, EngineOptions(settings=be.Corruption(fn)))


def test_the_honest_hostile_adapter_passes_every_check(omodel):
    checks = run_checks(be.HostileOracle, omodel, ("legacy", "async"))
    assert all(c.status == "PASS" for c in checks), [(c.name, c.status, c.detail) for c in checks]


@pytest.mark.parametrize("name,fn,words", [
    ("extra id", lambda r, t: RunResult({**r.tokens, "r9": [1]}, r.finish_reasons, r.schedule_log, r.digest),
     "RunResult.tokens: request id 'r9' is not in the trace"),
    ("float tokens", lambda r, t: RunResult({k: [float(x) for x in v] for k, v in r.tokens.items()}),
     "request 'r0' tokens[0]: token ids must be ints, got float"),
    ("nan logits", lambda r, t: RunResult(r.tokens, logits={k: v * float("nan") for k, v in r.logits.items()}),
     "request 'r0' logits[0]: not finite"),
    ("truncated", lambda r, t: RunResult({**r.tokens, "r0": r.tokens["r0"][:1]}),
     "request 'r0' tokens: ends after 1 of max_new_tokens 3 tokens without a stop token"),
    ("dict", lambda r, t: dict(r.tokens), "run_trace returned dict"),
])
def test_a_malformed_result_is_one_fail_line_and_no_check_judges_it(omodel, name, fn, words):
    checks = run_checks(hostile(fn), omodel)
    [bad] = [c for c in checks if c.status == "FAIL"]
    assert bad.name == "legacy: engine result is well-formed" and words in bad.detail, (name, bad.detail)
    assert not any(c.passed for c in checks), [(c.name, c.status) for c in checks]    # nothing judged it PASS
