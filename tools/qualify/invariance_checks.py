"""The batch-invariance check: an engine that declares `Capabilities.batch_invariant` promises that a request's
tokens and logits do not depend on what shares its steps, so each request run alone must give the same bits.

    qualify_check(ctx)    # a Check, or None (not claimed); ctx: hybridqual.qualify.context.CheckContext
"""
from __future__ import annotations

import dataclasses
import time

import torch

from hybridqual.qualify.report import Check
from hybridqual.qualify.validate import describe, validate_result



def alone(trace, request_id: str):
    """The trace with only request `request_id`, arriving at step 0 (same engine configuration)."""
    req = dataclasses.replace(trace.request(request_id), arrival_step=0)
    return dataclasses.replace(trace, requests=(req,))


def row_difference(a: torch.Tensor | None, b: torch.Tensor | None) -> str | None:
    """Where two logits blocks [positions, vocab] first differ in any bit (None: equal, or either is missing)."""
    if a is None or b is None:
        return None
    if a.shape != b.shape:
        return f"logits shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"logits dtype {a.dtype} vs {b.dtype}"
    rows = a.shape[0]                    # bytes per row compared, whatever the dtype (-0.0 is not 0.0)
    same = (a.contiguous().view(torch.uint8).view(rows, -1) == b.contiguous().view(torch.uint8).view(rows, -1)).all(1)
    if bool(same.all()):
        return None
    p = int((~same).nonzero()[0, 0])
    return f"position {p}: max|Δlogit| {float((a[p] - b[p]).abs().max()):.3g} (bits differ)"


def qualify_check(ctx) -> Check | None:
    """Each request of the trace run alone vs its run in the trace: tokens equal, logits rows equal bit for bit
    (ctx: hybridqual.qualify.context.CheckContext; None when the engine does not claim batch invariance)."""
    trace, run = ctx.trace, ctx.run
    if not getattr(ctx.caps, "batch_invariant", False):
        return None
    if len(trace.requests) < 2:
        return ctx.skip("one request: nothing shares its steps")
    if trace.engine.prefix_cache is not None:
        return ctx.skip("a prefix-cache trace: a request alone does not hit the entries the others stored, so its "
                        "pieces differ by design")
    t0, bad = time.time(), []
    for req in trace.requests:
        solo = alone(trace, req.id)
        got, problems = validate_result(solo, ctx.engine(ctx.model_dir, solo, ctx.mode, ctx.device).run_trace(),
                                        ctx.vocab)
        if problems:
            bad.append(f"{req.id} alone: {describe(problems)}")
            continue
        want = run.tokens.get(req.id, [])
        if got.tokens[req.id] != want:
            first = next((i for i, (x, y) in enumerate(zip(got.tokens[req.id], want)) if x != y),
                         min(len(want), len(got.tokens[req.id])))
            bad.append(f"{req.id}: tokens differ from position {first} (alone {got.tokens[req.id][first:first + 3]}"
                       f" vs in the trace {want[first:first + 3]})")
            continue
        diff = row_difference((got.logits or {}).get(req.id), (run.logits or {}).get(req.id))
        if diff:
            bad.append(f"{req.id}: {diff}")
    detail = "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else "") if bad else \
        f"{len(trace.requests)} requests alone: tokens and logits identical"
    return ctx.line(not bad, detail, time.time() - t0)
