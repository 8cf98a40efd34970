"""Greedy forms of the seeded scenarios (hybridqual.scenarios.plan.greedy_form): a greedy-only engine runs each
seeded scenario's shape (same arrivals, prompts, lengths, stop ids) instead of skipping the instance."""
from __future__ import annotations

import pytest
import torch

import oracle
from hybridqual.adapters.base import Capabilities
from hybridqual.adapters.oracle import OracleAdapter
from hybridqual.qualify import checks
from hybridqual.qualify.steps import instances_for
from hybridqual.scenarios import plan as scenarios

SEEDED = ("async_drain", "seeded_sampling", "special_ids", "cobatch_reuse")
MAMBA2 = scenarios.MODELS / "zoo-mamba2"


@pytest.mark.parametrize("name", SEEDED)
def test_the_greedy_form_keeps_every_request_but_its_sampling(name):
    cfg = oracle.from_hf_config(MAMBA2 / "config.json")
    [seeded] = scenarios.instantiate(MAMBA2, cfg, [name])
    [greedy] = scenarios.instantiate(MAMBA2, cfg, [name], greedy_only=True)
    assert any(r.sampling.kind == "seeded" for r in seeded.trace.requests)
    assert all(r.sampling.kind == "greedy" for r in greedy.trace.requests)
    strip = lambda t: [(r.id, r.arrival_step, r.prompt, r.max_new_tokens, r.stop_token_ids)  # noqa: E731
                       for r in t.requests]
    assert strip(greedy.trace) == strip(seeded.trace) and greedy.trace.engine == seeded.trace.engine
    assert greedy.scenario == name and "Greedy form" in greedy.trace.description
    [plain] = scenarios.instantiate(MAMBA2, cfg, ["seed_compaction"], greedy_only=True)
    assert plain.concrete == scenarios.instantiate(MAMBA2, cfg, ["seed_compaction"])[0].concrete


class GreedyOracle(OracleAdapter):
    """The oracle behind a greedy-only declaration (as llama.cpp's and the servers' adapters declare)."""
    CAPABILITIES = Capabilities(("greedy",), ("legacy",), schedule_log=True, compute_dtype=torch.float64)


def test_a_greedy_only_engine_runs_the_greedy_form_instead_of_skipping():
    model = oracle.load(MAMBA2)
    [skipped] = instances_for(MAMBA2, model.config, ["async_drain"], "zoo-mamba2")
    lines = checks.check_instance(GreedyOracle, MAMBA2, skipped, ["legacy"], model, "cpu")
    assert lines[0].status == "SKIP" and "seeded" in lines[0].detail
    [inst] = instances_for(MAMBA2, model.config, ["async_drain"], "zoo-mamba2", greedy_only=True)
    lines = checks.check_instance(GreedyOracle, MAMBA2, inst, ["legacy"], model, "cpu")
    tokens = next(c for c in lines if "tokens match" in c.name)
    assert tokens.status == "PASS" and not any(c.status == "FAIL" for c in lines)
