"""The qualification matrix as pytest items (hybridqual.qualification_matrix through the plugin): one item per
(instance, engine, configuration), a wrong engine's item FAILs, the truth is loaded once per process for every
engine, --hq-engine expands @all and refuses an unknown engine or configuration by name, and a worker's engines get
cores // workers threads."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridqual.paths import ROOT
from hybridqual.pytest_hq import engine_specs, worker_budget

from test_packaging import _Config   # noqa: E402  (the pytest.Config stand-in the plugin reads)


def test_hq_engine_expands_all_and_refuses_unknown_names():
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    assert engine_specs(_Config()) == [("fastpath", None)]
    declared = [c.name for c in LlamaCppAdapter.configurations()]
    assert engine_specs(_Config(**{"--hq-engine": ["oracle", "llamacpp@all", "oracle"]})) == \
        [("oracle", None), ("llamacpp", None)] + [("llamacpp", c) for c in declared]
    with pytest.raises(pytest.UsageError, match="--hq-engine nosuch"):
        engine_specs(_Config(**{"--hq-engine": ["nosuch"]}))
    with pytest.raises(pytest.UsageError, match="--hq-engine oracle@fast: oracle declares no configuration 'fast'"):
        engine_specs(_Config(**{"--hq-engine": ["oracle@fast"]}))


def test_a_worker_of_n_gets_cores_over_n_threads(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")
    assert (worker_budget().threads, worker_budget().jobs) == (2, 8)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert worker_budget().threads == 16


def test_the_matrix_is_one_item_per_instance_and_engine_and_a_wrong_engine_fails(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "hybridqual.pytest_hq",
                        "--rootdir", str(tmp_path), "--pyargs", "hybridqual.qualification_matrix",
                        "--hq-model", str(ROOT / "goldens" / "models" / "tiny-sort"), "--hq-scenario",
                        "seed_compaction", "--hq-engine", "oracle", "--hq-engine", "broken_engines:SlowWrongOracle"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert "test_instance_qualifies[oracle-tiny-sort-seed_compaction] PASSED" in out, out[-3000:]
    assert "test_instance_qualifies[broken_engines:SlowWrongOracle-tiny-sort-seed_compaction] FAILED" in out
    assert "tokens match the truth" in out and "1 failed, 1 passed" in out
    assert "; 1 truths loaded" in out                 # one fp64 model for both engines of the process
