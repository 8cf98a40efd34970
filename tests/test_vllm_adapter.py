"""vLLM in-process (`--engine vllm`, marker vllm; needs .venv-vllm from scripts/install-vllm.sh and runs in its
python: `.venv-vllm/bin/python -m pytest -p no:xdist -m vllm tests/test_vllm_adapter.py`): the oracle's tokens and
logits on the vLLM zoo models' default-plan subset with vLLM's schedule facts consistent, generated traces the
same way, and a mutated vLLM (a reused Mamba slot's state not cleared) FAILed by qualify."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import oracle
from hybridqual.adapters.vllm.engine import import_error

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(import_error() is not None, reason=str(import_error()))]
ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "goldens" / "models"
SUBSET = ("seed_compaction", "slot_exhaustion", "stop_tokens")


def _qualify(engine: str, model: str, scenarios: tuple[str, ...], out: Path, in_process: bool = True) -> tuple[int, dict]:
    argv = ["--engine", engine, "--model", str(MODELS / model), "--scenario", *scenarios, "--mode", "legacy",
            "--jobs", "1", "--quiet", "--out", str(out)]
    if in_process:
        from hybridqual.qualify.runner import main
        rc = main(argv)
    else:
        rc = subprocess.run([sys.executable, "-m", "hybridqual.qualify", *argv], capture_output=True, text=True,
                            cwd=ROOT, timeout=900).returncode
    return rc, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("model", ["zoo-granite_hd32", "zoo-nemotron_h_hd32"])
def test_vllm_gives_the_oracle_tokens_and_logits_on_the_default_plan_subset(model, tmp_path):
    rc, report = _qualify("vllm", model, SUBSET, tmp_path)
    checks = report["checks"]
    failed = [(c["trace"], c["name"], c["detail"][:200]) for c in checks
              if c["status"] == "FAIL"]
    assert rc == 0 and not failed, failed
    passed = {c["name"].split(" (")[0] for c in checks if c["status"] == "PASS"}
    for line in ("legacy: tokens match the truth", "legacy: logits match the oracle's",
                 "legacy: vLLM's schedule facts are a correct schedule's"):
        assert line in passed, (line, sorted(passed))


C, VOCAB = 8, 96


@st.composite
def traces(draw):
    """2-5 requests on 2 slots within a 32-token budget (one engine shape), arrivals 0-4, prompts of 1-24 tokens
    cut from a shared base (shared prefixes), 1-5 new tokens, a stop id sometimes."""
    from oracle.trace import EngineConfig, Request, Trace
    base = draw(st.lists(st.integers(3, VOCAB - 1), min_size=24, max_size=24))
    reqs = []
    for i in range(draw(st.integers(2, 5))):
        prompt = base[:draw(st.integers(1, 24))]
        stops = tuple(draw(st.lists(st.integers(3, VOCAB - 1), max_size=1)))
        reqs.append(Request(f"r{i}", draw(st.integers(0, 4)), tuple(prompt), draw(st.integers(1, 5)), stops))
    return Trace(EngineConfig(2, 32, 32, "legacy"), tuple(reqs))


_ORACLES: dict = {}


@settings(max_examples=6, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(trace=traces())
def test_generated_traces_match_the_oracle_with_consistent_schedule_facts(trace):
    from hybridqual.adapters.vllm.adapter import VLLMAdapter
    from hybridqual.adapters.vllm.schedule_facts import problems
    from hybridqual.qualify.compare import compare_tie_aware, tau_for, teacher_forced_logits
    from oracle.trace import TraceError, check_against_model, model_positions
    folder = MODELS / "zoo-granite_hd32"
    model = _ORACLES.get(folder) or _ORACLES.setdefault(folder, oracle.load(folder, dtype=torch.float64))
    try:
        trace = check_against_model(trace, VOCAB, C, model_positions(model.config))
    except TraceError:
        assume(False)
    run = VLLMAdapter(folder, trace, "legacy").run_trace()
    for r in trace.requests:
        got = run.tokens[r.id]
        v = compare_tie_aware(model, r.id, r.prompt, got, r.stop_token_ids, r.max_new_tokens, tau_for(torch.float32))
        assert v.ok, (r.id, v.failure, trace)
        err = (run.logits[r.id].double() - teacher_forced_logits(model, r.prompt, got)).abs().max().item()
        assert err < 1e-4, (r.id, err)
    assert problems(trace, run.tokens, run.schedule_facts) == [], trace


def test_a_mutated_vllm_fails_qualify(tmp_path):
    """The mutant (a new request's prefill starts from its slot's old SSM state) on slot_exhaustion, where the
    unmutated vLLM passes (the subset test): qualify exits 1 with the logits line FAILed."""
    from hybridqual.adapters.vllm import mutant
    mutant.build()
    rc, report = _qualify("vllm-mutant", "zoo-granite_hd32", ("slot_exhaustion",), tmp_path, in_process=False)
    status = {c["name"].split(" (")[0]: c["status"] for c in report["checks"]}
    assert rc == 1, status
    assert status["legacy: logits match the oracle's"] == "FAIL", status
    assert "MUTANT" in json.dumps(report)
