"""Apply one mutant to a temporary copy of the project, run the tests that should kill it, classify the outcome.

A mutant is killed only by an *assertion* failure (a differential check that saw the defect). A run that dies
of ImportError/SyntaxError/collection errors is a crash and does not count; a mutant whose patch no longer
applies (its `find` text is not in the file exactly once) is STALE, which is a defect of the zoo itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPY_IGNORE = shutil.ignore_patterns(".git", "out", "__pycache__", "*.egg-info", ".hypothesis", ".peer", ".whl")
# Exceptions that mean "the mutated code could not even run" rather than "a check caught the defect".
CRASH_TYPES = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError", "NameError")


@dataclass(frozen=True)
class Mutant:
    """A small realistic defect: replace `find` (must occur exactly once) by `replace` in `file`."""
    name: str
    bug_class: str
    story: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]          # pytest node ids / paths expected to kill it
    gpu_only: bool = False


@dataclass
class Outcome:
    """What happened to one mutant."""
    mutant: Mutant
    status: str                     # KILLED | SURVIVED | CRASH | STALE | SKIPPED
    killed_by: str
    seconds: float


def apply(m: Mutant, tree: Path) -> bool:
    """Patch the copy; False when the patch does not apply exactly once."""
    path = tree / m.file
    if not path.exists():
        return False
    text = path.read_text()
    if text.count(m.find) != 1:
        return False
    path.write_text(text.replace(m.find, m.replace))
    return True


def classify(junit_path: Path, rc: int) -> tuple[str, str]:
    """(status, killed_by) from pytest's JUnit XML and exit code."""
    if not junit_path.exists():
        return "CRASH", f"pytest exit {rc}, no report"
    root = ET.parse(junit_path).getroot()
    killers, crashes = [], []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            for el in case.findall(tag):
                msg = (el.get("message") or "") + " " + (el.text or "")[-2000:]
                node = f"{case.get('classname')}::{case.get('name')}"
                if tag == "failure" and "AssertionError" in msg or tag == "failure" and "Failed:" in msg:
                    killers.append(node)
                elif any(t in msg for t in CRASH_TYPES) or tag == "error":
                    crashes.append(node)
                else:
                    killers.append(node)
    if killers:
        return "KILLED", killers[0]
    if crashes:
        return "CRASH", crashes[0]
    if rc == 0:
        return "SURVIVED", ""
    return "CRASH", f"pytest exit {rc}"


def run_one(m: Mutant, timeout: int = 900) -> Outcome:
    """Copy the project, apply the mutant, run its tests under the CPU tier settings."""
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"hq-mutant-{m.name}-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=COPY_IGNORE)
        if not apply(m, tree):
            return Outcome(m, "STALE", f"patch does not apply once to {m.file}", time.time() - t0)
        env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
        where = subprocess.run([sys.executable, "-c", "import oracle, fastpath; print(oracle.__file__, fastpath.__file__)"],
                               cwd=tree, env=env, capture_output=True, text=True)
        if where.returncode != 0 or where.stdout.count(str(tree)) != 2:
            return Outcome(m, "CRASH", f"the copy is not what gets imported: {where.stdout or where.stderr}",
                           time.time() - t0)
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            return Outcome(m, "CRASH", f"timeout after {timeout} s", time.time() - t0)
        status, by = classify(junit, rc)
        return Outcome(m, status, by, time.time() - t0)
