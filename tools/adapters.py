"""Engine adapter protocol: how `qualify` and `replay` drive an engine, and adapters for ours and HF's.

To qualify your own engine, subclass `Adapter` and implement four methods (a complete wrapper is ~30 lines):

    class MyEngine(Adapter):
        CAPABILITIES = Capabilities(sampling_kinds=("greedy",), compute_dtype=torch.bfloat16)   # what it can do
        def __init__(self, model_path, trace, mode, device):   # build your engine from the trace's engine config
            ...
        def add_request(self, request):                       # request: oracle.trace.Request (id, prompt, ...)
            ...
        def step(self) -> dict[str, list[int]]:               # one engine step; returns tokens emitted per request id
            ...
        def done(self) -> bool:                               # nothing waiting, nothing running
            ...

then `python -m tools.qualify --engine mypackage.mymodule:MyEngine`. `Adapter.run_trace` admits each request at
its `arrival_step` (the step counter is the number of `step()` calls made so far) and collects tokens. An adapter
may also override `run_trace` directly and may return a schedule log (DESIGN §4) and logits rows to have them
checked too. Capabilities say what the adapter can do (DESIGN §14): a check it cannot support is reported as
"SKIP: reason", never run against nothing and never counted as passed.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import torch


def installed_version(dist: str) -> str:
    """The installed distribution's version, or "(not installed)" (a checkout used through PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "(not installed)"


@dataclass(frozen=True)
class Capabilities:
    """What an adapter supports; qualify skips (with the reason) every check outside it."""
    sampling_kinds: tuple[str, ...] = ("greedy",)
    modes: tuple[str, ...] = ("legacy",)          # an engine claims "async" only if it has a distinct async mode
    schedule_log: bool = False                    # run_trace returns a schedule log (oracle.schedule_log format)
    logits: bool = False                          # run_trace returns the logits row of every sampled position
    compute_dtype: torch.dtype | None = None      # picks τ and the logits tolerance; None: judged as float32
    prefix_cache_reporting: bool = False          # DESIGN §12: run_trace returns RunResult.prefix_cache (and a log,
                                                  # if any, records hits/stores/evictions)
    speculation_reporting: bool = False           # for later (DESIGN §13): the log records proposals/acceptance
    notes: tuple[tuple[str, str], ...] = ()       # (capability, why it is missing), quoted in skip reasons

    def why_not(self, what: str, default: str) -> str:
        """The adapter's own reason for lacking `what`, else `default`."""
        return dict(self.notes).get(what, default)


@dataclass
class RunResult:
    """What qualify compares: tokens and finish reasons per request, and the schedule log / logits when available."""
    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str] = field(default_factory=dict)
    schedule_log: object | None = None   # oracle.schedule_log.ScheduleLog (has .to_json()) when the engine logs
    digest: str | None = None
    logits: dict[str, torch.Tensor] | None = None   # request id -> [len(tokens), vocab], the row each token came from
    # prefix-cache facts (DESIGN §12; docs/api.md): a tools.prefix_checks.CacheEvents, or its JSON form
    # {"admit": [{"request", "cached_tokens"}], "steps": [{"stored": [{"request", "pos"}], "evicted": [...]}]}
    # ("steps" optional); None: the engine reports nothing, and the policy check is a SKIP
    prefix_cache: object | None = None
    # an engine's own per-step schedule facts (JSON; e.g. Megatron's, tools/megatron/schedule_facts.py), shown in the
    # report and checked by the adapter's `facts_check(label, mode, trace, run, oracle_model)` classmethod if any
    schedule_facts: list | None = None


class Adapter:
    """Base class of engine adapters; see the module docstring."""
    max_steps = 100_000
    CAPABILITIES = Capabilities()

    def __init__(self, model_path: Path, trace, mode: str, device: str = "cpu") -> None:
        self.model_path, self.trace, self.mode, self.device = Path(model_path), trace, mode, device

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        """The capabilities on `device` (override when, e.g., the compute dtype depends on it)."""
        return cls.CAPABILITIES

    @classmethod
    def version(cls) -> str:
        """A version string for the report: the adapter's class and its top-level package's version if known."""
        from importlib.metadata import PackageNotFoundError, version
        pkg = cls.__module__.split(".")[0]
        try:
            return f"{cls.__module__}.{cls.__qualname__} ({pkg} {version(pkg)})"
        except (PackageNotFoundError, ValueError):
            return f"{cls.__module__}.{cls.__qualname__}"

    def add_request(self, request) -> None:
        raise NotImplementedError

    def step(self) -> dict[str, list[int]]:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def run_trace(self) -> RunResult:
        """Drive add_request/step/done through the trace's arrivals."""
        pending = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        out: dict[str, list[int]] = {r.id: [] for r in pending}
        k = 0
        while pending or not self.done():
            while pending and pending[0].arrival_step <= k:
                self.add_request(pending.pop(0))
            for rid, toks in self.step().items():
                out[rid].extend(toks)
            k += 1
            if k > self.max_steps:
                raise RuntimeError(f"engine did not finish the trace within {self.max_steps} steps")
        return RunResult(tokens=out)


class OracleAdapter(Adapter):
    """The oracle scheduler itself (fp64 by default): the truth, with its schedule log."""
    CAPABILITIES = Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True,
                                compute_dtype=torch.float64, prefix_cache_reporting=True, speculation_reporting=True,
                                notes=(("logits", "the oracle adapter is the truth itself"),))

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        import oracle
        self.model = oracle.load(self.model_path, dtype=dtype or torch.float64)

    def run_trace(self) -> RunResult:
        import oracle
        r = oracle.run_trace(self.model, self.trace, mode=self.mode)
        return RunResult(r.tokens, r.finish_reasons, r.schedule_log, r.digest, prefix_cache=_cache_facts(self.trace, r))


class FastpathAdapter(Adapter):
    """hybridqual's own fast path (Triton kernels; on CPU through the interpreter, fp32; on cuda bf16 by default).

    `tp` > 1 (under torchrun) shards the model over ranks; `batch_invariant` selects the batch-invariant mode
    (docs/tp.md); `dtype` and `graphs` override the compute dtype and turn on CUDA graphs. All are class attributes
    so `qualify --tp/--batch-invariant/--dtype/--graphs` can set them on a subclass.
    """
    tp = 1
    batch_invariant = False
    dtype: torch.dtype | None = None
    graphs = False

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        dtype = cls.dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        return Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True, logits=True,
                            compute_dtype=dtype, prefix_cache_reporting=True, speculation_reporting=True)

    @classmethod
    def version(cls) -> str:
        ver = installed_version("hybridqual")
        return f"hybridqual fastpath {ver}" + (f" tp={cls.tp}" if cls.tp > 1 else "") + \
            (" batch-invariant" if cls.batch_invariant else "") + (" graphs" if cls.graphs else "")

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        dtype = dtype or self.dtype
        if self.tp > 1 or self.batch_invariant:
            from fastpath.tp import engine_from_pretrained
            self.engine = engine_from_pretrained(self.model_path, trace.engine, device=device, dtype=dtype,
                                                 tp=self.tp, batch_invariant=self.batch_invariant,
                                                 graphs=self.graphs)
        else:
            import fastpath
            self.engine = fastpath.Engine.from_pretrained(self.model_path, trace.engine, device=device, dtype=dtype,
                                                          graphs=self.graphs, **self.kv_len(trace, device))

    @staticmethod
    def kv_len(trace, device: str) -> dict:
        """On CPU the KV cache is sized to the trace (longest prompt + max_new_tokens, in 64-key steps) instead of
        the engine's default 2048: the interpreter pays per decode-attention program, one per 64 keys of capacity,
        so a 2048-key cache cost ~30x the work of a short trace's (docs/qualification.md). cuda keeps the default."""
        if torch.device(device).type != "cpu" or not trace.requests:
            return {}
        need = max(len(r.prompt) + r.max_new_tokens for r in trace.requests)
        return {"max_len": max(64, -(-need // 64) * 64)}

    def run_trace(self) -> RunResult:
        rows: dict[tuple[str, int], torch.Tensor] = {}
        engine = self.engine

        def record(batch, logits) -> None:        # the row each sampled token came from, kept on the device
            for j, b in enumerate(batch):
                plen = len(engine.requests[b.request].req.prompt)
                if b.kind == "decode" or (b.kind == "prefill" and b.pos + b.count == plen):
                    rows[(b.request, b.pos + b.count)] = logits[j].detach().clone()
        engine.on_logits = record
        try:
            r = engine.run_trace(self.trace, mode=self.mode)
        finally:
            engine.on_logits = None
        logits = {}
        for req in self.trace.requests:
            toks = r.tokens.get(req.id, [])
            got = [rows.get((req.id, len(req.prompt) + i)) for i in range(len(toks))]
            if toks and all(g is not None for g in got):
                logits[req.id] = torch.stack(got).float().cpu()
        return RunResult(r.tokens, r.finish_reasons, r.schedule_log, r.digest, logits, _cache_facts(self.trace, r))


def _cache_facts(trace, result):
    """The prefix-cache facts of a run whose schedule log carries them (ours and the oracle's), else None."""
    if trace.engine.prefix_cache is None:
        return None
    from .prefix_checks import events_from_log
    return events_from_log(result.schedule_log)


def _cut(gen: list[int], req) -> tuple[list[int], str]:
    """A request's output from a longer generation: up to and including its first stop token, at most
    max_new_tokens; with its finish reason."""
    stops = set(req.stop_token_ids)
    gen = gen[:req.max_new_tokens]
    cut = next((i + 1 for i, t in enumerate(gen) if t in stops), None)
    return (gen[:cut], "stop") if cut is not None else (gen, "length")


class HFAdapter(Adapter):
    """HF transformers `generate`, greedy, one request at a time (no scheduling, no schedule log).

    The prompt goes in with an explicit all-ones attention_mask, so no token id is ever taken for padding (without
    one, generate infers the mask from pad_token_id and would mask every prompt token equal to it).
    """
    CAPABILITIES = Capabilities(("greedy",), ("legacy",), compute_dtype=torch.float32,
                                notes=(("seeded", "HF generate cannot reproduce the trace's keyed seeded sampler"),
                                       ("async", "HF generate has no async scheduling mode (async == legacy would "
                                                 "compare a run with itself)"),
                                       ("schedule_log", "HF generate keeps no schedule log"),
                                       ("logits", "the HF adapter does not return logits")))

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype or torch.float32).to(device)
        self.pad = self.model.config.vocab_size - 1    # any id: the attention mask, not the id, marks padding

    @classmethod
    def version(cls) -> str:
        import transformers
        return f"transformers {transformers.__version__} generate ({cls.__name__})"

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generate for prompts of any lengths (left-padded into one batch): new tokens per prompt."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                      do_sample=False, eos_token_id=None, pad_token_id=self.pad)
        return [row[width:].tolist() for row in out]

    def _check_sampling(self) -> None:
        for req in self.trace.requests:
            if req.sampling.kind != "greedy":
                raise ValueError(f"request {req.id}: the HF adapters run greedy sampling only")

    def run_trace(self) -> RunResult:
        self._check_sampling()
        tokens, reasons = {}, {}
        for req in self.trace.requests:
            [gen] = self._generate([list(req.prompt)], req.max_new_tokens)
            tokens[req.id], reasons[req.id] = _cut(gen, req)
        return RunResult(tokens, reasons)


class HFBatchedAdapter(HFAdapter):
    """HF transformers `generate` with every request of the trace in one left-padded batch (the padding path).

    Generates max(max_new_tokens) tokens for all and cuts each request at its own stop token / length (one
    eos_token_id list for the batch would stop a request on another request's stop token).
    """

    def run_trace(self) -> RunResult:
        self._check_sampling()
        reqs = list(self.trace.requests)
        gens = self._generate([list(r.prompt) for r in reqs], max(r.max_new_tokens for r in reqs))
        tokens, reasons = {}, {}
        for req, gen in zip(reqs, gens):
            tokens[req.id], reasons[req.id] = _cut(gen, req)
        return RunResult(tokens, reasons)


BUILTIN = {"fastpath": FastpathAdapter, "oracle": OracleAdapter, "hf": HFAdapter, "hf-batched": HFBatchedAdapter}


# Short names of adapters that live in optional subpackages (imported only when named).
NAMED = {"megatron": "megatron:MegatronAdapter", "megatron-rounded": "megatron:MegatronRoundedAdapter",
         "megatron-prefix": "megatron:MegatronPrefixAdapter", "megatron-mtp": "megatron:MegatronMTPAdapter",
         "megatron-graphs": "megatron:MegatronGraphsAdapter"}


def resolve(spec: str) -> type[Adapter]:
    """'fastpath' | 'oracle' | 'hf' | 'hf-batched' | 'megatron[-rounded|-prefix]' | 'package.module:Class' ->
    adapter class, with a clear error."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec in NAMED:
        spec = f"{__package__}.{NAMED[spec]}"
    if ":" not in spec:
        raise ValueError(f"--engine {spec!r}: expected one of {sorted(BUILTIN) + sorted(NAMED)} or 'module:Class'")
    mod, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--engine {spec!r}: cannot load it ({e})") from e
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise ValueError(f"--engine {spec!r}: {name} is not a subclass of hybridqual.adapters.Adapter "
                         "(tools.adapters.Adapter in a checkout)")
    if not isinstance(cls.capabilities("cpu"), Capabilities):
        raise ValueError(f"--engine {spec!r}: {name}.capabilities() must return a hybridqual.adapters.Capabilities")
    return cls
