"""The bug zoo stays valid and its CI subset is killed (DESIGN §9).

Every mutant's patch must still apply exactly once to the current tree (cheap; catches a stale zoo after a
refactor), the runner must tell assertion kills from crashes, and every QUICK mutant must be KILLED by an
assertion of the suite when applied to a temporary copy (the full zoo: `python -m tools.mutants --jobs 2`).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.mutants.runner import ROOT, Mutant, classify, run_one, stale_hunks
from tools.mutants.zoo import MUTANTS, QUICK


def test_zoo_is_large_named_and_every_patch_applies_exactly_once():
    """≥ 20 mutants with unique names, stories and existing test files; each hunk's find text occurs once."""
    names = [m.name for m in MUTANTS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    assert QUICK <= set(names), f"QUICK names unknown mutants: {sorted(QUICK - set(names))}"
    assert not [m.name for m in MUTANTS if m.name in QUICK and m.gpu_only], "QUICK must run on CPU"
    for m in MUTANTS:
        assert m.story and m.bug_class and m.tests, f"{m.name}: needs a class, a story and tests"
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).exists(), f"{m.name}: test file {t} does not exist"
        assert all(find != replace for _, find, replace in m.hunks()), f"{m.name}: a hunk changes nothing"
        assert stale_hunks(m) == [], f"{m.name} is stale: {stale_hunks(m)}"


def _junit(tmp: Path, body: str) -> Path:
    p = tmp / "junit.xml"
    p.write_text(f'<testsuites><testsuite name="s">{body}</testsuite></testsuites>')
    return p


def test_runner_counts_only_assertion_failures_as_kills(tmp_path):
    """An assert failure is KILLED; an ImportError or a RuntimeError in the mutated code is a CRASH; a pass SURVIVED."""
    case = '<testcase classname="t" name="x"><{tag} message="{msg}">E   {msg}</{tag}></testcase>'
    assert classify(_junit(tmp_path, case.format(tag="failure", msg="AssertionError: tokens differ")), 1)[0] == "KILLED"
    assert classify(_junit(tmp_path, case.format(tag="failure", msg="assert 1 == 2")), 1)[0] == "KILLED"
    assert classify(_junit(tmp_path, case.format(tag="error", msg="ImportError: no module")), 1)[0] == "CRASH"
    assert classify(_junit(tmp_path, case.format(tag="failure", msg="RuntimeError: shape")), 1)[0] == "CRASH"
    assert classify(_junit(tmp_path, '<testcase classname="t" name="x"/>'), 0)[0] == "SURVIVED"


def test_a_stale_patch_is_reported_not_applied(tmp_path):
    """A mutant whose find text is absent is STALE (a defect of the zoo), never silently run unmutated."""
    ghost = Mutant("ghost", "zoo", "anchor vanished", "fastpath/engine/rows.py", "no such line\n", "x\n",
                   ("tests/test_engine_rows.py",))
    assert stale_hunks(ghost)
    assert run_one(ghost).status == "STALE"


def test_quick_mutants_are_killed_by_assertions():
    """The CI subset of the zoo, two at a time: every one KILLED (an assertion of the suite saw the defect)."""
    chosen = [m for m in MUTANTS if m.name in QUICK]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(run_one, chosen))
    bad = [f"{o.mutant.name}: {o.status} {o.killed_by}" for o in outcomes if o.status != "KILLED"]
    assert not bad, "mutants not killed: " + "; ".join(bad)
