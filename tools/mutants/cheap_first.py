"""pytest plugin for the blind judge's CPU-tier stage (`-p hybridqual.mutants.cheap_first`): the same tests, cheapest
test files first, so `pytest -x` reaches a unit test that sees a defect within minutes rather than after the
end-to-end files. Only the order changes: every test still runs when none fails, so a SURVIVED verdict is the
whole tier's. The order comes from `tier_times.json` (beside this file: a test file's mean seconds per test,
measured from a full tier's JUnit XML); a file missing there keeps its place after the measured ones.

    python -m hybridqual.mutants.cheap_first JUNIT.xml [...] > tools/mutants/tier_times.json    # re-measure
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TIMES = Path(__file__).with_name("tier_times.json")


def file_of(nodeid: str) -> str:
    """`tests/test_x.py::test_y[p]` -> `tests/test_x.py`."""
    return nodeid.split("::", 1)[0]


def load_times(path: Path = TIMES) -> dict[str, float]:
    """Mean seconds per test of each test file (empty when not measured)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v["mean_s"]) for k, v in body.get("files", {}).items()}


def cheapest_first(nodeids: list[str], times: dict[str, float]) -> list[int]:
    """Indices of `nodeids` in run order: files by mean test time (measured ones first), each file's tests kept
    together and in their collected order (module-scoped fixtures are then built once per worker)."""
    rank: dict[str, int] = {}
    for n in nodeids:
        rank.setdefault(file_of(n), len(rank))
    unmeasured = max(times.values(), default=0.0) + 1.0
    order = sorted(rank, key=lambda f: (times.get(f, unmeasured), rank[f]))
    place = {f: i for i, f in enumerate(order)}
    return sorted(range(len(nodeids)), key=lambda i: (place[file_of(nodeids[i])], i))


def pytest_collection_modifyitems(session, config, items) -> None:
    times = load_times()
    if times:
        idx = cheapest_first([it.nodeid for it in items], times)
        items[:] = [items[i] for i in idx]


def times_from_junit(paths: list[Path]) -> dict:
    """Per test file: tests, total and mean seconds, from JUnit XML files of full tier runs (the mean of runs)."""
    acc: dict[str, list[float]] = {}
    for p in paths:
        for case in ET.parse(p).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                continue
            cls = case.get("classname", "")
            f = cls.split(".")
            name = "/".join(f[:2]) + ".py" if len(f) >= 2 else cls
            acc.setdefault(name, []).append(float(case.get("time") or 0.0))
    return {"source": [p.name for p in paths], "files": {
        f: {"tests": len(v), "total_s": round(sum(v), 2), "mean_s": round(sum(v) / len(v), 3)}
        for f, v in sorted(acc.items())}}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(times_from_junit([Path(a) for a in sys.argv[1:]]), indent=1))
