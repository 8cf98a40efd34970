"""vLLM as served (`--engine vllm-server`): the real vLLM OpenAI server, started and stopped by qualify on 127.0.0.1,
judged through the openai adapter on a zoo model vLLM's CPU backend runs (marker vllm; needs .venv-vllm from
scripts/install-vllm.sh). Each run is one qualify subprocess, bounded; the server start-up dominates (minutes on a
loaded small CPU box: $HYBRIDQUAL_VLLM_READY_TIMEOUT, default 300 s, raised here to 900 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"
MAMBA2 = ROOT / "goldens" / "models" / "zoo-mamba2"

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not VENV_PY.exists(), reason=f"{VENV_PY} missing (run scripts/install-vllm.sh)")]


def qualify(out: Path, *argv: str, ready: int = 900, timeout: int = 2400,
            env: dict | None = None) -> tuple[int, str, dict]:
    """`hybridqual qualify --engine vllm-server ...` in a subprocess; (exit code, its output, {label: [(status,
    name, detail)]})."""
    e = dict(os.environ, HYBRIDQUAL_VLLM_READY_TIMEOUT=str(ready), **(env or {}))
    p = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", "vllm-server", "--mode", "legacy",
                        "--out", str(out), *argv], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    got: dict = {}
    rep = out / "report.json"
    if rep.exists():
        for c in json.loads(rep.read_text())["checks"]:
            got.setdefault(c["trace"], []).append((c["status"], c["name"], c["detail"]))
    return p.returncode, p.stdout + p.stderr, got


def pids(out: Path) -> list[int]:
    """The server pids written at the head of each server log under --out."""
    return [int(ln.split()[-1]) for log in sorted((out / "vllm-server").glob("*.log"))
            for ln in log.read_text().splitlines() if ln.startswith("# pid ")]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_vllm_server_passes_zoo_mamba2(tmp_path):
    """A correct vLLM server: every check PASSes or SKIPs with its reason (tokens exact, top-k logprobs within the
    bound), concurrent requests included; its log is under --out and the server is gone after qualify exits."""
    out = tmp_path / "q"
    rc, text, got = qualify(out, "--model", str(MAMBA2), "--scenario", "seed_compaction", "chunked_prefill")
    assert rc == 0, text[-3000:]
    for label, lines in got.items():
        assert not [ln for ln in lines if ln[0] == "FAIL"], (label, lines)
        assert any(n.startswith("legacy: tokens match the truth") and s == "PASS" for s, n, _ in lines), lines
        assert any(n.startswith("legacy: server logprobs") and s == "PASS" for s, n, _ in lines), lines
    assert pids(out) and all(gone(p) for p in pids(out))
    assert "--host 127.0.0.1" in (out / "vllm-server" / "1-default.log").read_text()


def test_vllm_server_not_ready_in_time_is_a_fail_naming_it(tmp_path):
    """A 5 s ready bound (vLLM needs far longer): the instance FAILs naming the server and its log, which is
    stopped."""
    out = tmp_path / "q"
    rc, text, got = qualify(out, "--model", str(MAMBA2), "--scenario", "seed_compaction", ready=5, timeout=300)
    lines = got["zoo-mamba2/seed_compaction"]
    assert rc == 1 and lines[0][0] == "FAIL", text[-2000:]
    assert "the vLLM server (pid" in lines[0][2] and "was not ready within 5 s" in lines[0][2], lines
    time.sleep(2)
    assert all(gone(p) for p in pids(out))


def test_vllm_server_killed_mid_run_fails_naming_it(tmp_path):
    """The server killed (SIGKILL) while an instance's requests are in flight: that instance FAILs naming the dead
    server; the next instance runs on a server started afresh and gets its own verdict."""
    out = tmp_path / "q"
    e = dict(os.environ, HYBRIDQUAL_VLLM_READY_TIMEOUT="900")
    p = subprocess.Popen([sys.executable, "-m", "hybridqual.qualify", "--engine", "vllm-server", "--mode", "legacy",
                          "--model", str(MAMBA2), "--scenario", "task_burst", "seed_compaction", "--out", str(out)],
                         cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 1200
        log = out / "vllm-server" / "1-default.log"
        while not (log.exists() and "POST /v1/completions" in log.read_text()):     # the timing probe answered
            assert p.poll() is None and time.monotonic() < deadline, "the server never answered a completion"
            time.sleep(0.5)
        time.sleep(5)                  # task_burst's requests in flight (110 tokens at the probe's ~1 s a token)
        os.kill(pids(out)[0], 9)
        text, _ = p.communicate(timeout=1800)
    finally:
        if p.poll() is None:
            p.kill()
    got = {c["trace"]: c for c in json.loads((out / "report.json").read_text())["checks"]
           if c["name"].startswith("legacy: engine runs") or c["name"].startswith("legacy: tokens match")}
    first = got["zoo-mamba2/task_burst"]
    assert first["status"] == "FAIL" and "died (exit code -9)" in first["detail"], (first, text[-2000:])
    second = got["zoo-mamba2/seed_compaction"]
    assert second["status"] == "PASS", second
    assert all(gone(pid) for pid in pids(out))


def test_mutated_vllm_server_fails(tmp_path):
    """The mutated vLLM (hybridqual.adapters.vllm.mutant: a reused Mamba slot's SSM state not cleared) served:
    qualify FAILs it on slot_exhaustion (slots reused), and the report names the mutant."""
    subprocess.run([str(VENV_PY), "-m", "hybridqual.adapters.vllm.mutant", "build"], cwd=ROOT, check=True,
                   capture_output=True, timeout=600)
    out = tmp_path / "q"
    e = dict(os.environ, HYBRIDQUAL_VLLM_READY_TIMEOUT="900")
    p = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", "vllm-server-mutant", "--mode",
                        "legacy", "--model", str(ROOT / "goldens" / "models" / "zoo-granite_hd32"), "--scenario",
                        "slot_exhaustion", "--out", str(out)], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=2400)
    rep = json.loads((out / "report.json").read_text())
    assert p.returncode == 1 and "MUTANT" in json.dumps(rep.get("versions")), p.stdout[-3000:]
    fails = [c for c in rep["checks"] if c["status"] == "FAIL"]
    assert fails and not any("engine runs the trace" in c["name"] for c in fails), fails


def _long_request(srv, vocab: int, n: int = 1100) -> list[int]:
    """One greedy request of an n-token prompt (ids spread over the vocabulary) to a running server; its tokens."""
    from hybridqual.adapters.openai.client import parse_completion, request_json
    prompt = [(7 * i + 3) % vocab for i in range(n)]
    body = {"model": str(srv.model.resolve()), "prompt": prompt, "max_tokens": 2, "temperature": 0, "top_k": 1,
            "ignore_eos": True, "return_token_ids": True}
    return parse_completion(request_json(f"{srv.url}/v1/completions", body, timeout=600)).tokens


def test_finding_s4_default_server_engine_dies_on_a_long_prompt_of_a_hybrid_model(tmp_path):
    """Finding S4 (docs/findings.md, "vLLM as served"): vLLM turns prefix caching on by default for a hybrid
    Mamba2/attention model (Mamba cache mode 'align'); a 1100-token prompt then gets a prefill checkpoint, and the CPU
    SSD kernel, which returns only final states, is indexed by chunk (mamba_mixer2.py:880): IndexError, the engine
    dead (HTTP 500). The same request with --no-enable-prefix-caching gives the oracle's tokens."""
    import oracle
    from hybridqual.adapters.openai.client import ServerError
    from hybridqual.adapters.vllm.server import LaunchSettings, VLLMServer
    model = ROOT / "goldens" / "models" / "zoo-granite_hd32"
    om = oracle.load(model)
    vocab = om.config.vocab_size
    settings = LaunchSettings(python=VENV_PY, ready_timeout=900)
    srv = VLLMServer(model, (), settings, tmp_path / "default.log")
    srv.start()
    try:
        with pytest.raises(ServerError, match="HTTP 500"):
            _long_request(srv, vocab)
        log = (tmp_path / "default.log").read_text()
        assert "Mamba cache mode is set to 'align'" in log
        assert "mamba_mixer2.py\", line 880" in log and "is out of bounds for dimension 0" in log
    finally:
        srv.stop()
    srv = VLLMServer(model, ("--no-enable-prefix-caching",), settings, tmp_path / "off.log")
    srv.start()
    try:
        got = _long_request(srv, vocab)
    finally:
        srv.stop()
    assert got == om.generate_greedy([(7 * i + 3) % vocab for i in range(1100)], 2)


def test_finding_s5_ngram_on_a_default_server_of_a_hybrid_kills_the_engine(tmp_path):
    """Finding S5 (docs/findings.md, "vLLM as served"): ngram speculation with vLLM's default prefix caching (Mamba
    cache mode 'align') on zoo-granite_hd32: the first request gets HTTP 500, the worker having called the Triton
    kernel precopy_mamba_align_fused_kernel, which this CPU build cannot launch (v1/worker/mamba_utils.py:1226)."""
    from hybridqual.adapters.openai.client import ServerError
    from hybridqual.adapters.vllm.server import LaunchSettings, VLLMServer
    model = ROOT / "goldens" / "models" / "zoo-granite_hd32"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    srv = VLLMServer(model, ("--speculative-config", spec), LaunchSettings(python=VENV_PY, ready_timeout=900),
                     tmp_path / "ngram.log")
    srv.start()
    try:
        with pytest.raises(ServerError, match="HTTP 500"):
            _long_request(srv, 64, n=8)
        log = (tmp_path / "ngram.log").read_text()
        assert "mamba_utils.py\", line 1226, in run_fused_precopy" in log
        assert "'function' object is not subscriptable" in log
    finally:
        srv.stop()
