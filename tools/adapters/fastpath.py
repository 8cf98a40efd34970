"""hybridqual's own fast path as an engine: tokens, streamed tokens, schedule log, logits rows and prefix-cache
facts."""
from __future__ import annotations

import torch

from hybridqual.adapters.base import Adapter, Capabilities, RunResult, cache_facts, installed_version


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
