"""The main job's command line: it passes on the shipped model, refuses bad arguments by name, and runs under torchrun."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEED = "goldens/traces/seed_compaction.json"


def qualify(*args, launcher=(sys.executable, "-m")):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return subprocess.run([*launcher, "tools.qualify", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_qualify_passes_and_writes_json_and_junit(tmp_path):
    p = qualify("--trace", SEED, "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed"] == 0 and report["passed"] == 5
    assert "<testsuite" in (tmp_path / "junit.xml").read_text()
    assert "5/5 checks passed" in p.stdout


@pytest.mark.parametrize("args,words", [
    (["--model", "no/such/folder"], "--model no/such/folder: no config.json"),
    (["--engine", "nosuch"], "--engine 'nosuch'"),
    (["--tp", "2"], "--tp 2: needs torchrun"),
])
def test_qualify_refuses_bad_arguments_naming_them(args, words, tmp_path):
    p = qualify(*args, "--out", str(tmp_path))
    assert p.returncode == 2 and words in p.stderr, p.stderr


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_qualify_tp2_under_torchrun_matches_goldens(tmp_path):
    p = qualify("--tp", "2", "--trace", SEED, "--mode", "legacy", "--out", str(tmp_path),
                launcher=("torchrun", "--nproc_per_node", "2", "-m"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text())["failed"] == 0
