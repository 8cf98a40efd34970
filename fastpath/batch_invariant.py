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

from torch import Tensor

from fastpath.engine.engine import BatchInvariantEngine, engine_class  # noqa: F401  (the mode's interface)
from fastpath.kernels.matmul import route_matmuls  # noqa: F401
from fastpath.model import BatchInvariantModel, make_model  # noqa: F401


def run_recording_logits(engine, trace, mode: str | None = None):
    """Run `trace`; returns (TraceResult, {(request, pos): logits row}) for every batch entry that samples.

    Rows come from the engine's `on_logits` hook, so CUDA-graph replays are recorded as well as eager forwards
    (logits rows follow the batch order: decode rows, then prefill pieces).
    """
    calls: list[tuple[list, list[int], Tensor]] = []

    def hook(batch, logits) -> None:            # a prompt's length as of this step: + output once resumed (§18)
        plens = [len(engine.requests[b.request].prefill_tokens) for b in batch]
        calls.append((list(batch), plens, logits.detach().float().cpu().clone()))
    engine.on_logits = hook
    try:
        result = engine.run_trace(trace, mode=mode)
    finally:
        engine.on_logits = None
    rows: dict[tuple[str, int], Tensor] = {}
    for batch, plens, logits in calls:
        for j, (b, plen) in enumerate(zip(batch, plens)):
            if b.kind == "decode" or (b.kind == "prefill" and b.pos + b.count == plen):
                rows[(b.request, b.pos + b.count)] = logits[j]
    return result, rows
