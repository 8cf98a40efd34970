"""`--engine hybridqual.adapters.llamacpp.adapter:LlamaCppAdapter`: llama.cpp through its low-level C API.

The model folder is converted to GGUF once (convert.py; cached under .venv-llamacpp/gguf-cache/, keyed by the
folder's config, weight files, the output type and the llama.cpp commit), or a ready GGUF is named by
$HQ_LLAMACPP_GGUF. The engine runs in a worker process of the llama venv (worker.py, JSON lines over pipes): a
GGML_ASSERT abort or a hang there is a WorkerError naming what happened (exit signal, timeout, the worker's last
log lines), never the qualifier's own crash. The trace runs as llama.cpp's continuous batching under the legacy
steps of docs/scheduler.md: one seq id per running request (the lowest free one, reused after a finish), joins at
arrival_step, rows compacted after finishes, prompts in pieces (the oracle's piece_length, whole model chunks) inside
max_tokens_per_step after the decode rows; greedy from the float32 logits with the lowest index on ties (the
oracle's rule); the logits row of every generated position comes back. A trace's `prefix_cache` (DESIGN §12) runs
on llama.cpp's own sequence-state snapshots (llama_state_seq_get_data / set_data, worker.Checkpoints): a snapshot
at every block boundary a prompt piece passes, restored into the admitted request's seq id on a hit so only the
suffix is prefilled; the hits, stores and evictions come back as RunResult.prefix_cache. A trace's `speculative`
(DESIGN §13: scripted, ngram, or a draft model converted as the target is; backoff) is verified in llama.cpp's
batches (worker.py, speculation.py); the per-request counts come back as schedule_facts, checked by `facts_check`.
Both at once (DESIGN §17, `store_decoded`): a decode or verify row's sequence is snapshotted at every generated-token
boundary it feeds, and only those its step proves verified are filed (checkpoints.py). $HQ_LLAMACPP_LIB (or a
subclass's `lib_path`, e.g. mutant.LlamaCppMutantAdapter) makes the worker load libllama from another build directory.
A trace's `transfer`s (DESIGN §19) run on one llama.cpp context per engine instance over the same loaded model, in
lock step (handover.py): the sender's sequence leaves by llama_state_seq_get_data and llama_memory_seq_rm, the
receiver's lowest free seq id takes it by llama_state_seq_set_data; where each request ran comes back as
schedule_facts ({"transfer": {id: [{"engine", "seq", "step", "imported"?}]}}).
Threads (n_threads and n_threads_batch): $HQ_LLAMACPP_THREADS when set (the user's override), else the run's
EngineOptions.threads (qualify: cores // --jobs, or --engine-threads), else this process's cores (`llama_threads`).
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from hybridqual.adapters import Capabilities, RunResult, TraceAdapter
from hybridqual.adapters.base import DEFAULT_OPTIONS, Configuration, EngineOptions, MeasuredPrecision
from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp.kv_cache import KV_CACHES, kv_cache
from oracle.config import from_hf_config
from oracle.trace import check_prefix_cache_against_model
from hybridqual.scenarios.step_rule import OURS

# The worker cuts each step's pieces with our rule (worker.piece_length) and gives llama_decode one batch per step
# with n_batch = n_ubatch >= the step's tokens (worker.py), so llama.cpp splits no step into ubatches: our rule.
STEP_RULE = dataclasses.replace(OURS, name="llama.cpp adapter: hybridqual's piece rule, one ubatch a step "
                                            "(n_batch = n_ubatch >= the step)")

WORKER = Path(__file__).resolve().with_name("worker.py")
# q8_0 is no torch dtype: its judging constants are measured (measure_tau.py; docs/findings.md, "q8_0")
Q8_0 = MeasuredPrecision("q8_0", tau=2.4, logits_c=0.45, top_k=5, measured_err=0.931)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "q8_0": Q8_0}

_NOTES = (
    ("seeded", "the adapter samples greedily from llama.cpp's logits; llama.cpp's samplers cannot reproduce the "
               "trace's keyed (request seed, position) sampler"),
    ("async", "llama.cpp has no async scheduling mode (async == legacy would compare a run with itself)"),
    ("schedule_log", "llama.cpp splits each batch into its own micro-batches; there is no DESIGN §4 schedule log "
                     "of ours to compare"),
    ("speculation_reporting", "scripted, ngram and draft-model proposals are verified in llama.cpp's batches with "
                              "a rollback to the sequence-state snapshot on a rejection, but there is no schedule "
                              "log to report them in (per-request proposed/accepted counts are in schedule_facts, "
                              "checked against the oracle's by the engine schedule facts line)"),
)


THREADS_ENV = "HQ_LLAMACPP_THREADS"


@dataclasses.dataclass(frozen=True)
class LlamaThreads:
    """The threads the llama.cpp worker is given (n_threads = n_threads_batch) and where the number comes from."""
    threads: int
    source: str

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads > 1 else ''} ({self.source})"


def threads_problem(env: dict | None = None) -> str | None:
    """Why $HQ_LLAMACPP_THREADS is not a thread count (None: unset or an integer >= 1)."""
    raw = (os.environ if env is None else env).get(THREADS_ENV)
    if raw is None or raw.strip().isdigit() and int(raw) >= 1:
        return None
    return f"{THREADS_ENV}={raw!r}: must be an integer >= 1 (the llama.cpp worker's threads)"


def llama_threads(options: EngineOptions = DEFAULT_OPTIONS, env: dict | None = None) -> LlamaThreads:
    """$HQ_LLAMACPP_THREADS (the user's override), else options.threads (the run's budget), else this process's
    cores; a ValueError naming the variable when it is not an integer >= 1."""
    env = os.environ if env is None else env
    why = threads_problem(env)
    if why:
        raise ValueError(why)
    if env.get(THREADS_ENV) is not None:
        return LlamaThreads(int(env[THREADS_ENV]), f"${THREADS_ENV}")
    if options.threads is not None:
        return LlamaThreads(options.threads.threads, f"qualify's budget: {options.threads.describe()}")
    return LlamaThreads(len(os.sched_getaffinity(0)), "this process's cores")


class WorkerError(RuntimeError):
    """The llama.cpp worker died, hung or refused an op; the message says which, and its last log lines."""


class Worker:
    """A llama.cpp worker process (the llama venv's python running worker.py) and its JSON-lines pipe."""

    def __init__(self, timeout: float = 600.0, env: dict | None = None) -> None:
        why = conv.available()
        if why:
            raise WorkerError(f"llama.cpp: {why}")
        self.timeout = timeout
        self._log = tempfile.TemporaryFile(mode="w+")
        self._tail_at_close = ""
        self.proc = subprocess.Popen([str(conv.venv_dir() / "bin" / "python"), str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={k: v for k, v in {**os.environ, "PYTHONNOUSERSITE": "1",
                                                            "GGML_NO_BACKTRACE": "1", **(env or {})}.items()
                                          if v is not None})
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, n: int = 8) -> str:
        """The worker's last `n` stderr lines (llama.cpp's log)."""
        if self._log.closed:
            return self._tail_at_close
        self._log.flush()
        self._log.seek(0)
        lines = [ln.rstrip() for ln in self._log.read().splitlines() if ln.strip()]
        return "\n".join(lines[-n:])

    def _death(self, what: str) -> WorkerError:
        rc = self.proc.wait()
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        return WorkerError(f"llama.cpp worker died during {what} ({how}); its last log lines:\n{self.log_tail()}")

    def ask(self, msg: dict, timeout: float | None = None) -> dict:
        """Send one op, return its reply; WorkerError on death, timeout or an error reply."""
        what = f"'{msg.get('op')}'" + (f" of {msg['gguf']}" if "gguf" in msg else "")
        if self.proc.poll() is not None:
            raise self._death(what)
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._death(what) from None
        limit = self.timeout if timeout is None else timeout
        try:
            line = self._lines.get(timeout=limit)
        except queue.Empty:
            self.close(kill=True)
            raise WorkerError(f"llama.cpp worker did not answer {what} within {limit:.0f} s (killed); its last "
                              f"log lines:\n{self._tail_at_close}") from None
        if line is None:
            raise self._death(what)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise WorkerError(f"llama.cpp worker answered {what} with a line that is not JSON: {line[:200]!r}") \
                from None
        if not reply.get("ok"):
            raise WorkerError(f"llama.cpp worker refused {what}: {reply.get('error')}; its last log lines:\n"
                              f"{self.log_tail()}")
        return reply

    def close(self, kill: bool = False) -> None:
        """Quit (or kill) the worker and reap it."""
        if self.proc.poll() is None:
            if not kill:
                try:
                    self.proc.stdin.write('{"op": "quit"}\n')
                    self.proc.stdin.flush()
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._tail_at_close = self.log_tail()
            self._log.close()


def cached_gguf(model_path: Path, outtype: str) -> tuple[Path, dict]:
    """The GGUF of `model_path` in `outtype`, converted once and kept under the llama venv; with its sidecar."""
    h = hashlib.sha256()
    h.update((model_path / "config.json").read_bytes())
    for f in sorted(model_path.iterdir()):
        if f.is_file() and f.name != "config.json":
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(f"{outtype}:{conv.install_info().get('llama_cpp_commit')}".encode())
    h.update(Path(conv.__file__).read_bytes())               # a changed mapping converts again
    out = conv.venv_dir() / "gguf-cache" / f"{model_path.name}-{h.hexdigest()[:16]}.{outtype}.gguf"
    side = Path(f"{out}.json")
    if out.exists() and side.exists():
        return out, json.loads(side.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, conv.convert(model_path, out, outtype)


class LlamaCppAdapter(TraceAdapter):
    """llama.cpp (the llama-cpp-python 0.3.36 build of scripts/install-llamacpp.sh) on an f32 GGUF of the model."""
    outtype = "f32"
    kv_type = "f32"              # the K/V cache in the GGUF's compute dtype (llama.cpp's own default is f16)
    # llama.cpp's default ("auto") turns flash attention on for the CPU, whose kernel works in f16: max|Δlogit|
    # ~2e-4-1e-3 against the fp64 oracle on the zoo, ~1e-6 with it off (f32 throughout)
    flash_attn = "off"
    OPTIONS = ("threads",)       # the run's thread budget (n_threads / n_threads_batch; llama_threads)
    timeout = float(os.environ.get("HQ_LLAMACPP_TIMEOUT", "600"))

    @classmethod
    def lib_path(cls) -> str | None:
        """The directory the worker's llama_cpp loads libllama.so from: $HQ_LLAMACPP_LIB (another build of the same
        commit, e.g. the mutant of mutant.py), else None (the libraries installed into the llama venv)."""
        return os.environ.get("HQ_LLAMACPP_LIB") or None

    def _worker_env(self) -> dict:
        lib = self.lib_path()
        if lib and not (Path(lib) / "libllama.so").exists():
            raise WorkerError(f"llama.cpp: {lib}/libllama.so is missing (HQ_LLAMACPP_LIB or the mutant build)")
        return {"LLAMA_CPP_LIB_PATH": lib}            # None: an inherited LLAMA_CPP_LIB_PATH is dropped

    kv_configurable = True       # the K/V cache configurations (kv_cache.py) are measured on this class's f32 GGUF

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = DEFAULT_OPTIONS) -> Capabilities:
        kv = kv_cache(options.configuration)
        caps = Capabilities(("greedy",), ("legacy",), logits=True, compute_dtype=DTYPES[cls.outtype], notes=_NOTES,
                            prefix_cache_reporting=True, step_rule=STEP_RULE, state_transfer=True)
        if kv is None:
            return caps
        if kv.precision is None:
            raise ValueError(f"configuration: {kv.name!r} has no measured constants (measure_tau --configuration)")
        return dataclasses.replace(caps, compute_dtype=kv.precision, kv_dtype=kv.kv_type)    # DESIGN §20

    @classmethod
    def configurations(cls) -> tuple[Configuration, ...]:
        """The K/V cache settings whose constants are measured (kv_cache.KV_CACHES), on the f32 GGUF only."""
        if not cls.kv_configurable:
            return ()
        return tuple(kv.configuration() for kv in KV_CACHES.values() if kv.precision is not None)

    @classmethod
    def kv_setting(cls, options: EngineOptions = DEFAULT_OPTIONS) -> tuple[str, str]:
        """(K/V ggml type, flash attention) of a run: its configuration's, else the class's."""
        kv = kv_cache(options.configuration)
        return (cls.kv_type, cls.flash_attn) if kv is None else (kv.kv_type, kv.flash_attn)

    @classmethod
    def options_problem(cls, options: EngineOptions) -> str | None:
        return super().options_problem(options) or threads_problem()

    @classmethod
    def facts_check(cls, ctx):
        """qualify's extra line for a speculative trace: the per-request counts against the oracle's."""
        return speculation_check(ctx.label, ctx.mode, ctx.trace, ctx.run, ctx.oracle_model)

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        try:
            info = conv.install_info()
        except conv.ConversionError as e:
            return f"llama.cpp (not installed: {e})"
        lib = cls.lib_path()
        kv_type, flash_attn = cls.kv_setting(options)
        return (f"llama.cpp {str(info.get('llama_cpp_commit'))[:9]} via llama-cpp-python {info.get('llama_cpp_python')} "
                f"low-level API, {cls.outtype} GGUF, {kv_type} K/V cache, flash attention {flash_attn}, "
                f"{threads_problem() or llama_threads(options).describe()}, no extra buffer types"
                + (f", libllama from {lib}" if lib else ""))

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        super().__init__(model_path, trace, mode, device, options)
        self.threads = llama_threads(options)
        if options.configuration is not None and not self.kv_configurable:
            raise ValueError(f"configuration: {options.configuration!r}; {type(self).__name__} declares none")
        self.kv_type, self.flash_attn = self.kv_setting(options)
        if device != "cpu":
            raise ValueError(f"device: {device!r}; the llama.cpp build of scripts/install-llamacpp.sh is CPU only")
        for r in trace.requests:
            if r.sampling.kind != "greedy":
                raise ValueError(f"request {r.id}: the llama.cpp adapter runs greedy sampling only")
        given = os.environ.get("HQ_LLAMACPP_GGUF")
        if given:
            self.gguf, self.sidecar = Path(given), {"gguf": given, "config_mappings": None}
        else:
            self.gguf, self.sidecar = cached_gguf(self.model_path, self.outtype)
        cfg = from_hf_config(json.loads((self.model_path / "config.json").read_text()))
        check_prefix_cache_against_model(trace.engine, cfg.chunk_size, len(cfg.mamba_layer_ids))
        self.chunk_size = cfg.chunk_size
        self.draft_gguf = draft_gguf(trace.engine.speculative, cfg.vocab_size, self.outtype)
        self.meta: dict = {}

    def load_message(self, n_ctx: int, n_seq: int) -> dict:
        """The worker's "load" op: the GGUF, context, sequences, threads (n_threads = n_threads_batch), K/V type."""
        return {"op": "load", "gguf": str(self.gguf), "n_ctx": n_ctx, "n_seq": n_seq,
                "n_threads": self.threads.threads, "kv_type": self.kv_type, "flash_attn": self.flash_attn}

    def run_trace(self) -> RunResult:
        trace = self.trace
        eng = trace.engine
        n_ctx = max(len(r.prompt) + r.max_new_tokens + 1 for r in trace.requests)
        n_ctx = max(64, -(-n_ctx // 64) * 64)
        n_seq = max(1, min(eng.max_requests, len(trace.requests), 64))
        worker = Worker(self.timeout, env=self._worker_env())
        try:
            loaded = worker.ask(self.load_message(n_ctx, n_seq))
            self.meta = loaded["meta"]
            n_vocab = int(loaded["n_vocab"])
            reqs = [{"id": r.id, "arrival_step": r.arrival_step, "prompt": list(r.prompt),
                     "max_new_tokens": r.max_new_tokens, "stop_token_ids": list(r.stop_token_ids),
                     **({"transfer": [t.to_json() for t in r.transfer]} if r.transfer else {})}
                    for r in trace.requests]
            got = worker.ask({"op": "run", "requests": reqs, "max_requests": n_seq,
                              "max_tokens_per_step": eng.max_tokens_per_step, "prefill_chunk": eng.prefill_chunk,
                              "chunk_size": self.chunk_size,
                              "prefix_cache": None if eng.prefix_cache is None else eng.prefix_cache.to_json(),
                              "speculative": speculative_config(eng.speculative, self.draft_gguf)})
        finally:
            worker.close()
        logits = {}
        for rid, toks in got["tokens"].items():
            if toks:
                arr = np.frombuffer(base64.b64decode(got["logits"][rid]), dtype="<f4").reshape(len(toks), n_vocab)
                logits[rid] = torch.from_numpy(arr.copy())
        self.steps, self.seq_ids = got["steps"], got["seq_ids"]
        self.speculation = got.get("speculation")          # per request: proposed, accepted, rollbacks
        self.placements = got.get("placements")            # DESIGN §19: per request, the instances it ran on
        facts = [{"speculation": self.speculation}] if self.speculation is not None else None
        if self.placements is not None:
            facts = [{"transfer": self.placements}]
        if got.get("pieces"):                              # the worker's prompt pieces, step by step (the shape line)
            facts = (facts or []) + [{"batches": [{"rows": rows}]} for rows in got["pieces"]]
        return RunResult(got["tokens"], got["finish"], logits=logits, prefix_cache=got.get("prefix_cache"),
                         schedule_facts=facts)


def speculative_config(spec, draft: Path | None = None) -> dict | None:
    """The trace's speculative block for the worker (None without one); a draft proposer carries its GGUF."""
    if spec is None:
        return None
    out = spec.to_json()
    if spec.proposer.kind == "draft":
        if draft is None:
            raise ValueError(f"{DRAFT_FIELD}: the draft model's GGUF is needed (draft_gguf)")
        out["draft_gguf"] = str(draft)
    return out


DRAFT_FIELD = "engine.speculative.proposer.model"


def draft_gguf(spec, vocab_size: int, outtype: str) -> Path | None:
    """The draft proposer's GGUF: its folder (resolved as the oracle resolves it) converted as the target is, once
    (cached_gguf); a folder that is missing, has another vocabulary or does not convert is an error naming the field."""
    if spec is None or spec.proposer.kind != "draft":
        return None
    from oracle.speculative import model_path
    folder = model_path(spec)                        # a TraceError naming the field when there is no config.json
    try:
        v = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError) as e:
        raise ValueError(f"{DRAFT_FIELD}: cannot read {folder / 'config.json'} ({type(e).__name__}: {e})") from None
    if v != vocab_size:
        raise ValueError(f"{DRAFT_FIELD}: the draft model {folder.name} has vocab_size {v}, the target {vocab_size}: "
                         "a draft must share the target's vocabulary")
    try:
        return cached_gguf(folder, outtype)[0]
    except (conv.ConversionError, OSError) as e:
        raise ValueError(f"{DRAFT_FIELD}: the draft model {folder} does not convert to a {outtype} GGUF: {e}") \
            from None


def speculation_check(label: str, mode: str, trace, run, oracle_model):
    """qualify's line for a speculative trace (None for others): the engine's per-request proposed and accepted
    counts (schedule_facts) equal the oracle's, whose scheduler and proposer replay the engine's tokens."""
    import oracle
    from hybridqual.qualify.report import Check
    from hybridqual.qualify.spec_checks import verify_rows
    if trace.engine.speculative is None:
        return None
    name = f"{mode}: speculation counts match the oracle's"
    got = next((f["speculation"] for f in run.schedule_facts or [] if isinstance(f, dict) and "speculation" in f),
               None)
    if not isinstance(got, dict):
        return Check.of(label, name, False, "the engine reported no per-request speculation counts")
    replay = oracle.run_trace(oracle_model, trace, mode=mode, forced_tokens=dict(run.tokens))
    want: dict[str, list[int]] = {}
    for v in verify_rows(replay.schedule_log):
        c = want.setdefault(v["request"], [0, 0])
        c[0], c[1] = c[0] + len(v["proposals"]), c[1] + v["accepted"]
    bad, tot = [], [0, 0]
    for r in trace.requests:
        g = got.get(r.id) or {}
        mine, theirs = [int(g.get("proposed", 0)), int(g.get("accepted", 0))], want.get(r.id, [0, 0])
        tot = [tot[0] + theirs[0], tot[1] + theirs[1]]
        if mine != theirs:
            bad.append(f"request {r.id}: proposed/accepted {mine[0]}/{mine[1]}, the oracle's {theirs[0]}/{theirs[1]}")
    detail = "; ".join(bad[:3]) if bad else (f"{len(trace.requests)} requests, {tot[0]} proposed, {tot[1]} accepted "
                                             "(the oracle's, on the engine's tokens)")
    return Check.of(label, name, not bad, detail, proposed=tot[0], accepted=tot[1],
                    requests={rid: {"proposed": c[0], "accepted": c[1]} for rid, c in want.items()})


class LlamaCppFlashAttnAdapter(LlamaCppAdapter):
    """llama.cpp's defaults on an f32 GGUF: flash attention as llama.cpp picks it (on for the CPU: an f16 kernel)
    and an f16 K/V cache; judged as float16 compute."""
    kv_type = "f16"
    flash_attn = "auto"
    kv_configurable = False

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = DEFAULT_OPTIONS) -> Capabilities:
        return Capabilities(("greedy",), ("legacy",), logits=True, compute_dtype=torch.float16, notes=_NOTES,
                            prefix_cache_reporting=True, step_rule=STEP_RULE, state_transfer=True)


class LlamaCppBF16Adapter(LlamaCppAdapter):
    """llama.cpp on a bf16 GGUF of the model (judged with bf16's τ)."""
    outtype = "bf16"
    kv_type = "bf16"
    kv_configurable = False


class LlamaCppQ8Adapter(LlamaCppAdapter):
    """llama.cpp on a q8_0 GGUF (8-bit block-quantized weights; f32 K/V cache, flash attention off), judged with
    the constants measured for it (Q8_0)."""
    outtype = "q8_0"
    kv_configurable = False
