"""The pytest plugin runs the scenario corpus for a user's model: `pytest --hq-model FOLDER` parametrises hq_case over
every scenario instantiated for it (a skipped scenario is a skipped case with its reason), `--hq-scenario` picks
some, `--hq-trace` still pairs trace files, and an unknown scenario is a usage error."""
import os
import subprocess
import sys

from oracle.zoo import write_hf_folder
from hybridqual.paths import ROOT
from hybridqual.scenarios.plan import SCENARIOS

from test_packaging import _Config   # noqa: E402  (the pytest.Config stand-in the plugin's pairing reads)

TEST = "tests/test_packaging.py::test_hq_case_fits_its_model"      # reads the pair's files only: no engine


def pytest_run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:xdist", "-p", "no:cacheprovider",
                           *args, TEST], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_hq_model_alone_runs_every_scenario_instantiated_for_a_chunk_256_model(tmp_path):
    folder = tmp_path / "my-model"
    write_hf_folder(folder, "bamba", seed=0, chunk_size=256)
    p = pytest_run("--hq-model", str(folder))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    n_pass = int(out.split(" passed")[0].split()[-1])
    n_skip = int(out.split(" skipped")[0].split()[-1]) if " skipped" in out else 0
    assert n_pass + n_skip == len(SCENARIOS), out[-2000:]
    assert all("does not run on my-model:" in line for line in out.splitlines() if line.startswith("SKIPPED"))


def test_hq_scenario_picks_scenarios_and_hq_trace_still_pairs_files(tmp_path):
    import pytest
    from hybridqual.pytest_hq import hq_pairs, scenario_cases, scenario_names
    model = ROOT / "goldens" / "models" / "zoo-mamba2"
    seed = ROOT / "goldens" / "traces" / "seed_compaction.json"
    cfg = _Config(**{"--hq-model": [model], "--hq-scenario": ["request_order", "piece_chunk"], "--hq-trace": [seed]})
    assert scenario_names(cfg) == ["request_order", "piece_chunk"] and hq_pairs(cfg) == [(model, seed)]
    cases = scenario_cases(cfg, scenario_names(cfg))
    assert [c.id for c in cases] == ["zoo-mamba2-request_order", "zoo-mamba2-piece_chunk"]
    assert all(c.values[0][1].name == c.id.split("-", 2)[-1] + ".json" for c in cases)   # stem = scenario name
    import shutil
    shutil.rmtree(cfg._hq_scenario_dir)
    assert scenario_names(_Config(**{"--hq-model": [model]})) == list(SCENARIOS)
    assert scenario_names(_Config(**{"--hq-model": [model], "--hq-trace": [seed]})) is None
    assert scenario_names(_Config()) is None                          # the default tier: shipped pairs, unchanged
    with pytest.raises(pytest.UsageError, match="--hq-scenario no_such: not a scenario"):
        scenario_names(_Config(**{"--hq-scenario": ["no_such"]}))


def test_skipped_qualify_checks_are_counted_as_skips_not_hidden_in_a_pass(tmp_path):
    """A user test over hq_qualify passes, but the run's summary says how many checks were skipped and why."""
    user = tmp_path / "test_user_engine.py"
    user.write_text("from hybridqual.adapters import OracleAdapter\n\n"
                    "def test_engine(hq_case, hq_qualify):\n"
                    "    checks = hq_qualify(OracleAdapter, modes=('legacy',))\n"
                    "    assert all(c.ok for c in checks)\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "--hq-model", str(ROOT / "goldens" / "models" / "zoo-mamba2"), "--hq-trace",
                        str(ROOT / "goldens" / "traces" / "async_drain.json"), str(user)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "1 passed" in out, out[-3000:]
    assert "hybridqual checks" in out and "the oracle adapter is the truth itself" in out, out[-3000:]
    summary = next(line for line in out.splitlines() if "qualify checks in the hq_qualify tests" in line)
    assert int(summary.split(" skipped")[0].split()[-1]) >= 1, summary
