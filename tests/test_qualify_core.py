"""qualify's core is typed: the plan's steps are dataclasses whose instance spec survives the trip to a --jobs
worker, and every check is listed once in the registry, under one name, with one signature."""
import inspect
import json

import pytest

from hybridqual.qualify import checks, steps
from hybridqual.qualify.context import CheckContext


@pytest.mark.parametrize("spec", [
    steps.InstanceSpec("goldens/models/tiny-sort", 2, 5, scenario="seed_compaction"),
    steps.InstanceSpec("goldens/models/zoo-bamba", 1, 1, trace_file="/tmp/t.json", configuration="unfused"),
])
def test_an_instance_spec_survives_the_json_trip_to_a_worker(spec):
    wire = json.loads(json.dumps({"task": 3, "t0": 0.0, "tau": 1e-3, **spec.to_json()}))
    assert steps.InstanceSpec.from_json(wire) == spec
    assert set(spec.to_json()) <= {"model", "i", "n", "scenario", "trace_file", "configuration"}
    assert None not in spec.to_json().values()          # only the fields set cross


def test_every_check_is_listed_once_with_one_name_and_one_signature():
    keys = [c.key for c in checks.PER_MODE + checks.ACROSS_MODES]
    titles = [c.title for c in checks.PER_MODE + checks.ACROSS_MODES]
    assert len(set(keys)) == len(keys) and len(set(titles)) == len(titles)
    assert all(c.title.startswith("{mode}: ") for c in checks.PER_MODE)
    assert not any("{mode}" in c.title for c in checks.ACROSS_MODES)
    for c in checks.PER_MODE + checks.ACROSS_MODES:
        params = list(inspect.signature(c.judge).parameters.values())
        assert len(params) == 1 and params[0].annotation in (CheckContext, "CheckContext"), c.key


def test_a_check_that_raises_is_a_fail_line_under_its_declared_name(monkeypatch):
    from hybridqual.adapters import Capabilities, RunResult

    def boom(ctx):
        raise RuntimeError("the engine crashed on a continuation")
    monkeypatch.setitem(checks.REGISTRY, "tokens", checks.QualifyCheck("tokens", checks.REGISTRY["tokens"].title, boom))
    ctx = checks.context(None, "m", None, None, tau=1e-3, label="m/t", caps=Capabilities(), mode="async",
                         run=RunResult({}))
    c = checks.run_check("tokens", ctx)
    assert c.status == "FAIL" and c.name == "async: tokens match the truth (tie-aware, τ=0.001)"
    assert c.detail == "the check raised RuntimeError: the engine crashed on a continuation"
