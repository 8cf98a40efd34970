"""The batch-invariance check: an engine that declares `Capabilities.batch_invariant` promises that a request's
tokens and logits do not depend on what shares its steps, so each request run alone must give the same bits.

    qualify_check(label, mode, trace, run, adapter_cls, model_dir, device, vocab)   # a Check, or None (not claimed)
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from hybridqual.qualify.report import Check
from hybridqual.qualify.validate import describe, validate_result

NAME = "batch-invariant: each request alone gives the same tokens and logits, bitwise"


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


def qualify_check(label: str, mode: str, trace, run, adapter_cls, model_dir: Path, device: str,
                  vocab: int) -> Check | None:
    """Each request of the trace run alone vs its run in the trace: tokens equal, logits rows equal bit for bit."""
    caps = adapter_cls.capabilities(device)
    if not getattr(caps, "batch_invariant", False):
        return None
    name = f"{mode}: {NAME}"
    if len(trace.requests) < 2:
        return Check.skip(label, name, "one request: nothing shares its steps")
    if trace.engine.prefix_cache is not None:
        return Check.skip(label, name, "a prefix-cache trace: a request alone does not hit the entries the others "
                                       "stored, so its pieces differ by design")
    t0, bad = time.time(), []
    for req in trace.requests:
        solo = alone(trace, req.id)
        got, problems = validate_result(solo, adapter_cls(model_dir, solo, mode, device).run_trace(), vocab)
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
    return Check.of(label, name, not bad, detail, time.time() - t0)
