"""docs/api.md's `fastpath.Engine.from_pretrained(..., device="cpu")` works on a machine without a GPU as written
(the interpreter is switched on by importing fastpath), and says how when the interpreter was switched off."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE = ("import fastpath, oracle, os; "
        "trace = oracle.load_trace('goldens/traces/chunked_prefill.json'); "
        "e = fastpath.Engine.from_pretrained('goldens/models/zoo-bamba', trace.engine, device='cpu'); "
        "r = e.run_trace(trace); print('ran', os.environ.get('TRITON_INTERPRET'), len(r.tokens))")


def _run(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(__import__("fastpath")._has_gpu_device(), reason="this machine has a GPU device")
def test_engine_on_cpu_runs_without_setting_the_interpreter_by_hand():
    p = _run({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert p.returncode == 0 and p.stdout.startswith("ran 1 "), p.stdout + p.stderr[-2000:]


def test_engine_on_cpu_with_the_interpreter_off_says_how_to_turn_it_on():
    p = _run(dict(os.environ, TRITON_INTERPRET="0"))
    assert p.returncode != 0
    assert "set TRITON_INTERPRET=1 before importing fastpath" in p.stderr, p.stderr[-2000:]
    assert "active drivers" not in p.stderr, p.stderr[-2000:]
