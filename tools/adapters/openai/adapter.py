"""`--engine openai --base-url URL [--served-model NAME]`: any OpenAI-compatible server behind the adapter protocol.

    hybridqual qualify --engine openai --base-url http://127.0.0.1:8080 --model zoo-bamba --trace seed_compaction

How a trace becomes requests. Each request is one non-streamed POST /v1/completions with the prompt as token ids
("prompt": [ids]), "max_tokens" = max_new_tokens, greedy ("temperature": 0, "top_k": 1, penalties off),
"logprobs" = min(top_logprobs, vocab) (default 20: vLLM's default --max-logprobs), "ignore_eos": true (the
trace's stop ids are the only stops) and "stop_token_ids" (vLLM, SGLang, TRT-LLM honour it; llama-server ignores it
and its "stop" takes strings only, so the output is also cut client-side after the first stop id, and the number of
tokens the server generated past it is recorded in the request's facts). Arrivals map to wall-clock time with a
fixed step period: the request with arrival_step a is sent at t0 + a · step, each on its own thread
(concurrent.futures), so requests whose arrivals are close are in flight together. The step is the server's own
time per generated token, measured once per server by a probe completion (probe_tokens tokens, wall clock per
token, HTTP included), or the class attribute step_s when set; the report's facts give it and the most requests
that were in flight at once.

What this can check: every request's tokens against the fp64 truth (tie-aware, τ of the declared compute dtype),
the server's top-k logprobs against the oracle's rows (logprobs.py; the "server logprobs" line), its cached
prompt tokens against the trace's prefix-cache policy where the server reports them, and its speculative counts
for consistency. What it cannot: there is no schedule log (batching, chunking and slot assignment are the
server's, and the trace's max_requests / max_tokens_per_step / prefill_chunk are not applied: the server runs with
its own limits, e.g. llama-server --parallel N), wall-clock arrivals are not steps (which requests share a batch
is not reproducible from run to run), one mode only (legacy), greedy only.

Failures, each named in the FAIL line: the server not reachable, a timeout (every request is bounded by
request_timeout, the whole trace by the last arrival + request_timeout), an HTTP error, a malformed answer (the JSON
path), a wrong model (the name is not in /v1/models, its n_vocab where reported is not the model's, it accepts a
token id the model cannot have, or it returns one), fewer logprobs than asked (the logprobs line).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridqual.adapters.base import Adapter, Capabilities, RunResult
from hybridqual.adapters.openai.client import Completion, ServerError, parse_completion, parse_models, request_json

_NOTES = (
    ("seeded", "a server's seeded sampler is its own, not the trace's keyed (request seed, position) sampler, so "
               "seeded outputs have no common truth"),
    ("async", "a server has one scheduling mode; arrivals are wall-clock times, not steps"),
    ("schedule_log", "the server batches on its own and reports no DESIGN §4 schedule log (what it reports per "
                     "request is in the \"server logprobs\" line's facts)"),
    ("logits", "the server returns top-k logprobs, not whole logits rows; they are judged in the line "
               "\"server logprobs (top-k) agree with the oracle\" (tools/adapters/openai/logprobs.py)"),
    ("prefix_cache_reporting", "reported only when the server returns cached prompt tokens "
                               "(usage.prompt_tokens_details.cached_tokens or llama-server's timings.cache_n), "
                               "admissions only (no stores/evictions); the server's cache policy is its own"),
    ("speculation_reporting", "servers report at most per-request draft counts (llama-server timings.draft_n / "
                              "draft_n_accepted), no proposals per step: shown in the server logprobs line"),
)

_PROBED: dict[tuple, tuple[str, str, float]] = {}   # (base_url, served_model, vocab) -> (name, note, s per token)


@dataclass
class ServerRunResult(RunResult):
    """RunResult plus what the server returned per request: logprobs rows, and problems found while reading them."""
    logprobs: dict[str, list[dict[int, float]] | None] = field(default_factory=dict)
    sampled_logprobs: dict[str, list[float | None] | None] = field(default_factory=dict)
    logprobs_notes: dict[str, str] = field(default_factory=dict)
    asked_logprobs: int = 0
    probe: str = ""


class OpenAIServerAdapter(Adapter):
    """A running OpenAI-compatible server (/v1/models, /v1/completions); see the module docstring."""
    base_url: str | None = None
    served_model: str | None = None
    step_s: float | None = None   # wall-clock seconds per trace step (arrival_step -> send time); None: measured
    probe_tokens = 8              # the probe completion whose time per generated token is the measured step
    request_timeout = 120.0       # seconds, per socket operation of a request and added to the trace's bound
    probe_timeout = 10.0
    top_logprobs = 20
    max_concurrency = 64
    dtype: torch.dtype | None = None      # the server's compute dtype if known (picks τ and c); None: float32
    probe_vocab = True            # a token id >= vocab must be refused (a server serving a bigger model accepts it)
    extra_body: dict = {}

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        return Capabilities(("greedy",), ("legacy",), compute_dtype=cls.dtype, notes=_NOTES)

    @classmethod
    def version(cls) -> str:
        where = cls.base_url or "(no --base-url)"
        extra = ""
        if cls.base_url:
            for path in ("/version", "/props"):
                try:
                    v = request_json(cls._url(path), timeout=3)
                except ServerError:
                    continue
                if isinstance(v, dict):
                    got = v.get("version") or v.get("build_info")
                    if isinstance(got, str):
                        extra = f"; server {got}"
                        break
        return (f"OpenAI-compatible server at {where} (model {cls.served_model or 'the one it serves'}{extra}); "
                "hybridqual.adapters.openai")

    @classmethod
    def _url(cls, path: str) -> str:
        base = (cls.base_url or "").rstrip("/")
        if base.endswith("/v1") and path.startswith("/v1/"):
            base = base[:-3]
        return base + path

    def __init__(self, model_path, trace, mode, device="cpu"):
        super().__init__(model_path, trace, mode, device)
        if not self.base_url:
            raise ServerError("--engine openai needs --base-url URL (the server's address, e.g. http://127.0.0.1:8080)")
        from oracle.config import from_hf_config
        self.vocab = from_hf_config(Path(model_path) / "config.json").vocab_size
        self.model_name, self.probe_note, measured = self._probe()
        self.step = self.step_s if self.step_s is not None else measured

    def _probe(self) -> tuple[str, str, float]:
        """The model name to send, checked once per (server, name, vocab): it is served, and its vocabulary is the
        model's (n_vocab where /v1/models reports it; else token id vocab-1 accepted and vocab refused); and the
        server's time per generated token (one probe completion of probe_tokens tokens, wall clock / tokens)."""
        key = (self.base_url, self.served_model, self.vocab)
        if key in _PROBED:
            return _PROBED[key]
        info = parse_models(request_json(self._url("/v1/models"), timeout=self.probe_timeout))
        if self.served_model is not None:
            if self.served_model not in info.ids:
                raise ServerError(f"wrong model: the server at {self.base_url} serves {info.ids}, not "
                                  f"{self.served_model!r} (--served-model)")
            name = self.served_model
        elif len(info.entries) == 1:
            name = info.entries[0]
        elif not info.entries:
            raise ServerError(f"the server at {self.base_url} lists no model in /v1/models")
        else:
            raise ServerError(f"the server at {self.base_url} serves several models {info.entries}: name one with "
                              "--served-model")
        note = f"model {name!r}"
        nv = info.n_vocab.get(name)
        if nv is not None:
            if nv != self.vocab:
                raise ServerError(f"wrong model: the server's {name!r} has n_vocab {nv} (/v1/models), the model "
                                  f"{self.model_path.name} has {self.vocab}")
            note += f", n_vocab {nv} (/v1/models)"
        elif self.probe_vocab:
            self._post({"prompt": [self.vocab - 1], "max_tokens": 1, "logprobs": 1}, name, "vocab probe")
            try:
                self._post({"prompt": [self.vocab], "max_tokens": 1, "logprobs": 1}, name, "vocab probe")
            except ServerError as e:
                if "HTTP 4" not in str(e) and "HTTP 5" not in str(e):
                    raise
            else:
                raise ServerError(f"wrong model: the server's {name!r} accepts token id {self.vocab}, which the model "
                                  f"{self.model_path.name} (vocab {self.vocab}) cannot have")
            note += f", token id {self.vocab - 1} accepted and {self.vocab} refused"
        t = time.monotonic()
        got = self._post({"prompt": [self.vocab - 1], "max_tokens": self.probe_tokens, "logprobs": 1}, name,
                         "timing probe")
        step = (time.monotonic() - t) / max(1, len(got.tokens))
        note += f", {step * 1e3:.2f} ms per generated token (probe)"
        _PROBED[key] = (name, note, step)
        return _PROBED[key]

    def _post(self, body: dict, model: str | None = None, what: str = "") -> Completion:
        full = {"model": model or self.model_name, "temperature": 0, "top_k": 1, "top_p": 1.0, "n": 1,
                "stream": False, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0,
                "repetition_penalty": 1.0, "ignore_eos": True, "seed": 0, "return_token_ids": True,
                **self.extra_body, **body}
        try:
            return parse_completion(request_json(self._url("/v1/completions"), full, timeout=self.request_timeout))
        except ServerError as e:
            if what:
                raise ServerError(f"{what}: {e}") from None
            raise

    def asked_logprobs(self) -> int:
        return min(self.top_logprobs, self.vocab)

    def _one(self, req, t0: float) -> tuple[Completion, float, float]:
        body = {"prompt": list(req.prompt), "max_tokens": req.max_new_tokens, "logprobs": self.asked_logprobs()}
        if req.stop_token_ids:
            body["stop_token_ids"] = list(req.stop_token_ids)
        sent = time.monotonic() - t0
        try:
            c = self._post(body)
        except ServerError as e:
            raise ServerError(f"request {req.id}: {e}") from None
        return c, sent, time.monotonic() - t0

    def run_trace(self) -> ServerRunResult:
        for r in self.trace.requests:
            if r.sampling.kind != "greedy":
                raise ValueError(f"request {r.id}: the server adapter runs greedy requests only")
        reqs = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        t0 = time.monotonic()
        pool = cf.ThreadPoolExecutor(max_workers=max(1, min(len(reqs), self.max_concurrency)),
                                     thread_name_prefix="hq-openai")
        futs = {}
        try:
            for r in reqs:
                delay = t0 + r.arrival_step * self.step - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                futs[r.id] = pool.submit(self._one, r, t0)
                bad = [f for f in futs.values() if f.done() and f.exception() is not None]
                if bad:
                    raise bad[0].exception()
            bound = self.request_timeout * 2 + 5
            done, pending = cf.wait(list(futs.values()), timeout=bound, return_when=cf.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
            if pending:
                late = [rid for rid, f in futs.items() if f in pending]
                raise ServerError(f"timed out: requests {late} unanswered {bound:g} s after their last send")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return self._result({rid: f.result() for rid, f in futs.items()})

    def _result(self, got: dict[str, tuple[Completion, float, float]]) -> ServerRunResult:
        res = ServerRunResult(tokens={}, asked_logprobs=self.asked_logprobs(), schedule_facts=[],
                              probe=f"{self.probe_note}; step period {self.step * 1e3:.2f} ms")
        admit = []
        cached_known = True
        order = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        for r in order:
            c, sent, done = got[r.id]
            bad = [t for t in c.tokens if not 0 <= t < self.vocab]
            if bad:
                raise ServerError(f"wrong model: request {r.id}: the server returned token id {bad[0]}, outside the "
                                  f"model's vocabulary of {self.vocab}")
            if len(c.tokens) > r.max_new_tokens:
                raise ServerError(f"malformed answer: request {r.id}: {len(c.tokens)} tokens for max_tokens "
                                  f"{r.max_new_tokens}")
            toks, rows, lps = list(c.tokens), c.logprobs, c.sampled_logprob
            stops = set(r.stop_token_ids)
            cut = 0
            first = next((i for i, t in enumerate(toks) if t in stops), None)
            if first is not None and first + 1 < len(toks):
                cut = len(toks) - first - 1
                toks = toks[:first + 1]
                rows = rows[:first + 1] if rows is not None else None
                lps = lps[:first + 1] if lps is not None else None
            res.tokens[r.id] = toks
            res.finish_reasons[r.id] = "stop" if toks and toks[-1] in stops else "length"
            res.logprobs[r.id], res.sampled_logprobs[r.id] = rows, lps
            if c.logprobs_note:
                res.logprobs_notes[r.id] = c.logprobs_note
            fact = {"request": r.id, "arrival_step": r.arrival_step, "due_s": round(r.arrival_step * self.step, 4),
                    "sent_s": round(sent, 4),
                    "done_s": round(done, 4), "server_finish_reason": c.finish_reason,
                    "server_tokens": len(c.tokens), "cut_after_stop": cut, "prompt_tokens": c.prompt_tokens,
                    "cached_tokens": c.cached_tokens, "cached_source": c.cached_source}
            if c.draft_n is not None:
                fact.update(draft_n=c.draft_n, draft_n_accepted=c.draft_n_accepted)
            res.schedule_facts.append(fact)
            if c.cached_tokens is None:
                cached_known = False
            admit.append({"request": r.id, "cached_tokens": c.cached_tokens})
        if cached_known and admit:
            res.prefix_cache = {"admit": admit}
        return res

    @classmethod
    def facts_check(cls, label: str, mode: str, trace, run, oracle_model=None):
        """qualify's extra line: the server's top-k logprobs against the oracle (logprobs.py), with its per-request
        facts (arrival overlap, prompt/cached tokens, draft counts, stop cuts) checked for consistency."""
        from hybridqual.adapters.openai.report import logprobs_check
        return logprobs_check(cls, label, mode, trace, run, oracle_model)

    def add_request(self, request) -> None:      # run_trace is overridden: requests go out by wall-clock arrival
        raise NotImplementedError("OpenAIServerAdapter runs whole traces (run_trace)")

    def step(self):
        raise NotImplementedError("OpenAIServerAdapter runs whole traces (run_trace)")

    def done(self) -> bool:
        return True


def dumps_facts(facts: list) -> str:
    """The per-request facts as one compact JSON line (for reports and tests)."""
    return json.dumps(facts, separators=(",", ":"))
