"""hybridqual's own fast path as an engine: tokens, streamed tokens, schedule log, logits rows and prefix-cache
facts."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybridqual.scenarios.step_rule import OURS
from hybridqual.adapters.base import (DEFAULT_OPTIONS, Capabilities, Configuration, EngineOptions, RunResult,
                                      TraceAdapter, cache_facts, installed_version)

@dataclass(frozen=True)
class FastSettings:
    """The fast path's own settings (EngineOptions.settings), set by a declared configuration: FastOptions fields
    changed, decode-only steps padded to the graph buckets without graphs (the CPU analogue), prefill token buckets
    (None, "default" or sizes: prefill graphs with token buckets, Engine's argument)."""
    changes: tuple[tuple[str, object], ...] = ()
    pad_decode: bool = False
    prefill_buckets: str | tuple[int, ...] | None = None

    def fast_options(self):
        """The fastpath.FastOptions these settings run (None: the engine's defaults)."""
        if not self.changes:
            return None
        from fastpath.options import FastOptions
        return FastOptions().replace(**dict(self.changes))


@dataclass(frozen=True)
class FastConfiguration:
    """One declared configuration of the fast path: its settings, whether it is the batch-invariant mode, the
    shipped instances that reach its code and why it exists (docs/qualification.md, "Configurations")."""
    settings: FastSettings
    reach: tuple[str, ...]
    why: str
    batch_invariant: bool = False


# The main job runs each on the shipped instances that reach its code.
FAST_CONFIGURATIONS: dict[str, FastConfiguration] = {
    "spec_replay": FastConfiguration(
        FastSettings((("spec_replay", True),)), ("zoo-bamba/spec_accept",),
        "speculative rollback by replaying the accepted inputs' conv/SSM steps instead of snapshots"),
    "spec_device_drafts": FastConfiguration(
        FastSettings((("spec_device_drafts", True),), pad_decode=True), ("zoo-bamba/spec_device",),
        "ngram drafts searched on the device in decode-loop steps (padded decode buckets)"),
    "unfused": FastConfiguration(
        FastSettings((("fused", False),)), ("zoo-granite_dense/stop_tokens",),
        "the unfused residual add and norms (Granite's residual multiplier on the unfused path)"),
    "torch_backend": FastConfiguration(
        FastSettings((("backend", "torch"),), pad_decode=True), ("zoo-mamba2/decode_buckets",),
        "the torch stand-in kernels, decode steps padded to the graph buckets"),
    "batch_invariant": FastConfiguration(
        FastSettings(), ("zoo-bamba_wide/async_drain",),
        "the batch-invariant mode (fixed-split matmuls, per-request pieces; the MLP's K = 4096 takes the split): "
        "each request alone must give the same bits", batch_invariant=True),
    "prefill_buckets": FastConfiguration(
        FastSettings(prefill_buckets="default"), ("zoo-bamba/prefix_lru",),
        "one-piece prefill-only steps (prefix-cache hits, cold pieces, pieces storing a checkpoint inside) padded "
        "to token buckets whose kept batches (CUDA graphs with --graphs) are built at engine start"),
    "state_float16": FastConfiguration(
        FastSettings((("backend", "torch"), ("state_dtype", "float16"))), ("zoo-nemotron_h/chunked_prefill",),
        "the state bank in float16 (DESIGN §20; torch kernels), judged with the constants measured for it "
        "(hybridqual.adapters.state_precision), never fp32's"),
    "gemv": FastConfiguration(
        FastSettings((("gemv_on_cpu", True), ("gemv_rows", True))), ("zoo-granite_dense/stop_tokens",),
        "the one-row GEMV and its folds (norm, conv step, residual epilogue) and the few-row GEMV (2..8-row "
        "projections) on CPU too (on cuda the one-row GEMV is the default)"),
}


class FastpathAdapter(TraceAdapter):
    """hybridqual's own fast path (Triton kernels; on CPU through the interpreter, fp32; on cuda bf16 by default).

    Options: `tp` > 1 (under torchrun) shards the model over ranks; `batch_invariant` selects the batch-invariant
    mode (docs/tp.md); `dtype` and `graphs` override the compute dtype and turn on CUDA graphs (qualify --tp,
    --batch-invariant, --dtype, --graphs); `configuration` one of FAST_CONFIGURATIONS (its FastSettings).
    """
    OPTIONS = ("dtype", "graphs", "batch_invariant", "tp", "settings")

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = DEFAULT_OPTIONS) -> Capabilities:
        dtype = options.dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        caps = Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True, logits=True,
                            compute_dtype=dtype, prefix_cache_reporting=True, speculation_reporting=True,
                            batch_invariant=options.batch_invariant, deterministic=True, state_transfer=True,
                            step_rule=replace(OURS, name="hybridqual fast path (docs/scheduler.md §3.3)"))
        state = dict(cls.settings(options).changes).get("state_dtype", "float32")     # DESIGN §20
        if state == "float32" or dtype != torch.float32:      # its constants are measured at fp32 compute
            return caps
        from hybridqual.adapters.state_precision import with_state_dtype
        return with_state_dtype(caps, state)

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        ver = installed_version("hybridqual")
        return f"hybridqual fastpath {ver}" + (f" tp={options.tp}" if options.tp > 1 else "") + \
            (" batch-invariant" if options.batch_invariant else "") + (" graphs" if options.graphs else "")

    @classmethod
    def configurations(cls) -> tuple[Configuration, ...]:
        return tuple(Configuration(name, c.reach, c.why) for name, c in FAST_CONFIGURATIONS.items())

    @classmethod
    def configure(cls, name: str, options: EngineOptions = DEFAULT_OPTIONS) -> EngineOptions:
        """The options of configuration `name`: its settings, and the batch-invariant mode where it is one (the
        run's own options, e.g. --graphs, kept)."""
        options = super().configure(name, options)          # a ValueError naming the declared ones
        c = FAST_CONFIGURATIONS[name]
        return options.replace(settings=c.settings, batch_invariant=options.batch_invariant or c.batch_invariant)

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        super().__init__(model_path, trace, mode, device, options)
        settings = self.settings(options)
        if options.tp > 1 or options.batch_invariant:
            from fastpath.tp import engine_from_pretrained
            self.engine = engine_from_pretrained(self.model_path, trace.engine, device=device, dtype=options.dtype,
                                                 tp=options.tp, batch_invariant=options.batch_invariant,
                                                 graphs=options.graphs, options=settings.fast_options())
        else:
            import fastpath
            self.engine = fastpath.Engine.from_pretrained(self.model_path, trace.engine, device=device,
                                                          dtype=options.dtype, graphs=options.graphs,
                                                          pad_decode=settings.pad_decode,
                                                          options=settings.fast_options(),
                                                          **self.kv_len(trace, device), **self.buckets(settings))

    @staticmethod
    def settings(options: EngineOptions) -> FastSettings:
        """The fast path's own settings in `options` (the defaults when none)."""
        if options.settings is None:
            return FastSettings()
        if not isinstance(options.settings, FastSettings):
            raise TypeError(f"EngineOptions.settings: the fast path takes a FastSettings, got "
                            f"{type(options.settings).__name__}")
        return options.settings

    @staticmethod
    def buckets(settings: FastSettings) -> dict:
        """The engine's prefill-graph arguments: token buckets (with prefill graphs) when the settings give them."""
        if settings.prefill_buckets is None:
            return {}
        return {"prefill_graphs": True, "prefill_buckets": settings.prefill_buckets}

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
        streamed: dict[str, list[int]] = {}
        engine = self.engine

        def drain() -> None:                      # what a streaming client has received so far
            for rid, toks in engine.take_emitted().items():
                streamed.setdefault(rid, []).extend(toks)

        def record(batch, logits) -> None:        # the row each sampled token came from, kept on the device
            drain()                               # before every forward: the tokens of the steps before it
            for j, b in enumerate(batch):
                plen = len(engine.requests[b.request].prefill_tokens)     # + output when resumed (§18)
                if b.kind == "decode" or (b.kind == "prefill" and b.pos + b.count == plen):
                    rows[(b.request, b.pos + b.count)] = logits[j].detach().clone()
        engine.on_logits = record
        try:
            r = engine.run_trace(self.trace, mode=self.mode)
        finally:
            engine.on_logits = None
        drain()
        logits = {}
        for req in self.trace.requests:
            toks = r.tokens.get(req.id, [])
            got = [rows.get((req.id, len(req.prompt) + i)) for i in range(len(toks))]
            if toks and all(g is not None for g in got):
                logits[req.id] = torch.stack(got).float().cpu()
        return RunResult(r.tokens, r.finish_reasons, r.schedule_log, r.digest, logits, cache_facts(self.trace, r),
                         streamed={req.id: streamed.get(req.id, []) for req in self.trace.requests})
