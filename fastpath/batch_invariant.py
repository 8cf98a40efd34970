"""Batch-invariant mode: a request's logits are bitwise independent of the batch it is packed into and its row.

What each piece of the forward needs, and where it comes from:

    projections (in/out/q/k/v/o/MLP/lm_head)  fastpath.kernels.matmul: tiles and K split fixed by (N, K), never M
    MoE experts and router                    the same matmul (torch matmuls inside `moe` are routed to it)
    norms                                     the Triton RMSNorm kernels are row-wise (one program per token)
    attention                                 fixed key-block split chosen from the head dim, not the batch
    SSM state                                 fp32 in the bank (StateBank's default)
    conv / SSD / ssm_step                     launch configs keyed on the model shape only (docs/kernels.md)
    prefill pieces                            BatchInvariantEngine: a request's split into pieces is a function
                                              of the request alone (see below)

Prefill pieces.  The SSD kernels give chunk-aligned splits the same chunk boundaries, but not the same bits:
a state carried across pieces through the bank is summed in a different order than the state passed between
chunks inside one piece (measured: 1.5e-7 in the fp32 state, which reaches the logits).  The default rule
(DESIGN §4) cuts a piece to the budget the decode rows leave, so the split depends on the batch.  In
batch-invariant mode a piece's length is `piece_length` with the *whole* step budget; a piece that does not
fit in what is left this step waits for a later step (later rows still get their turn).  The schedule log is
therefore not the oracle's default-mode log; tokens and logits are bitwise those of the request run alone.

cuBLAS (GPU) and MKL/oneDNN (CPU) choose kernels — and split-K — by M, so the default mode is not invariant:
tests/test_batch_invariance.py shows both the invariance here and a failing default.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from fastpath.engine.engine import Engine, piece_length
from fastpath.kernels.matmul import matmul
from fastpath.model import FastModel
from fastpath.options import FastOptions, check_options


class _RouteMatmuls(TorchFunctionMode):
    """Sends `F.linear` and `x @ W` (2-D W) to the fixed-tile matmul; everything else runs unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return matmul(x, w, b)
        if func in (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm) and not kwargs:
            x, w = args
            if isinstance(w, Tensor) and w.dim() == 2 and x.dim() >= 1 and x.is_floating_point():
                return matmul(x, w.t())
        return func(*args, **kwargs)


def route_matmuls() -> TorchFunctionMode:
    """A context in which F.linear / x @ W run on the fixed-tile matmul (FastModel.moe in batch-invariant mode)."""
    return _RouteMatmuls()


class BatchInvariantModel(FastModel):
    """FastModel with `options.batch_invariant` set (same constructor): every projection, the MoE router and
    experts on the fixed-tile matmul, never the one-row GEMV (FastModel._dense, _gemv_ok, moe read the option)."""

    def __init__(self, config, tensors: dict[str, Tensor], device="cpu", dtype=torch.float32,
                 options: FastOptions | None = None):
        super().__init__(config, tensors, device, dtype, check_options(options).replace(batch_invariant=True))


class BatchInvariantEngine(Engine):
    """Engine whose prefill pieces depend only on the request (whole-budget pieces, deferred if they do not fit)."""

    def piece_for(self, st, left: int) -> int:
        """The whole-budget piece (a function of the request alone), or none this step if it does not fit `left`."""
        n = piece_length(st.done, len(st.req.prompt), self.ec.max_tokens_per_step, self.prefill_cap(st),
                         self.config.chunk_size)
        return n if n <= left else 0


def make_model(config, tensors: dict[str, Tensor], device="cpu", dtype=torch.float32,
               options: FastOptions | None = None) -> FastModel:
    """FastModel, or its batch-invariant variant when `options.batch_invariant`."""
    options = check_options(options)
    return (BatchInvariantModel if options.batch_invariant else FastModel)(config, tensors, device, dtype, options)


def engine_class(options: FastOptions | None) -> type:
    """The engine that goes with these options: BatchInvariantEngine (request-only pieces) or Engine."""
    return BatchInvariantEngine if check_options(options).batch_invariant else Engine


def run_recording_logits(engine, trace, mode: str | None = None):
    """Run `trace`; returns (TraceResult, {(request, pos): logits row}) for every batch entry that samples.

    Rows come from the engine's `on_logits` hook, so CUDA-graph replays are recorded as well as eager forwards
    (logits rows follow the batch order: decode rows, then prefill pieces).
    """
    calls: list[tuple[list, Tensor]] = []
    engine.on_logits = lambda batch, logits: calls.append((list(batch), logits.detach().float().cpu().clone()))
    try:
        result = engine.run_trace(trace, mode=mode)
    finally:
        engine.on_logits = None
    rows: dict[tuple[str, int], Tensor] = {}
    for batch, logits in calls:
        for j, b in enumerate(batch):
            plen = len(engine.requests[b.request].req.prompt)
            if b.kind == "decode" or (b.kind == "prefill" and b.pos + b.count == plen):
                rows[(b.request, b.pos + b.count)] = logits[j]
    return result, rows
