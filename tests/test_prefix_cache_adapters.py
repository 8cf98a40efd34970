"""External engines report their prefix-cache facts through the adapter protocol (RunResult.prefix_cache,
docs/api.md), so the same checks run on them: an inert cache FAILs "0 of N expected hits", correct facts PASS,
no facts is a SKIP with its reason, malformed facts an error naming the field."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracle  # noqa: E402
from broken_engines import CacheReportingEngine, InertCacheEngine, SilentCacheEngine  # noqa: E402
from oracle.trace import load_trace  # noqa: E402
from hybridqual.adapters import OracleAdapter  # noqa: E402
from hybridqual.qualify.checks import context, run_check  # noqa: E402
from hybridqual.qualify.prefix_checks import (NO_FACTS, CacheEvents, FactsError, adapter_runner,  # noqa: E402
                                              prefix_cache_checks)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "goldens" / "models" / "zoo-bamba"
TRACE = load_trace(ROOT / "goldens" / "traces" / "prefix_shared_system.json")


@pytest.fixture(scope="module")
def oracle_model():
    return oracle.load(MODEL)


def _checks(cls, oracle_model, mode="async"):
    return prefix_cache_checks("t", TRACE, oracle_model, adapter_runner(cls, MODEL, mode), mode)


def test_external_engine_with_an_inert_cache_fails_zero_of_n_expected_hits(oracle_model):
    on_off, policy = _checks(InertCacheEngine, oracle_model)
    assert on_off.status == "PASS"                  # an inert cache still gives the right tokens
    assert policy.status == "FAIL" and policy.detail.startswith("0 of 3 expected hits"), policy.detail


def test_external_engine_reporting_correct_facts_passes_both_checks(oracle_model):
    checks = _checks(CacheReportingEngine, oracle_model)
    assert [c.status for c in checks] == ["PASS", "PASS"], [c.detail for c in checks]
    assert checks[1].detail.startswith("3 of 3 expected hits") and "not reported" not in checks[1].detail


def test_external_engine_reporting_nothing_is_skipped_with_the_reason(oracle_model):
    _, policy = _checks(SilentCacheEngine, oracle_model, "legacy")
    assert policy.status == "SKIP" and NO_FACTS in policy.detail


def cache_line(cls, trace, run, oracle_model):
    """qualify's prefix-cache line for `run` of adapter `cls` (mode legacy), from the registry as qualify runs it."""
    return run_check("prefix_cache", context(cls, MODEL, trace, oracle_model, label="m/t", mode="legacy", run=run))


def test_qualify_line_judges_the_reported_facts(oracle_model):
    """qualify's per-mode line: PASS on correct facts, FAIL on an inert cache or on a declared but missing
    report, SKIP without the capability; None on a trace without a prefix cache."""
    def line(cls):
        return cache_line(cls, TRACE, cls(MODEL, TRACE, "legacy").run_trace(), oracle_model)
    good, inert, silent = line(CacheReportingEngine), line(InertCacheEngine), line(SilentCacheEngine)
    assert good.status == "PASS" and good.name == "legacy: prefix cache events as the policy predicts"
    assert inert.status == "FAIL" and "0 of 3 expected hits" in inert.detail
    assert silent.status == "SKIP" and NO_FACTS in silent.detail

    class Liar(SilentCacheEngine):
        CAPABILITIES = CacheReportingEngine.CAPABILITIES    # claims reporting, returns nothing
    liar = line(Liar)
    assert liar.status == "FAIL" and "returned no RunResult.prefix_cache" in liar.detail
    plain = load_trace(ROOT / "goldens" / "traces" / "seed_compaction.json")
    assert cache_line(CacheReportingEngine, plain, None, oracle_model) is None


def test_qualify_line_replays_the_policy_with_the_engines_tokens_and_fails_outputs_no_schedule_produces(oracle_model):
    """The events are judged on the oracle schedule replayed with the engine's own tokens (a math-free model, as
    the schedule check): correct facts beside a different but well-formed continuation still PASS; one token past
    max_new_tokens breaks the finish rule, which FAILs naming it."""
    import dataclasses
    run = CacheReportingEngine(MODEL, TRACE, "legacy").run_trace()
    req = max(TRACE.requests, key=lambda r: r.max_new_tokens)
    stops = set(req.stop_token_ids)
    other = next(t for t in range(1, 50) if t not in stops and t != run.tokens[req.id][-1])
    changed = dict(run.tokens, **{req.id: run.tokens[req.id][:-1] + [other]})
    assert len(changed[req.id]) == req.max_new_tokens and not stops      # finished by length: still well-formed
    ok = cache_line(CacheReportingEngine, TRACE, dataclasses.replace(run, tokens=changed), oracle_model)
    assert ok.status == "PASS", ok.detail
    longer = dict(run.tokens, **{req.id: run.tokens[req.id] + [other] * (req.max_new_tokens + 1)})
    bad = cache_line(CacheReportingEngine, TRACE, dataclasses.replace(run, tokens=longer), oracle_model)
    assert bad.status == "FAIL" and "break the finish rule" in bad.detail, bad.detail


def test_oracle_adapter_reports_the_facts_of_its_log(oracle_model):
    run = OracleAdapter(MODEL, TRACE, "async").run_trace()
    assert isinstance(run.prefix_cache, CacheEvents)
    assert run.prefix_cache.hits == {"on": 8, "before": 8, "after": 16}


@pytest.mark.parametrize("facts,where", [
    ([], "RunResult.prefix_cache: expected a CacheEvents or a dict"),
    ({"admit": [{"request": "a"}]}, "RunResult.prefix_cache.admit[0].cached_tokens: missing"),
    ({"admit": [{"request": "a", "cached_tokens": -1}]}, "RunResult.prefix_cache.admit[0].cached_tokens: must be"),
    ({"admit": [], "steps": [{"stored": [{"request": "a", "pos": "8"}]}]},
     "RunResult.prefix_cache.steps[0].stored[0].pos: expected int"),
    ({"admit": [], "hits": []}, "RunResult.prefix_cache.hits: unknown field"),
])
def test_malformed_facts_are_an_error_naming_the_field(facts, where):
    with pytest.raises(FactsError) as e:
        CacheEvents.from_report(facts)
    assert str(e.value).startswith(where), str(e.value)


def test_qualify_fails_an_external_inert_cache_beside_right_tokens(oracle_model):
    """Through qualify's check_instance (a trace file): the tokens pass, the cache line fails '0 of 3'."""
    from hybridqual.qualify.runner import instance_from_file
    from hybridqual.qualify.checks import check_instance
    inst = instance_from_file(ROOT / "goldens" / "traces" / "prefix_shared_system.json", oracle_model.config)
    checks = {c.name: c for c in check_instance(InertCacheEngine, MODEL, inst, ["legacy"], oracle_model, "cpu")}
    assert checks["legacy: tokens match the truth (tie-aware, τ=0.001)"].status == "PASS"
    line = checks["legacy: prefix cache events as the policy predicts"]
    assert line.status == "FAIL" and "0 of 3 expected hits" in line.detail
