"""`--engine vllm-server`'s launcher (tools/adapters/vllm/server.py) on a stand-in server (tests/fake_vllm_server.py:
vLLM's command line and answer form, served by the fp64 oracle): started on 127.0.0.1, ready-checked, its log under
--out, stopped at the end and on SIGINT; a server that exits at start-up, is not ready in time or dies mid-run is a
FAIL naming it with its log's tail, and the instances left still get a verdict. Default CPU tier (no vLLM)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridqual.adapters.openai.adapter import PROBES, SEEN
from hybridqual.adapters.vllm.server import SERVERS, LaunchSettings, VLLMServerAdapter

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "goldens" / "models" / "tiny-sort"
TRACES = ROOT / "goldens" / "traces"
HERE = Path(__file__).resolve().parent
FAKE = LaunchSettings(python=Path(sys.executable), module="fake_vllm_server", base_flags=(), ready_timeout=60,
                      stop_timeout=5)


class FakeLaunched(VLLMServerAdapter):
    """vllm-server with the stand-in server (for runs in a subprocess, where a monkeypatch does not reach)."""
    launch = FAKE


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    """The stand-in importable by the server's python, the launcher reset before and after."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_VLLM_MARKER", str(tmp_path / "died"))
    monkeypatch.setattr(VLLMServerAdapter, "launch", FAKE)
    PROBES.clear()
    SEEN.clear()
    SERVERS.reset()
    yield tmp_path
    SERVERS.reset()
    PROBES.clear()
    SEEN.clear()


def qualify_here(out: Path, traces: list, *extra: str) -> tuple[int, dict]:
    """qualify --engine vllm-server in this process on shipped trace names or trace paths; (exit code, {instance:
    [(status, name, detail)]})."""
    from hybridqual.qualify import runner
    files = [str(t) if isinstance(t, Path) else str(TRACES / f"{t}.json") for t in traces]
    rc = runner.main(["--engine", "vllm-server", "--model", str(TINY), "--mode", "legacy", "--in-process",
                      "--trace", *files, "--out", str(out), *extra])
    rep = json.loads((out / "report.json").read_text())
    got: dict = {}
    for c in rep["checks"]:
        got.setdefault(c["trace"], []).append((c["status"], c["name"], c["detail"]))
    return rc, got


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def server_pids(out: Path) -> list[int]:
    """The pids the launcher wrote at the head of each server log under --out."""
    pids = []
    for log in sorted((out / "vllm-server").glob("*.log")):
        pids += [int(ln.split()[-1]) for ln in log.read_text().splitlines() if ln.startswith("# pid ")]
    return pids


def test_launched_server_passes_with_its_log_under_out(fake_env):
    """One command: the server started on 127.0.0.1 at a free port, the instance judged PASS through the openai
    adapter, its command line and log in --out/vllm-server/1-default.log."""
    out = fake_env / "q"
    rc, got = qualify_here(out, ["seed_compaction"])
    lines = got["tiny-sort/seed_compaction"]
    assert rc == 0, lines
    assert ("PASS", "legacy: tokens match the truth (tie-aware, τ=0.001)") in [(s, n) for s, n, _ in lines]
    log = (out / "vllm-server" / "1-default.log").read_text()
    assert "--host 127.0.0.1 --port" in log and "Application startup complete." in log
    assert SERVERS.current is not None and SERVERS.current.alive()
    pid = SERVERS.current.proc.pid
    SERVERS.stop_all()
    assert not alive(pid)


def test_server_exiting_at_start_is_a_fail_naming_it(fake_env, monkeypatch):
    """A server that exits at start-up (vLLM refusing a model or a flag): the instance FAILs naming it with its
    log's tail; the next instance FAILs with the same reason at once, without a second start."""
    monkeypatch.setenv("FAKE_VLLM_MODE", "exit")
    again = fake_env / "seed_again.json"
    again.write_text((TRACES / "seed_compaction.json").read_text())
    rc, got = qualify_here(fake_env / "q", ["seed_compaction", again])
    (status, name, detail), = got["tiny-sort/seed_compaction"]
    assert rc == 1 and status == "FAIL" and "engine runs the trace" in name
    assert "the vLLM server (pid" in detail and "exited with code 3 before it was ready" in detail
    assert "this model cannot be served (fake)" in detail
    (status, _, detail2), = got["tiny-sort/seed_again"]
    assert status == "FAIL" and detail2.startswith("ServerError: not started again: the vLLM server (pid")
    assert [p.name for p in (fake_env / "q" / "vllm-server").glob("*.log")] == ["1-default.log"]


def test_server_not_ready_in_time_is_a_fail_naming_it(fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    monkeypatch.setattr(VLLMServerAdapter, "launch", LaunchSettings(
        python=Path(sys.executable), module="fake_vllm_server", base_flags=(), ready_timeout=3, stop_timeout=2))
    t0 = time.monotonic()
    rc, got = qualify_here(fake_env / "q", ["seed_compaction"])
    (status, _, detail), = got["tiny-sort/seed_compaction"]
    assert rc == 1 and status == "FAIL" and "was not ready within 3 s" in detail and "mode hang" in detail
    assert time.monotonic() - t0 < 60
    assert all(not alive(p) for p in server_pids(fake_env / "q"))


def _one_fail_then_a_fresh_server_passes(fake_env, monkeypatch, mode: str, words: str) -> int:
    """Run seed_compaction, then a copy of it, against a fake server in `mode`: the first instance is one FAIL line
    naming `words` and the server log's tail, the second PASSes its tokens on a server started afresh; the exit code."""
    monkeypatch.setenv("FAKE_VLLM_MODE", mode)
    again = fake_env / "seed_again.json"
    again.write_text((TRACES / "seed_compaction.json").read_text())
    rc, got = qualify_here(fake_env / "q", ["seed_compaction", again])
    first = got["tiny-sort/seed_compaction"]
    assert [s for s, _, _ in first] == ["FAIL"], first
    assert words in first[0][2] and "engine core died (fake)" in first[0][2], first
    second = got["tiny-sort/seed_again"]
    assert any(n.startswith("legacy: tokens match the truth") and s == "PASS" for s, n, _ in second), second
    assert (fake_env / "q" / "vllm-server" / "2-default.log").exists()
    return rc


def test_server_dying_mid_run_fails_naming_it_and_the_rest_get_verdicts(fake_env, monkeypatch):
    """The server exits at its 3rd completion: that instance FAILs naming the dead server (exit code 9, its log's
    last line), and the next instance runs on a server started afresh and PASSes."""
    rc = _one_fail_then_a_fresh_server_passes(fake_env, monkeypatch, "die_once:3", "died (exit code 9)")
    assert rc == 1


def test_server_that_stops_answering_is_named_and_replaced(fake_env, monkeypatch):
    """The server answers HTTP 500 and stops listening while its process lives on (vLLM's API server after its
    engine died, before it exits): that instance FAILs naming the server and its log's tail; the next finds it not
    answering, stops it and runs on a fresh one (PASS)."""
    _one_fail_then_a_fresh_server_passes(fake_env, monkeypatch, "deaf_once:3", "the vLLM server (pid")
    assert all(not alive(p) for p in server_pids(fake_env / "q")[:1])


def test_base_url_refused_for_vllm_server(fake_env, capsys):
    """vllm-server starts its own server: --base-url is refused by name, and no server is started."""
    from hybridqual.qualify import runner
    rc = runner.main(["--engine", "vllm-server", "--base-url", "http://127.0.0.1:1", "--model", str(TINY),
                      "--in-process", "--trace", str(TRACES / "seed_compaction.json"), "--out", str(fake_env / "q")])
    got = capsys.readouterr()
    assert (rc == 2 and "--base-url" in got.err) or (rc == 1 and "starts its own server" in got.out), got
    assert SERVERS.current is None and SERVERS.starts == 0


def test_server_stopped_when_qualify_is_interrupted(fake_env, monkeypatch):
    """SIGINT to a qualify run whose requests are in flight: qualify exits and its server is gone."""
    monkeypatch.setenv("FAKE_VLLM_MODE", "slow:30")
    out = fake_env / "q"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # A shell's background job (no job control) starts with SIGINT ignored, and an ignored signal stays ignored across
    # exec, so the child would never see the SIGINT this test sends; a caught one is reset to the default there.
    caught = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "hybridqual.qualify", "--engine",
                              "test_vllm_server_launcher:FakeLaunched", "--in-process", "--model", str(TINY),
                              "--trace", str(TRACES / "seed_compaction.json"), "--mode", "legacy", "--out", str(out)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, caught)
    try:
        deadline = time.monotonic() + 90
        while not server_pids(out) or "startup complete" not in (out / "vllm-server" / "1-default.log").read_text():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.poll() is not None else ""
            time.sleep(0.5)
        time.sleep(2)
        p.send_signal(signal.SIGINT)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, p.stdout.read()
    pids = server_pids(out)
    assert pids and all(not alive(pid) for pid in pids)
