"""hybridqual's own fast path as an engine: tokens, streamed tokens, schedule log, logits rows and prefix-cache
facts."""
from __future__ import annotations

import torch

from hybridqual.adapters.base import Adapter, Capabilities, Configuration, RunResult, cache_facts, installed_version

# The fast path's optional configurations: name -> (class attributes set, FastOptions fields changed, reach, why).
# The main job runs each on the shipped instances that reach its code (docs/qualification.md, "Configurations").
FAST_CONFIGURATIONS: dict[str, tuple[dict, dict, tuple[str, ...], str]] = {
    "spec_replay": ({}, {"spec_replay": True}, ("zoo-bamba/spec_accept",),
                    "speculative rollback by replaying the accepted inputs' conv/SSM steps instead of snapshots"),
    "spec_device_drafts": ({"pad_decode": True}, {"spec_device_drafts": True},
                           ("zoo-bamba/spec_device",),
                           "ngram drafts searched on the device in decode-loop steps (padded decode buckets)"),
    "unfused": ({}, {"fused": False}, ("zoo-granite_dense/stop_tokens",),
                "the unfused residual add and norms (Granite's residual multiplier on the unfused path)"),
    "torch_backend": ({"pad_decode": True}, {"backend": "torch"}, ("zoo-mamba2/decode_buckets",),
                      "the torch stand-in kernels, decode steps padded to the graph buckets"),
    "batch_invariant": ({"batch_invariant": True}, {}, ("zoo-bamba_wide/async_drain",),
                        "the batch-invariant mode (fixed-split matmuls, per-request pieces; the MLP's K = 4096 takes "
                        "the split): each request alone must give the same bits"),
    "prefill_buckets": ({"prefill_buckets": "default"}, {}, ("zoo-bamba/prefix_lru",),
                        "one-piece prefill-only steps (prefix-cache hits, cold pieces, pieces storing a checkpoint "
                        "inside) padded to token buckets whose kept batches (CUDA graphs with --graphs) are built at "
                        "engine start"),
    "gemv": ({}, {"gemv_on_cpu": True, "gemv_rows": True}, ("zoo-granite_dense/stop_tokens",),
             "the one-row GEMV and its folds (norm, conv step, residual epilogue) and the few-row GEMV (2..8-row "
             "projections) on CPU too (on cuda the one-row GEMV is the default)"),
}


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
    options = None            # a fastpath.FastOptions (None: the defaults): a declared configuration sets it
    pad_decode = False        # decode-only steps padded to the graph buckets without graphs (the CPU analogue)
    prefill_buckets = None    # None, "default" or bucket sizes: prefill graphs with token buckets (Engine's argument)
    configuration = None      # the name of the declared configuration this class runs (None: the default)

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        dtype = cls.dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        return Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True, logits=True,
                            compute_dtype=dtype, prefix_cache_reporting=True, speculation_reporting=True,
                            batch_invariant=cls.batch_invariant)

    @classmethod
    def version(cls) -> str:
        ver = installed_version("hybridqual")
        return f"hybridqual fastpath {ver}" + (f" tp={cls.tp}" if cls.tp > 1 else "") + \
            (" batch-invariant" if cls.batch_invariant else "") + (" graphs" if cls.graphs else "")

    @classmethod
    def configurations(cls) -> tuple[Configuration, ...]:
        return tuple(Configuration(name, reach, why) for name, (_, _, reach, why) in FAST_CONFIGURATIONS.items())

    @classmethod
    def configured(cls, name: str) -> type["FastpathAdapter"]:
        if name not in FAST_CONFIGURATIONS:
            cls.configure(name)       # the ValueError naming the declared ones
        attrs, changes, _, _ = FAST_CONFIGURATIONS[name]
        from fastpath.options import FastOptions
        options = (cls.options or FastOptions()).replace(**changes)
        return type(f"{cls.__name__}_{name}", (cls,), {**attrs, "options": options, "configuration": name})

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        dtype = dtype or self.dtype
        if self.tp > 1 or self.batch_invariant:
            from fastpath.tp import engine_from_pretrained
            self.engine = engine_from_pretrained(self.model_path, trace.engine, device=device, dtype=dtype,
                                                 tp=self.tp, batch_invariant=self.batch_invariant,
                                                 graphs=self.graphs, options=self.options)
        else:
            import fastpath
            self.engine = fastpath.Engine.from_pretrained(self.model_path, trace.engine, device=device, dtype=dtype,
                                                          graphs=self.graphs, pad_decode=self.pad_decode,
                                                          options=self.options, **self.kv_len(trace, device),
                                                          **self.buckets())

    @classmethod
    def buckets(cls) -> dict:
        """The engine's prefill-graph arguments: token buckets (with prefill graphs) when the class sets them."""
        return {} if cls.prefill_buckets is None else {"prefill_graphs": True, "prefill_buckets": cls.prefill_buckets}

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
                plen = len(engine.requests[b.request].req.prompt)
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
