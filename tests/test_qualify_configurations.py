"""An engine's declared configurations are qualified by the main job, each on the instances that reach its code,
under its own name; the batch-invariance check holds an engine that claims it to the same bits for every request
run alone.

The engines here are the oracle (no interpreter) or fakes without a model.
"""
import json

import pytest
import torch

from oracle.trace import parse_trace
from hybridqual import adapters
from hybridqual.adapters import Capabilities, Configuration, Engine, EngineOptions, RunResult
from hybridqual.adapters.fastpath import FastSettings
from hybridqual.qualify import configurations as configs
from hybridqual.qualify import checks, invariance_checks, runner
from hybridqual.scenarios import plan as scenarios

TRACE = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 8,
                                                    "mode": "legacy"},
         "requests": [{"id": "a", "arrival_step": 0, "prompt": [3, 4, 5], "max_new_tokens": 3},
                      {"id": "b", "arrival_step": 0, "prompt": [6, 7], "max_new_tokens": 2}]}
VOCAB = 96


class FakeInvariant(adapters.Adapter):
    """Claims batch invariance; tokens fixed per request, logits rows whose bits depend on `drift` x the number of
    requests in the trace (drift 0: truly invariant)."""
    CAPABILITIES = Capabilities(("greedy",), ("legacy",), logits=True, compute_dtype=torch.float32,
                                batch_invariant=True)
    drift = 0.0

    def run_trace(self) -> RunResult:
        toks = {r.id: [(7 * k + len(r.prompt)) % VOCAB for k in range(r.max_new_tokens)] for r in self.trace.requests}
        logits = {r.id: torch.full((r.max_new_tokens, VOCAB), 0.5, dtype=torch.float32)
                  + self.drift * len(self.trace.requests) for r in self.trace.requests}
        return RunResult(toks, {r: "length" for r in toks}, logits=logits)


class Drifting(FakeInvariant):
    drift = 1e-7


class Plain(FakeInvariant):
    CAPABILITIES = Capabilities(("greedy",), ("legacy",), logits=True)


class VocabOnly:
    """An oracle stand-in: the vocabulary size is all the invariance check reads of it."""
    config = type("Config", (), {"vocab_size": VOCAB})


def _check(cls):
    tr = parse_trace(TRACE)
    ctx = checks.context(cls, "m", tr, VocabOnly(), "cpu", mode="legacy", run=cls("m", tr, "legacy").run_trace())
    return checks.run_check("batch_invariant", ctx)


def test_a_batch_invariant_engine_whose_logit_bits_depend_on_the_batch_fails_naming_the_request():
    c = _check(Drifting)
    assert c.status == "FAIL" and "a: position 0" in c.detail and "bits differ" in c.detail
    assert _check(FakeInvariant).status == "PASS"


def test_the_invariance_check_compares_bits_not_values():
    a = torch.zeros(2, 4)
    b = a.clone()
    b[1, 2] = -0.0                       # equal as numbers, not as bits
    assert invariance_checks.row_difference(a, a.clone()) is None
    assert "position 1" in invariance_checks.row_difference(a, b)
    assert "position 1" in invariance_checks.row_difference(a.bfloat16(), b.bfloat16())   # bf16 rows too


def test_no_invariance_check_for_an_engine_that_does_not_claim_it():
    assert _check(Plain) is None


def test_every_fastpath_configuration_reaches_shipped_instances():
    declared = adapters.FastpathAdapter.configurations()
    assert {c.name for c in declared} >= {"spec_replay", "spec_device_drafts", "unfused", "torch_backend",
                                           "batch_invariant", "gemv", "prefill_buckets"}
    for c in declared:
        entries = scenarios.configuration_plan([(c.name, c.reach)])
        assert entries and all(e[3] == c.name and (e[0] / "config.json").exists() for e in entries), c.name
        assert c.why, c.name


def test_a_reach_outside_the_corpus_is_a_scenario_error_naming_it():
    with pytest.raises(scenarios.ScenarioError, match="nosuch"):
        scenarios.configuration_plan([("x", ("zoo-bamba/nosuch",))])
    with pytest.raises(scenarios.ScenarioError, match="no shipped model"):
        scenarios.configuration_plan([("x", ("zoo-none/request_order",))])


def test_configured_fastpath_applies_its_options_and_keeps_the_run_flags():
    fast = Engine(adapters.FastpathAdapter)
    spec = Engine(adapters.FastpathAdapter, EngineOptions(graphs=True)).configured("spec_replay")
    fast_options = spec.options.settings.fast_options()
    assert spec.options.graphs and fast_options.spec_replay and not fast_options.spec_device_drafts
    assert spec.options.configuration == "spec_replay"
    torch_settings = fast.configured("torch_backend").options.settings
    assert torch_settings.pad_decode and torch_settings.fast_options().backend == "torch"
    assert fast.configured("batch_invariant").capabilities("cpu").batch_invariant
    assert not fast.capabilities("cpu").batch_invariant
    prefill = adapters.FastpathAdapter.settings(fast.configured("prefill_buckets").options)
    assert adapters.FastpathAdapter.buckets(prefill) == {"prefill_graphs": True, "prefill_buckets": "default"}
    assert adapters.FastpathAdapter.buckets(FastSettings()) == {}
    with pytest.raises(ValueError, match="spec_replay"):
        fast.configured("nosuch")


def test_the_main_job_runs_the_default_plan_then_each_configuration_on_its_reach():
    plan = runner.build_plan(runner.parse_args([]), adapters.FastpathAdapter)
    names = [e[3] for e in plan]
    first = names.index(next(n for n in names if n is not None))
    assert all(n is None for n in names[:first]) and all(n is not None for n in names[first:])
    assert list(dict.fromkeys(names[first:])) == [c.name for c in adapters.FastpathAdapter.configurations()]
    assert all(n is None for *_, n in runner.build_plan(runner.parse_args(["--configuration", "default"]),
                                                          adapters.FastpathAdapter))
    one = runner.build_plan(runner.parse_args(["--model", "zoo-mamba2", "--scenario", "request_order",
                                               "--configuration", "unfused"]), adapters.FastpathAdapter)
    assert [(e[1], e[3]) for e in one] == [(["request_order"], "unfused")]


def test_an_unknown_configuration_is_refused_before_any_work(tmp_path, capsys):
    assert runner.main(["--configuration", "nosuch", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "--configuration nosuch" in err and "spec_replay" in err
    assert not (tmp_path / "q" / "report.json").exists()


class DropsInOneConfiguration(adapters.OracleAdapter):
    """The oracle, which in its declared configuration 'drop_last' loses every request's last token."""

    @classmethod
    def configurations(cls):
        return (Configuration("drop_last", ("zoo-mamba2/request_order",), "a path the defaults never take"),)

    def run_trace(self):
        r = super().run_trace()
        if self.options.configuration == "drop_last":
            r.tokens = {k: v[:-1] for k, v in r.tokens.items()}
        return r


def test_a_defect_only_in_a_configuration_fails_the_main_job_under_that_configurations_name(tmp_path):
    args = runner.parse_args(["--configuration", "default", "drop_last", "--out", str(tmp_path), "--quiet",
                              "--in-process", "--jobs", "1"])
    base = scenarios.main_job_plan
    try:      # the default part cut to one cheap instance: the defect is in the configuration's part
        scenarios.main_job_plan = lambda: [(scenarios.MODELS / "zoo-mamba2", ["request_order"], None)]
        assert runner.run(args, Engine(DropsInOneConfiguration), True) == 1
    finally:
        scenarios.main_job_plan = base
    report = json.loads((tmp_path / "report.json").read_text())
    failed = {c["trace"] for c in report["checks"] if c["status"] == "FAIL"}
    assert failed == {"zoo-mamba2/request_order [drop_last]"}
    assert report["configurations"] == ["default", "drop_last"]


class DeclaresFloat16StateInOneConfiguration(adapters.OracleAdapter):
    """The oracle, declaring in its configuration 'f16_state' a float16 state bank (DESIGN §20's constants)."""

    @classmethod
    def configurations(cls):
        return (Configuration("f16_state", ("zoo-mamba2/request_order",), "a float16 state bank"),)

    @classmethod
    def capabilities(cls, device, options=adapters.base.DEFAULT_OPTIONS):
        from hybridqual.adapters.state_precision import with_state_dtype
        caps = super().capabilities(device, options)
        return with_state_dtype(caps, "float16") if options.configuration == "f16_state" else caps


def test_a_configuration_declaring_a_reduced_state_is_judged_with_its_own_tau(tmp_path):
    """The run's τ is the default configuration's; an instance of a configuration that declares a float16 state is
    judged with the τ measured for that state (hybridqual.adapters.state_precision), not with fp32's."""
    from hybridqual.adapters.state_precision import STATE_PRECISION
    from hybridqual.qualify.compare import tau_for
    args = runner.parse_args(["--configuration", "default", "f16_state", "--out", str(tmp_path), "--quiet",
                              "--in-process", "--jobs", "1"])
    base = scenarios.main_job_plan
    try:
        scenarios.main_job_plan = lambda: [(scenarios.MODELS / "zoo-mamba2", ["request_order"], None)]
        assert runner.run(args, Engine(DeclaresFloat16StateInOneConfiguration), True) == 0
    finally:
        scenarios.main_job_plan = base
    report = json.loads((tmp_path / "report.json").read_text())
    taus = {c["trace"]: c["data"]["tau"] for c in report["checks"] if c["name"].endswith("tokens match the truth")
            or "tokens match the truth" in c["name"]}
    assert taus["zoo-mamba2/request_order"] == tau_for(torch.float64)          # the oracle adapter computes in fp64
    assert taus["zoo-mamba2/request_order [f16_state]"] == STATE_PRECISION["float16"].tau
