"""qualify's report: check lines (PASS / FAIL / SKIP), written to report.json and junit.xml after every check.

The report is rewritten atomically after each finished check, so a hard kill leaves every result found so far
(with "status": "running"), and a run that ends any other way before its end (an exception, SIGTERM, SIGINT, an
exit) says "status": "aborted: <why>"; a stale report from an earlier run is removed before anything runs.
Skipped checks are counted apart from passed ones: a skip is a check that did not run, with its reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Check:
    """One line of the report: which instance, which check, its status and why."""
    trace: str
    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    data: dict = field(default_factory=dict)     # structured facts (per-request near ties, worst logits error, ...)

    @property
    def ok(self) -> bool:
        """Not failed (a skip is not a failure; it is not a pass either, see `passed`)."""
        return self.status != FAIL

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def skipped(self) -> bool:
        return self.status == SKIP

    @classmethod
    def of(cls, trace: str, name: str, ok: bool, detail: str = "", seconds: float = 0.0, **data) -> "Check":
        return cls(trace, name, PASS if ok else FAIL, detail, seconds, data)

    @classmethod
    def skip(cls, trace: str, name: str, reason: str) -> "Check":
        return cls(trace, name, SKIP, f"skipped: {reason}")


def versions(engine) -> dict[str, str]:
    """Versions of everything the verdict depends on: hybridqual, torch, triton, transformers, the engine."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("hybridqual", "torch", "triton", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        root = Path(__file__).resolve().parent.parent
        out["git"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        out["git"] = "unknown"
    out["engine"] = engine.version()
    out["python"] = sys.version.split()[0]
    return out


def junit(checks: list[Check]) -> str:
    """JUnit XML for CI dashboards (a SKIP is a <skipped/> test case)."""
    suite = ET.Element("testsuite", name="hybridqual.qualify", tests=str(len(checks)),
                       failures=str(sum(c.status == FAIL for c in checks)),
                       skipped=str(sum(c.status == SKIP for c in checks)))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=c.trace, name=c.name, time=f"{c.seconds:.3f}")
        if c.status == FAIL:
            ET.SubElement(case, "failure", message=c.detail[:500]).text = c.detail
        elif c.status == SKIP:
            ET.SubElement(case, "skipped", message=c.detail[:500])
    return ET.tostring(suite, encoding="unicode")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Report:
    """The run's report: header (engine, model, versions, τ), instances, checks; on disk after every change."""

    def __init__(self, out: Path | None, header: dict) -> None:
        self.out, self.header = out, dict(header)
        self.instances: list[dict] = []
        self.checks: list[Check] = []
        self.t0 = time.time()
        self.status = "running"
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            for name in ("report.json", "junit.xml"):
                (out / name).unlink(missing_ok=True)     # a stale report must never pass for this run's
            self.write()

    def instance(self, info: dict) -> None:
        """Record one scenario instance (model, scenario, family, concrete trace, truth source or skip reason)."""
        self.instances.append(info)
        self.write()

    def add(self, check: Check) -> None:
        self.checks.append(check)
        self.write()

    def counts(self) -> dict[str, int]:
        return {"passed": sum(c.passed for c in self.checks), "failed": sum(c.status == FAIL for c in self.checks),
                "skipped": sum(c.skipped for c in self.checks)}

    def finish(self) -> dict[str, int]:
        self.status = "finished"
        self.write()
        return self.counts()

    def abort(self, why: str) -> None:
        """Finalise the report of a run that did not finish: "status": "aborted: <why>" (every check so far kept)."""
        self.status = f"aborted: {why}"
        try:
            self.write()
        except OSError as e:              # the report cannot be written: say so, never mask the reason
            print(f"qualify: cannot write the report ({e})", file=sys.stderr)

    def write(self) -> None:
        if self.out is None:
            return
        body = {**self.header, "status": self.status, "seconds": round(time.time() - self.t0, 1), **self.counts(),
                "ran": sum(not c.skipped for c in self.checks), "instances": self.instances,
                "checks": [asdict(c) for c in self.checks]}
        _write_atomic(self.out / "report.json", json.dumps(body, indent=1, default=str))
        _write_atomic(self.out / "junit.xml", junit(self.checks))


class Progress:
    """Progress lines: one as each (instance × mode) starts and ends, with elapsed time; silent with quiet."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet, self.t0 = quiet, time.time()

    def say(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)

    def start(self, label: str) -> float:
        self.say(f"  ▶ {label} ... (t={time.time() - self.t0:.0f} s)")
        return time.time()

    def end(self, label: str, started: float, checks: list[Check]) -> None:
        n = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, SKIP)}
        self.say(f"  ■ {label} done in {time.time() - started:.1f} s: {n[PASS]} pass, {n[FAIL]} fail, "
                 f"{n[SKIP]} skip")

    def check(self, c: Check) -> None:
        self.say(f"    {c.status}  {c.name}: {c.detail}")
