"""`--engine openai --base-url URL [--served-model NAME]`: any OpenAI-compatible server behind the adapter protocol.

    hybridqual qualify --engine openai --base-url http://127.0.0.1:8080 --model zoo-bamba --trace seed_compaction

How a trace becomes requests. Each request is one non-streamed POST /v1/completions with the prompt as token ids
("prompt": [ids]), "max_tokens" = max_new_tokens, greedy ("temperature": 0, "top_k": 1, penalties off),
"logprobs" = min(top_logprobs, vocab) (default 20: vLLM's default --max-logprobs), "ignore_eos": true (the
trace's stop ids are the only stops) and "stop_token_ids" (vLLM, SGLang, TRT-LLM honour it; llama-server ignores it
and its "stop" takes strings only, so the output is also cut client-side after the first stop id, and the number of
tokens the server generated past it is recorded in the request's facts). Arrivals map to wall-clock time with a
fixed step period: the request with arrival_step a is sent at t0 + a · step, each on its own daemon thread, so
requests whose arrivals are close are in flight together. The step is the server's own
time per generated token, measured once per server by a probe completion (probe_tokens tokens, wall clock per
token, HTTP included), or the class attribute step_s when set; the report's facts give it and the most requests
that were in flight at once.

What this can check: every request's tokens against the fp64 truth (tie-aware, τ of the declared compute dtype),
the server's top-k logprobs against the oracle's rows (logprobs.py; the "server logprobs" line), its cached
prompt tokens within the prompt and (a server only this process talks to) within what it was ever sent, and its
speculative counts for consistency; not the trace's prefix-cache policy (a server's cache policy is its own).
What it cannot: there is no schedule log (batching, chunking and slot assignment are the
server's, and the trace's max_requests / max_tokens_per_step / prefill_chunk are not applied: the server runs with
its own limits, e.g. llama-server --parallel N), wall-clock arrivals are not steps (which requests share a batch
is not reproducible from run to run), one mode only (legacy), greedy only.

Failures, each named in the FAIL line: the server not reachable, a timeout (every request is bounded by
request_timeout, the whole trace by the last arrival + request_timeout), an HTTP error, a malformed answer (the JSON
path: a logprob not finite, a count out of range — usage.prompt_tokens not the prompt's length, cached tokens outside
the prompt, more tokens than max_tokens —, whether or not logprobs came), a wrong model (the name is not in
/v1/models, its n_vocab or root where reported is not the model's, or it returns a token id, sampled or among the
logprobs, outside the model's vocabulary), fewer logprobs than asked (the logprobs line), a launched server that
died (its exit and log tail, tools/adapters/vllm/server.py). The model is identified by what /v1/models reports
(n_vocab, root, max_model_len); what it does not report is said in the report as not confirmed. No id outside the
vocabulary is ever sent: a server may pad its embedding table and need not range-check ids (vLLM does neither check
without a tokenizer), so such a probe would fail a correct server or feed an unchecked one garbage.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridqual.adapters.base import DEFAULT_OPTIONS, Capabilities, EngineOptions, RunResult, TraceAdapter
from hybridqual.adapters.openai.client import (Completion, ServerError, check_answer, parse_completion, parse_models,
                                               request_json)

_NOTES = (
    ("seeded", "a server's seeded sampler is its own, not the trace's keyed (request seed, position) sampler, so "
               "seeded outputs have no common truth"),
    ("async", "a server has one scheduling mode; arrivals are wall-clock times, not steps"),
    ("schedule_log", "the server batches on its own and reports no DESIGN §4 schedule log (what it reports per "
                     "request is in the \"server logprobs\" line's facts)"),
    ("logits", "the server returns top-k logprobs, not whole logits rows; they are judged in the line "
               "\"server logprobs (top-k) agree with the oracle\" (tools/adapters/openai/logprobs.py)"),
    ("prefix_cache_reporting", "the server's cache policy (which blocks it keeps, when it hits) is its own, not "
                               "the trace's: its cached prompt tokens (usage.prompt_tokens_details.cached_tokens "
                               "or llama-server's timings.cache_n) are checked within the prompt and, for a server "
                               "qualify started, within what it was ever sent, and shown in the \"server "
                               "logprobs\" line's facts"),
    ("speculation_reporting", "servers report at most per-request draft counts (llama-server timings.draft_n / "
                              "draft_n_accepted), no proposals per step: shown in the server logprobs line"),
)



@dataclass(frozen=True)
class ServerSettings:
    """The OpenAI adapter's own settings (EngineOptions.settings; None: these defaults)."""
    step_s: float | None = None     # wall-clock seconds per trace step (arrival_step -> send time); None: measured
    probe_tokens: int = 8           # the probe completion whose time per generated token is the measured step
    request_timeout: float = 120.0  # seconds, per socket operation of a request and added to the trace's bound
    probe_timeout: float = 10.0
    top_logprobs: int = 20
    max_concurrency: int = 64
    dtype: torch.dtype | None = None    # the server's compute dtype if known (picks τ and c); None: float32
    extra_body: tuple[tuple[str, object], ...] = ()   # more request fields, (name, value) pairs


@dataclass(frozen=True)
class Probe:
    """What the probe of one (server, served name, vocabulary) found: the model name to send, the report's note
    on its identity and timing, the server's time per generated token, its max_model_len if reported."""
    name: str
    note: str
    step: float
    max_model_len: int | None


class Probes:
    """The probes made so far in this process, one per (base_url, served_model, vocab): a server is probed once
    per run, not once per instance; `clear()` forgets them (a test probing a server anew)."""

    def __init__(self) -> None:
        self._done: dict[tuple, Probe] = {}

    def get(self, key: tuple) -> Probe | None:
        return self._done.get(key)

    def remember(self, key: tuple, probe: Probe) -> Probe:
        self._done[key] = probe
        return probe

    def clear(self) -> None:
        self._done.clear()


PROBES = Probes()


class Seen:
    """The token sequences (prompt + output) sent to each server by this process, for the bound on what a server
    can have cached (`OpenAIServerAdapter._check_cached`); `clear()` forgets them."""

    def __init__(self) -> None:
        self._seqs: dict[str, set[tuple[int, ...]]] = {}

    def record(self, base_url: str, seq: tuple[int, ...]) -> None:
        self._seqs.setdefault(base_url, set()).add(tuple(seq))

    def longest_prefix(self, base_url: str, prompt: tuple[int, ...], more: list[tuple[int, ...]] = ()) -> int:
        """The longest prefix of `prompt` that a recorded sequence of `base_url` or one of `more` starts with."""
        best = 0
        for q in list(self._seqs.get(base_url, ())) + list(more):
            n = 0
            for a, b in zip(prompt, q):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def clear(self) -> None:
        self._seqs.clear()


SEEN = Seen()


def server_url(base_url: str | None, path: str) -> str:
    """`path` on the server at `base_url` (a base ending in /v1 is not doubled)."""
    base = (base_url or "").rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]
    return base + path


def settings_of(options: EngineOptions) -> ServerSettings:
    """The adapter's settings in `options` (the defaults when none)."""
    if options.settings is None:
        return ServerSettings()
    if not isinstance(options.settings, ServerSettings):
        raise TypeError(f"EngineOptions.settings: the OpenAI adapter takes a ServerSettings, got "
                        f"{type(options.settings).__name__}")
    return options.settings


@dataclass
class ServerRunResult(RunResult):
    """RunResult plus what the server returned per request: logprobs rows, and problems found while reading them."""
    logprobs: dict[str, list[dict[int, float]] | None] = field(default_factory=dict)
    sampled_logprobs: dict[str, list[float | None] | None] = field(default_factory=dict)
    logprobs_notes: dict[str, str] = field(default_factory=dict)
    asked_logprobs: int = 0
    probe: str = ""


class OpenAIServerAdapter(TraceAdapter):
    """A running OpenAI-compatible server (/v1/models, /v1/completions); see the module docstring. Options:
    `base_url` (required), `served_model`, `settings` (a ServerSettings)."""
    OPTIONS = ("base_url", "served_model", "settings")
    probes = PROBES
    seen = SEEN
    seen_is_whole = False         # True: only this process talks to the server (a launched one), so SEEN is all
                                  # it was sent and bounds its cached tokens

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = DEFAULT_OPTIONS) -> Capabilities:
        return Capabilities(("greedy",), ("legacy",), compute_dtype=settings_of(options).dtype, notes=_NOTES)

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        where = options.base_url or "(no --base-url)"
        extra = ""
        if options.base_url:
            for path in ("/version", "/props"):
                try:
                    v = request_json(server_url(options.base_url, path), timeout=3)
                except ServerError:
                    continue
                if isinstance(v, dict):
                    got = v.get("version") or v.get("build_info")
                    if isinstance(got, str):
                        extra = f"; server {got}"
                        break
        return (f"OpenAI-compatible server at {where} (model {options.served_model or 'the one it serves'}{extra}); "
                "hybridqual.adapters.openai")

    def _url(self, path: str) -> str:
        return server_url(self.base_url, path)

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        super().__init__(model_path, trace, mode, device, options)
        self.base_url, self.served_model, self.settings = options.base_url, options.served_model, settings_of(options)
        if not self.base_url:
            raise ServerError("--engine openai needs --base-url URL (the server's address, e.g. http://127.0.0.1:8080)")
        from oracle.config import from_hf_config
        self.vocab = from_hf_config(Path(model_path) / "config.json").vocab_size
        probe = self._probe()
        self.model_name, self.probe_note, mml = probe.name, probe.note, probe.max_model_len
        self.step = self.settings.step_s if self.settings.step_s is not None else probe.step
        longest = max((len(r.prompt) + r.max_new_tokens for r in trace.requests), default=0)
        if mml is not None and longest > mml:
            raise ServerError(f"the server's {self.model_name!r} has max_model_len {mml} (/v1/models), below this "
                              f"trace's longest request ({longest} tokens): start it with a longer context")

    def _probe(self) -> Probe:
        """The model name to send and what identifies it, checked once per (server, name, vocab): it is served, its
        n_vocab (llama-server) or its root (vLLM: the weights' folder) is the model's where the server reports
        them, and what could not be confirmed is said; and the server's time per generated token (one probe
        completion of probe_tokens tokens, wall clock / tokens). No id outside the model's vocabulary is ever sent:
        a server may pad its embedding table and need not range-check ids (vLLM without a tokenizer)."""
        key = (self.base_url, self.served_model, self.vocab)
        if self.probes.get(key) is not None:
            return self.probes.get(key)
        info = parse_models(request_json(self._url("/v1/models"), timeout=self.settings.probe_timeout))
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
        note = f"model {name!r}" + "".join(f", {part}" for part in self._identity(info, name))
        t = time.monotonic()
        got = self._post({"prompt": [self.vocab - 1], "max_tokens": self.settings.probe_tokens, "logprobs": 1}, name,
                         "timing probe")
        check_answer(got, 1, self.settings.probe_tokens, self.vocab, "timing probe")
        self.seen.record(self.base_url, (self.vocab - 1, *got.tokens))
        step = (time.monotonic() - t) / max(1, len(got.tokens))
        note += f", {step * 1e3:.2f} ms per generated token (probe)"
        return self.probes.remember(key, Probe(name, note, step, info.max_model_len.get(name)))

    def _identity(self, info, name: str) -> list[str]:
        """What /v1/models confirms about the served model (a ServerError when it contradicts --model), and what it
        leaves unconfirmed, as report phrases."""
        parts = []
        nv = info.n_vocab.get(name)
        if nv is not None:
            if nv != self.vocab:
                raise ServerError(f"wrong model: the server's {name!r} has n_vocab {nv} (/v1/models), the model "
                                  f"{self.model_path.name} has {self.vocab}")
            parts.append(f"n_vocab {nv} (/v1/models)")
        else:
            parts.append("vocabulary size not reported: not confirmed (every returned id is checked against "
                         f"the model's {self.vocab})")
        root = info.root.get(name)
        if root is not None:
            parts.append(self._root_note(name, root))
        elif nv is None:
            parts.append("no root reported: the weights it serves are not confirmed")
        if name in info.max_model_len:
            parts.append(f"max_model_len {info.max_model_len[name]}")
        return parts

    def _root_note(self, name: str, root: str) -> str:
        """The server's root (the folder it loaded) against --model: the same folder, or one with the same
        config.json and weights files (sha256), else a wrong model; a root that is no folder here is unconfirmed."""
        here, there = self.model_path.resolve(), Path(root).expanduser()
        if not there.is_absolute():
            there = Path.cwd() / there
        if not there.is_dir():
            return f"root {root!r} is not a folder here: the weights it serves are not confirmed"
        if there.resolve() == here:
            return f"root {root!r} is the --model folder"
        differ = [f for f in ["config.json", *sorted(p.name for p in here.glob("*.safetensors"))]
                  if _sha256(here / f) != _sha256(there / f)]
        if differ:
            raise ServerError(f"wrong model: the server's {name!r} loaded {root}, whose {differ[0]} differs from "
                              f"the model {self.model_path}'s")
        return f"root {root!r}: config.json and weights identical to --model's (sha256)"

    def _post(self, body: dict, model: str | None = None, what: str = "") -> Completion:
        full = {"model": model or self.model_name, "temperature": 0, "top_k": 1, "top_p": 1.0, "n": 1,
                "stream": False, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0,
                "repetition_penalty": 1.0, "ignore_eos": True, "seed": 0, "return_token_ids": True,
                **dict(self.settings.extra_body), **body}
        try:
            return parse_completion(request_json(self._url("/v1/completions"), full,
                                                 timeout=self.settings.request_timeout))
        except ServerError as e:
            if what:
                raise ServerError(f"{what}: {e}") from None
            raise

    def asked_logprobs(self) -> int:
        return min(self.settings.top_logprobs, self.vocab)

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
        """Each request sent at its arrival time on a daemon thread of its own (at most max_concurrency in flight),
        the answers awaited within the last send + 2 · request_timeout + 5 s; the first error ends the run, named
        (with the server's own state when a launcher knows it: server_problem). Daemon threads: a run stopped by
        --timeout or a signal leaves no thread that keeps the process alive."""
        for r in self.trace.requests:
            if r.sampling.kind != "greedy":
                raise ValueError(f"request {r.id}: the server adapter runs greedy requests only")
        reqs = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        t0 = time.monotonic()
        answers: queue.Queue = queue.Queue()
        slots = threading.BoundedSemaphore(max(1, self.settings.max_concurrency))

        def send(r) -> None:
            with slots:
                try:
                    answers.put((r.id, self._one(r, t0), None))
                except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                    answers.put((r.id, None, e))
        got: dict[str, tuple[Completion, float, float]] = {}

        def collect(block_until: float | None) -> None:
            while len(got) < len(reqs):
                wait = None if block_until is None else block_until - time.monotonic()
                if wait is not None and wait <= 0:
                    return
                try:
                    rid, ans, err = answers.get(timeout=wait) if block_until is not None else answers.get_nowait()
                except queue.Empty:
                    return
                if err is not None:
                    raise self._named(err)
                got[rid] = ans
        for r in reqs:
            delay = t0 + r.arrival_step * self.step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            threading.Thread(target=send, args=(r,), name=f"hq-openai-{r.id}", daemon=True).start()
            collect(None)
        bound = self.settings.request_timeout * 2 + 5
        collect(time.monotonic() + bound)
        if len(got) < len(reqs):
            late = [r.id for r in reqs if r.id not in got]
            raise self._named(ServerError(f"timed out: requests {late} unanswered {bound:g} s after their last "
                                          "send"))
        return self._result(got)

    def server_problem(self) -> str | None:
        """What is known to be wrong with the server itself (a launcher's: it exited, with its log's tail), else
        None; prefixed to a failed request's error."""
        return None

    def _named(self, err: BaseException) -> BaseException:
        """A request's error, with the server's own state prefixed when it is known to be down."""
        problem = self.server_problem() if isinstance(err, ServerError) else None
        return ServerError(f"{problem}; {err}") if problem else err

    def _result(self, got: dict[str, tuple[Completion, float, float]]) -> ServerRunResult:
        res = ServerRunResult(tokens={}, asked_logprobs=self.asked_logprobs(), schedule_facts=[],
                              probe=f"{self.probe_note}; step period {self.step * 1e3:.2f} ms")
        order = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        for r in order:
            check_answer(got[r.id][0], len(r.prompt), r.max_new_tokens, self.vocab, f"request {r.id}")
        self._check_cached(got)
        for r in order:
            c, sent, done = got[r.id]
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
        return res

    def _check_cached(self, got: dict[str, tuple[Completion, float, float]]) -> None:
        """Each request's cached prompt tokens within what the server can have cached: with a server only this
        process talks to (seen_is_whole, a launched one), no more than the longest prefix its prompt shares with
        any sequence (prompt + output) sent to that server (earlier instances, the probe, this trace's other
        requests); a ServerError naming the request and field otherwise. Then this trace's sequences are recorded.
        The server's own cache policy (which blocks it keeps) is not judged: it is not the trace's policy."""
        seqs = {r.id: tuple(r.prompt) + tuple(got[r.id][0].tokens) for r in self.trace.requests}
        if self.seen_is_whole:
            for r in self.trace.requests:
                c = got[r.id][0]
                if c.cached_tokens is None:
                    continue
                others = [q for rid, q in seqs.items() if rid != r.id]
                bound = self.seen.longest_prefix(self.base_url, tuple(r.prompt), others)
                if c.cached_tokens > bound:
                    raise ServerError(f"malformed answer: request {r.id}: {c.cached_source} {c.cached_tokens}, "
                                      f"but the longest prefix of its prompt that this server was ever sent is "
                                      f"{bound} tokens: it cannot have cached more")
        for q in seqs.values():
            self.seen.record(self.base_url, q)

    @classmethod
    def facts_check(cls, ctx):
        """qualify's extra line: the server's top-k logprobs against the oracle (logprobs.py), with its per-request
        facts (arrival overlap, prompt/cached tokens, draft counts, stop cuts) checked for consistency."""
        from hybridqual.adapters.openai.report import logprobs_check
        return logprobs_check(ctx.engine, ctx.label, ctx.mode, ctx.trace, ctx.run, ctx.oracle_model)


def _sha256(path: Path) -> str | None:
    """A file's sha256, None when it is missing."""
    import hashlib
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dumps_facts(facts: list) -> str:
    """The per-request facts as one compact JSON line (for reports and tests)."""
    return json.dumps(facts, separators=(",", ":"))
