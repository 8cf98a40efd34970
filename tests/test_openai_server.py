"""The OpenAI-compatible server adapter (hybridqual.adapters.openai): its protocol and error paths against a fake
server (stdlib http.server on 127.0.0.1, answering from the fp64 oracle of tiny-sort; default CPU tier), and a real
llama-server started here on GGUFs of the shipped models (marker llamacpp; needs .venv-llamacpp)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import oracle
from oracle.trace import load_trace
from hybridqual.adapters import Engine, EngineOptions
from hybridqual.adapters.openai import OpenAIServerAdapter, ServerError
from hybridqual.adapters.openai.adapter import ServerSettings
from hybridqual.adapters.openai.report import logprobs_check

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "goldens" / "models" / "tiny-sort"
TRACES = ROOT / "goldens" / "traces"


# ------------------------------------------------------------------------------------------ the fake server

class Fake:
    """What the fake server does: serve the oracle (greedy, log-softmax logprobs) in llama-server's answer form or
    (flavour "vllm") vLLM's (token_ids, "token_id:N" keys, /v1/models root and max_model_len, a padded embedding
    table that accepts any prompt id), or misbehave as `mode` says."""

    def __init__(self) -> None:
        self.model = oracle.load(TINY)
        self.vocab = self.model.config.vocab_size
        self.mode = "good"
        self.flavour = "llama"
        self.root: str | None = None
        self.max_model_len: int | None = None
        self.n_vocab_reported: int | None = self.vocab
        self.sleep = 0.0
        self.sleep_requests = 0.0       # seconds each trace request (not the probe) waits before its answer
        self.arrivals: dict[tuple, float] = {}
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def complete(self, body: dict) -> dict:
        prompt, n, k = body["prompt"], body["max_tokens"], body.get("logprobs") or 0
        if any(t >= self.vocab for t in prompt) and self.flavour != "vllm":
            return {"error": {"code": 400, "message": "Prompt contains invalid tokens"}, "_status": 400}
        with self.lock:
            self.arrivals[tuple(prompt)] = time.monotonic() - self.t0
        toks, content, state = [], [], None
        logits, state = self.model.prefill([min(t, self.vocab - 1) for t in prompt])
        row = logits[-1]
        for i in range(n):
            if self.mode == "perturbed" and i == 0:
                row = row.clone()
                row[0] += 0.01
            lp = torch.log_softmax(row.double(), -1)
            t = int(torch.argmax(row))
            top = torch.topk(lp, min(k, self.vocab) if self.mode != "few_logprobs" else 3)
            content.append({"id": t, "logprob": float(lp[t]),
                            "top_logprobs": [{"id": int(j), "logprob": float(v)}
                                             for v, j in zip(top.values, top.indices)]})
            toks.append(t)
            row, state = self.model.decode(t, state)
        bad = self.mode if k > 1 else "good"         # the answer fields' faults: in the trace's requests only
        if bad == "nan_logprob":
            content[-1]["top_logprobs"][1]["logprob"] = float("nan")
        if bad == "id_outside_vocab":
            content[-1]["top_logprobs"].append({"id": self.vocab + 5, "logprob": -60.0})
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": len(prompt) + 1 if bad == "cached_over" else
                                           len(prompt) if bad == "cached_all" else 0}}
        if self.flavour == "vllm":
            return {"choices": [{"text": "", "index": 0, "finish_reason": "length", "token_ids": toks,
                                 "logprobs": None if self.mode == "no_logprobs" or not k else
                                 {"tokens": [f"token_id:{e['id']}" for e in content],
                                  "token_logprobs": [e["logprob"] for e in content],
                                  "top_logprobs": [{f"token_id:{t['id']}": t["logprob"] for t in e["top_logprobs"]}
                                                   for e in content]}}], "usage": usage}
        return {"choices": [{"text": "", "index": 0, "finish_reason": "length",
                             "logprobs": {"content": content} if k else None}], "usage": usage,
                "timings": {"cache_n": 0, "prompt_n": len(prompt), "draft_n": 4, "draft_n_accepted": 3}}


@pytest.fixture(scope="module")
def fake():
    state = Fake()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):          # quiet
            pass

        def reply(self, code: int, payload: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            try:
                self.wfile.write(payload)
            except BrokenPipeError:        # the client gave up (a timeout test): nothing to answer
                pass

        def do_GET(self):
            if self.path == "/v1/models":
                meta = {} if state.n_vocab_reported is None else {"meta": {"n_vocab": state.n_vocab_reported}}
                if state.root is not None:
                    meta["root"] = state.root
                if state.max_model_len is not None:
                    meta["max_model_len"] = state.max_model_len
                self.reply(200, json.dumps({"object": "list", "data": [{"id": "tiny", **meta}]}).encode())
            else:
                self.reply(404, b'{"error": "not found"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if state.sleep:
                time.sleep(state.sleep)
            end = time.monotonic() + state.sleep_requests * ((body.get("logprobs") or 0) > 1)
            while time.monotonic() < end and state.sleep_requests:       # a trace request's delay; ends at reset
                time.sleep(0.05)
            if state.mode == "malformed":
                self.reply(200, b"{not json")
                return
            ans = state.complete(body)
            self.reply(ans.pop("_status", 200), json.dumps(ans).encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = False      # server_close() joins the handlers: none is inside torch when the process exits
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    state.url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        yield state
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def fresh(fake):
    """The fake in its good mode, the adapter's probe cache cleared (each test probes anew)."""
    def reset():
        OpenAIServerAdapter.probes.clear()
        OpenAIServerAdapter.seen.clear()
        fake.mode, fake.n_vocab_reported, fake.sleep, fake.flavour = "good", fake.vocab, 0.0, "llama"
        fake.sleep_requests = 0.0
        fake.root = fake.max_model_len = None
    reset()
    yield fake
    reset()


def adapter_for(url: str, served_model: str | None = None, **settings) -> Engine:
    """The OpenAI adapter against `url` with these ServerSettings fields, as qualify builds it."""
    return Engine(OpenAIServerAdapter, EngineOptions(base_url=url, served_model=served_model,
                                                     settings=ServerSettings(**settings)))


def run(cls, trace_name: str = "seed_compaction"):
    trace = load_trace(TRACES / f"{trace_name}.json")
    return trace, cls(TINY, trace, "legacy").run_trace()


def test_fake_server_tokens_logprobs_and_arrivals(fresh):
    """Served by the oracle itself: the tokens are the oracle's greedy ones, the logprobs line passes, each
    request goes out inside its own step window [arrival_step × step_s, + step_s) and the server's draft counts
    are read. Never early is exact; the window is wide because a loaded 2-core machine delays a thread's start."""
    step = 0.25
    cls = adapter_for(fresh.url, step_s=step)
    trace, res = run(cls)
    for r in trace.requests:
        assert res.tokens[r.id] == fresh.model.generate_greedy(list(r.prompt), r.max_new_tokens), r.id
    c = logprobs_check(cls, "tiny-sort/seed_compaction", "legacy", trace, res, fresh.model)
    assert c.passed, c.detail
    assert "speculative: 15 of 20 drafted tokens accepted" in c.detail
    facts = {f["request"]: f for f in res.schedule_facts}
    for r in trace.requests:
        f = facts[r.id]
        assert f["due_s"] == round(step * r.arrival_step, 4), (r.id, f)
        assert f["due_s"] - 1e-4 <= f["sent_s"] < f["due_s"] + step, (r.id, f)
    assert "ms after their arrival time" in c.detail
    assert res.prefix_cache is None and all(f["cached_tokens"] == 0 for f in res.schedule_facts)


def test_fake_server_measured_step_and_stop_cut(fresh):
    """Without step_s the step is the probe's time per token; a server that generates past a stop id is cut
    client-side after it, and the facts say how many tokens it generated past."""
    trace = load_trace(TRACES / "seed_compaction.json")
    cls = adapter_for(fresh.url)
    a = cls(TINY, trace, "legacy")
    assert a.step > 0 and "per generated token (probe)" in a.probe_note
    import dataclasses
    r0 = trace.requests[0]
    full = fresh.model.generate_greedy(list(r0.prompt), r0.max_new_tokens)
    one = dataclasses.replace(trace, requests=(dataclasses.replace(r0, stop_token_ids=(full[1],)),))
    res = cls(TINY, one, "legacy").run_trace()
    want = full[:full.index(full[1]) + 1]
    assert res.tokens[r0.id] == want and res.finish_reasons[r0.id] == "stop"
    assert res.schedule_facts[0]["cut_after_stop"] == len(full) - len(want)


def test_fake_server_perturbed_logit_fails_logprobs(fresh):
    """One logit moved by 0.01 (the argmax kept): the logprobs line fails at that position."""
    fresh.mode = "perturbed"
    cls = adapter_for(fresh.url, step_s=0.0)
    trace, res = run(cls)
    c = logprobs_check(cls, "t", "legacy", trace, res, fresh.model)
    assert not c.passed and "least max|Δlogit|" in c.detail and "position 0" in c.detail


def test_unreachable_server_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed again on exit: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="not reachable"):
        run(adapter_for(f"http://127.0.0.1:{port}"))
    assert time.monotonic() - t0 < 10


def test_no_base_url_is_named():
    with pytest.raises(ServerError, match="needs --base-url"):
        run(OpenAIServerAdapter)


def test_wrong_model_name(fresh):
    with pytest.raises(ServerError, match=r"wrong model: .* serves \['tiny'\], not 'other'"):
        run(adapter_for(fresh.url, served_model="other"))


def test_wrong_vocab_reported(fresh):
    fresh.n_vocab_reported = 32
    with pytest.raises(ServerError, match="wrong model: .* n_vocab 32 .* has 16"):
        run(adapter_for(fresh.url))


def test_fewer_logprobs_than_asked(fresh):
    fresh.mode = "few_logprobs"
    cls = adapter_for(fresh.url, step_s=0.0)
    trace, res = run(cls)
    c = logprobs_check(cls, "t", "legacy", trace, res, fresh.model)
    assert not c.passed and "fewer logprobs than asked (3 of 16" in c.detail


def test_malformed_answer(fresh):
    fresh.mode = "malformed"
    with pytest.raises(ServerError, match="malformed answer, not JSON"):
        run(adapter_for(fresh.url))


def test_timeout_is_bounded(fresh):
    fresh.sleep = 1.5
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="timed out after 0.3 s"):
        run(adapter_for(fresh.url, request_timeout=0.3, probe_timeout=0.3))
    assert time.monotonic() - t0 < 5


def test_parse_openai_form_with_token_id_keys():
    """vLLM's OpenAI form (--return-tokens-as-token-ids, return_token_ids) parses to the same ids and rows."""
    from hybridqual.adapters.openai.client import parse_completion
    ans = {"choices": [{"text": "", "finish_reason": "length", "token_ids": [3, 4],
                        "logprobs": {"tokens": ["token_id:3", "token_id:4"], "token_logprobs": [-0.1, -0.2],
                                     "top_logprobs": [{"token_id:3": -0.1, "token_id:5": -2.0},
                                                      {"token_id:4": -0.2, "token_id:1": -3.0}]}}],
           "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}}}
    c = parse_completion(ans)
    assert c.tokens == [3, 4] and c.logprobs == [{3: -0.1, 5: -2.0}, {4: -0.2, 1: -3.0}]
    assert c.cached_tokens == 2 and c.cached_source == "usage.prompt_tokens_details.cached_tokens"
    text = json.loads(json.dumps(ans))
    text["choices"][0]["logprobs"]["top_logprobs"][0] = {"a": -0.1}
    c = parse_completion(text)
    assert c.logprobs is None and "by text, not id" in c.logprobs_note
    with pytest.raises(ServerError, match=r"choices\[0\].token_ids\[1\]"):
        parse_completion({"choices": [{"token_ids": [1, "x"]}]})


def test_qualify_cli_against_fake_server(fresh, tmp_path, capsys):
    """The whole path: `hybridqual qualify --engine openai --base-url URL` on a trace, served by the oracle."""
    from hybridqual.qualify import runner
    rc = runner.main(["--engine", "openai", "--base-url", fresh.url, "--served-model", "tiny", "--model", str(TINY),
                      "--trace", str(TRACES / "seed_compaction.json"), "--mode", "legacy", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS  legacy: tokens match the truth" in out and "PASS  legacy: server logprobs (top-k)" in out
    assert "SKIP  legacy: schedule log" in out


def test_qualify_cli_unreachable_is_a_fail_line(tmp_path, capsys):
    OpenAIServerAdapter.probes.clear()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from hybridqual.qualify import runner
    rc = runner.main(["--engine", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", str(TINY),
                      "--trace", str(TRACES / "seed_compaction.json"), "--mode", "legacy", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL  legacy: engine runs the trace: ServerError:" in out and "not reachable" in out


# ------------------------------------------------------------------------------------------ a real llama-server

VENV = ROOT / ".venv-llamacpp"
SERVER = VENV / "build" / "bin" / "llama-server"
MUTANT = ROOT / ".venv-llamacpp-mutant" / "build" / "bin" / "llama-server"


def gguf(model: str, cache: Path) -> Path:
    """The f32 GGUF of a shipped model, converted once per test run (convert.py's mapping and check)."""
    from hybridqual.adapters.llamacpp.convert import convert
    out = cache / f"{model}.f32.gguf"
    if not out.exists():
        convert(ROOT / "goldens" / "models" / model, out, "f32")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on 127.0.0.1 (f32 KV cache, 1 thread, cache_prompt on), stopped by close()."""

    def __init__(self, binary: Path, model: Path, parallel: int = 3, draft: Path | None = None,
                 log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(parallel),
               "-c", str(512 * parallel), "-t", "1", "-ctk", "f32", "-ctv", "f32", "--no-webui", "--cache-prompt",
               "-a", model.stem]
        if draft is not None:
            cmd += ["-md", str(draft), "--spec-draft-n-max", "3", "-ctkd", "f32", "-ctvd", "f32"]
        self.log = open(log or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        from hybridqual.adapters.openai.client import request_json
        while True:
            try:
                if request_json(f"{self.url}/health", timeout=2).get("status") == "ok":
                    return
            except ServerError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not come up (exit {self.proc.returncode})")
            time.sleep(0.3)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


needs_server = pytest.mark.skipif(not SERVER.exists(), reason=f"{SERVER} missing (run scripts/install-llamacpp.sh)")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    if not SERVER.exists():
        pytest.skip(f"{SERVER} missing (run scripts/install-llamacpp.sh)")
    return tmp_path_factory.mktemp("gguf")


def qualify(url: str, model: str, traces: list[str], out: Path) -> dict:
    """`hybridqual qualify --engine openai --base-url URL` in a subprocess (bounded); {check name: status,...}."""
    OpenAIServerAdapter.probes.clear()
    cmd = ["nice", "-n", "10", "python", "-m", "hybridqual.qualify", "--engine", "openai", "--base-url", url,
           "--model", model, "--trace", *traces, "--mode", "legacy", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    rep = json.loads((out / "report.json").read_text())
    return {f"{c['trace']}: {c['name'].split(' (')[0]}": (c["status"], c["detail"]) for c in rep["checks"]}


@pytest.mark.llamacpp
@needs_server
@pytest.mark.parametrize("model", ["zoo-granitemoehybrid", "zoo-mamba2"])
def test_llama_server_qualifies(model, ggufs, tmp_path):
    """llama-server --parallel 3 on a model that converts faithfully: seed_compaction's and chunked_prefill's
    tokens are the truth's (concurrent requests), and the logprobs are read and judged."""
    srv = LlamaServer(SERVER, gguf(model, ggufs), log=tmp_path / "server.log")
    try:
        got = qualify(srv.url, model, ["seed_compaction", "chunked_prefill"], tmp_path / "q")
    finally:
        srv.close()
    for t in ("seed_compaction", "chunked_prefill"):
        status, detail = got[f"{model}/{t}: legacy: tokens match the truth"]
        assert status == "PASS", detail
        assert f"{model}/{t}: legacy: server logprobs" in got


@pytest.mark.llamacpp
@needs_server
def test_llama_server_finding_granite_decode(ggufs, tmp_path):
    """Finding (docs/findings.md, "llama.cpp server"): zoo-granitemoehybrid, task_staggered request q1 alone
    (no cache, no concurrency): the first token matches (least max|Δlogit| ~2.6e-4), the second is 58 where the
    oracle's is 6 (oracle margin 4.2e-3 > τ), the server's logprobs 0.1 off the oracle's row there."""
    from hybridqual.adapters.openai.client import parse_completion, request_json
    srv = LlamaServer(SERVER, gguf("zoo-granitemoehybrid", ggufs), parallel=1, log=tmp_path / "server.log")
    try:
        r = load_trace(TRACES / "task_staggered.json").request("q1")
        c = parse_completion(request_json(f"{srv.url}/v1/completions",
                                          {"prompt": list(r.prompt), "max_tokens": 2, "temperature": 0, "top_k": 1,
                                           "logprobs": 1, "ignore_eos": True, "cache_prompt": False}, timeout=60))
    finally:
        srv.close()
    m = oracle.load(ROOT / "goldens" / "models" / "zoo-granitemoehybrid")
    assert m.generate_greedy(list(r.prompt), 2) == [37, 6]
    assert c.tokens == [37, 58]


@pytest.mark.llamacpp
@needs_server
def test_llama_server_partial_rope_conversion_fails(ggufs, tmp_path):
    """tiny-sort converts with the partial-RoPE known divergence (convert.known_divergences): the server path
    FAILs it (tokens and logprobs), never a pass."""
    srv = LlamaServer(SERVER, gguf("tiny-sort", ggufs), log=tmp_path / "server.log")
    try:
        got = qualify(srv.url, "tiny-sort", ["seed_compaction"], tmp_path / "q")
    finally:
        srv.close()
    assert got["tiny-sort/seed_compaction: legacy: tokens match the truth"][0] == "FAIL"
    assert got["tiny-sort/seed_compaction: legacy: server logprobs"][0] == "FAIL"


@pytest.mark.llamacpp
@needs_server
def test_llama_server_with_draft_model(ggufs, tmp_path):
    """-md (the model as its own draft): the tokens are the truth's. Measured at llama.cpp 0c1e57098: the draft loads
    but no answer carries timings.draft_n (no drafting seen with logprobs on; docs/findings.md), so the facts show
    speculation only where the server reports it, and then consistently (report.fact_problems)."""
    g = gguf("zoo-mamba2", ggufs)
    srv = LlamaServer(SERVER, g, draft=g, log=tmp_path / "server.log")
    try:
        got = qualify(srv.url, "zoo-mamba2", ["seed_compaction"], tmp_path / "q")
    finally:
        srv.close()
    status, detail = got["zoo-mamba2/seed_compaction: legacy: tokens match the truth"]
    assert status == "PASS", detail
    status, lp = got["zoo-mamba2/seed_compaction: legacy: server logprobs"]
    assert status == "PASS", lp
    assert "speculative:" not in lp or "drafted tokens accepted" in lp, lp


@pytest.mark.llamacpp
@pytest.mark.skipif(not MUTANT.exists(), reason=f"no mutated llama-server at {MUTANT} (the in-process adapter's "
                                                "patched build makes it)")
def test_mutant_llama_server_is_caught(ggufs, tmp_path):
    srv = LlamaServer(MUTANT, gguf("zoo-mamba2", ggufs), log=tmp_path / "server.log")
    try:
        got = qualify(srv.url, "zoo-mamba2", ["seed_compaction", "chunked_prefill", "task_staggered"], tmp_path / "q")
    finally:
        srv.close()
    assert any(s == "FAIL" for s, _ in got.values()), got
