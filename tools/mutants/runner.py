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
# Not copied into a mutant's tree: VCS data, outputs, caches, wheels and virtual environments (a
# multi-GB .venv-megatron made every blind judgement spend most of its time copying and deleting it).
COPY_IGNORE = shutil.ignore_patterns(".git", "out", "__pycache__", "*.egg-info", ".hypothesis", ".peer", ".whl",
                                     ".whl-src", ".venv*", "build", ".pytest_cache", ".hq-import")
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
    more: tuple[tuple[str, str, str], ...] = ()   # further hunks (file, find, replace) of the same defect

    def hunks(self) -> list[tuple[str, str, str]]:
        """Every (file, find, replace) of this mutant."""
        return [(self.file, self.find, self.replace), *self.more]


@dataclass
class Outcome:
    """What happened to one mutant."""
    mutant: Mutant
    status: str                     # KILLED | SURVIVED | CRASH | STALE | SKIPPED
    killed_by: str
    seconds: float


def stale_hunks(m: Mutant, tree: Path = ROOT) -> list[str]:
    """Hunks of `m` whose find text does not occur exactly once in `tree` (empty: the patch applies)."""
    bad = []
    for file, find, _ in m.hunks():
        path = tree / file
        n = path.read_text().count(find) if path.exists() else 0
        if n != 1 or find == "":
            bad.append(f"{file}: find text occurs {n} times")
    return bad


def apply(m: Mutant, tree: Path) -> bool:
    """Patch the copy; False when a hunk does not apply exactly once."""
    if stale_hunks(m, tree):
        return False
    for file, find, replace in m.hunks():
        path = tree / file
        path.write_text(path.read_text().replace(find, replace))
    return True


def classify(junit_path: Path, rc: int) -> tuple[str, str]:
    """(status, killed_by) from pytest's JUnit XML and exit code.

    KILLED needs an assertion failure (`assert`, pytest.fail, AssertionError raised by a check); a test that
    died of any other exception (import/syntax errors, but also a RuntimeError deep in the mutated code) is a
    CRASH: it shows the mutant breaks something, not that a check of the suite saw the defect."""
    if not junit_path.exists():
        return "CRASH", f"pytest exit {rc}, no report"
    root = ET.parse(junit_path).getroot()
    killers, crashes = [], []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            for el in case.findall(tag):
                head = el.get("message") or ""
                msg = head + " " + (el.text or "")[-3000:]
                node = f"{case.get('classname')}::{case.get('name')}"
                asserted = tag == "failure" and ("AssertionError" in msg or "Failed:" in msg or
                                                 head.startswith("assert "))
                if asserted and not any(t in head for t in CRASH_TYPES):
                    killers.append(node)
                else:
                    kind = head.split(':')[0][:60] or tag     # the exception type, then its message (the cause)
                    crashes.append(f"{node} ({kind}){head[len(kind):][:240]}")
    if killers:
        return "KILLED", killers[0]
    if crashes:
        return "CRASH", crashes[0]
    if rc == 0:
        return "SURVIVED", ""
    return "CRASH", f"pytest exit {rc}"


class NotRun(Exception):
    """The mutant could not be judged: STALE (its patch does not apply), INVALID (the patched code does not even
    compile or import) or CRASH (the copy is not what gets imported)."""

    def __init__(self, status: str, detail: str):
        super().__init__(f"{status}: {detail}")
        self.status, self.detail = status, detail


def module_of(file: str) -> str | None:
    """Dotted module name of a project .py file (None for other files): tools/ is the package `hybridqual`."""
    if not file.endswith(".py"):
        return None
    name = file[:-3].replace("/", ".").removesuffix(".__init__")
    return "hybridqual" + name[len("tools"):] if name == "tools" or name.startswith("tools.") else name


def import_path(tree: Path) -> str:
    """PYTHONPATH under which `tree` is what gets imported: `hybridqual` is its tools/ folder (through a link in
    tree/.hq-import, made here), then oracle/ and fastpath/ from the tree itself."""
    links = tree / ".hq-import"
    links.mkdir(exist_ok=True)
    if not (links / "hybridqual").exists():
        (links / "hybridqual").symlink_to(Path("..") / "tools", target_is_directory=True)
    return os.pathsep.join([str(links), str(tree)])


def mutated_copy(m: Mutant | None, tmp: Path) -> tuple[Path, dict[str, str]]:
    """Copy the project into tmp/tree, apply `m` (None: the unmutated control), check that the copy (and every
    patched module) is what gets imported; returns (tree, env for subprocesses). Raises NotRun when the mutant
    cannot be judged."""
    tree = Path(tmp) / "tree"
    shutil.copytree(ROOT, tree, ignore=COPY_IGNORE)
    if m is not None and not apply(m, tree):
        raise NotRun("STALE", "; ".join(stale_hunks(m, tree)))
    env = dict(os.environ, PYTHONPATH=import_path(tree), PYTHONDONTWRITEBYTECODE="1")
    if m is not None and m.gpu_only:   # compiled kernels on the device: the interpreter cannot reach 2^31 elements
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    files = sorted({f for f, _, _ in (m.hunks() if m is not None else []) if f.endswith(".py")})
    for f in files:                        # a patch that does not even parse is caught here, in-process
        try:
            compile((tree / f).read_text(), f, "exec")
        except SyntaxError as e:
            raise NotRun("INVALID", f"the patched {f} does not compile: {type(e).__name__}: {e}") from None
    mods = sorted(module_of(f) for f in files)
    probe = ("import importlib, oracle, fastpath, hybridqual\n"
             f"for mod in {mods!r}:\n    importlib.import_module(mod)\n"
             "print(oracle.__file__, fastpath.__file__, hybridqual.__file__)")
    where = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=env, capture_output=True, text=True)
    if where.returncode != 0:
        last = (where.stderr.strip().splitlines() or ["no output"])[-1]
        if any(last.startswith(t) for t in CRASH_TYPES):
            raise NotRun("INVALID", f"the patched code does not import: {last[:200]}")
        raise NotRun("CRASH", f"the copy does not import: {last[:200]}")
    if where.stdout.count(str(tree)) != 3:
        raise NotRun("CRASH", f"the copy is not what gets imported: {where.stdout.strip()}")
    return tree, env


def run_one(m: Mutant, timeout: int = 900) -> Outcome:
    """Copy the project, apply the mutant, run its tests under the CPU tier settings."""
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"hq-mutant-{m.name}-") as tmp:
        try:
            tree, env = mutated_copy(m, Path(tmp))
        except NotRun as e:
            status = "CRASH" if e.status == "INVALID" else e.status     # named runs: an invalid patch is a crash
            return Outcome(m, status, e.detail, time.time() - t0)
        junit = Path(tmp) / "junit.xml"
        # `-m ""`: a named test runs even where it is marked slow (the default tier deselects those)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-m", "",
               "-p", "hybridqual.mutants.no_shrink", f"--junitxml={junit}", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            return Outcome(m, "CRASH", f"timeout after {timeout} s", time.time() - t0)
        status, by = classify(junit, rc)
        return Outcome(m, status, by, time.time() - t0)
