"""Repeatability checks any engine can be given (vLLM #57267: the same greedy prompts, run again, gave other tokens).

    check_repeat(ctx)   # the same trace run twice: bitwise where the engine promises determinism
                        # (Capabilities.deterministic), else equal up to near ties of the oracle and logits rows
                        # within the engine's declared precision
    check_alone(ctx)    # a co-arriving request run alone vs its run in the batch: equal up to near ties of the
                        # oracle (a batch-invariant engine's bitwise form is hybridqual.qualify.invariance_checks)

Both run once per instance, in the first mode that ran (across-modes entries of the registry), so they cost one more
run of the trace and ALONE_MAX one-request runs.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from hybridqual.qualify.context import CheckContext
from hybridqual.qualify.invariance_checks import alone, row_difference
from hybridqual.qualify.report import Check
from hybridqual.qualify.validate import describe, validate_result

ALONE_MAX = 1        # requests run alone per instance (the main job's time budget)


def _first_run(ctx: CheckContext):
    """(mode, run) of the first mode that ran, or (None, None)."""
    for mode in ctx.modes:
        if mode in ctx.runs:
            return mode, ctx.runs[mode]
    return None, None


def _divergence(ctx: CheckContext, req, a: list[int], b: list[int]) -> str | None:
    """Why two token lists of `req` differ beyond a near tie of the oracle (None: equal, or first differing where
    the oracle's logits of the two tokens are within τ, teacher-forced on the common prefix)."""
    if a == b:
        return None
    p = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if p >= min(len(a), len(b)):
        return f"{req.id}: {len(a)} vs {len(b)} tokens, equal up to position {p}"
    row = ctx.rows.get(req, a[:p + 1])[p]
    gap = float((row[a[p]] - row[b[p]]).abs())
    if gap < ctx.tau:
        return None
    return (f"{req.id} position {p}: token {a[p]} vs {b[p]}, the oracle's logits of the two {gap:.3g} apart "
            f"(τ={ctx.tau:g}: not a near tie)")


def _run(ctx: CheckContext, trace, mode: str):
    """The engine's validated result on `trace` (raises ValueError naming the problems of a malformed one)."""
    res, problems = validate_result(trace, ctx.engine(ctx.model_dir, trace, mode, ctx.device).run_trace(), ctx.vocab)
    if problems:
        raise ValueError(describe(problems))
    return res


def check_repeat(ctx: CheckContext) -> Check | None:
    """The same trace run twice by the engine (see the module docstring)."""
    mode, first = _first_run(ctx)
    if first is None:
        return None
    t0 = time.time()
    second = _run(ctx, ctx.trace, mode)
    det = bool(getattr(ctx.caps, "deterministic", False))
    bad = []
    for req in ctx.trace.requests:
        a, b = first.tokens.get(req.id, []), second.tokens.get(req.id, [])
        la = (first.logits or {}).get(req.id)
        lb = (second.logits or {}).get(req.id)
        if det:
            if a != b:
                bad.append(f"{req.id}: tokens {a} then {b}")
            elif (diff := row_difference(la, lb)) is not None:
                bad.append(f"{req.id}: logits {diff}")
            continue
        if (why := _divergence(ctx, req, a, b)) is not None:
            bad.append(why)
        elif la is not None and lb is not None and a == b:
            d = (la.double() - lb.double()).abs().amax(-1)
            scale = torch.clamp(la.double().std(-1), min=1.0)
            if bool((d > ctx.logits_c * scale).any()):
                p = int((d > ctx.logits_c * scale).nonzero()[0, 0])
                bad.append(f"{req.id} position {p}: max|Δlogit| {float(d[p]):.3g} between the runs "
                           f"> {ctx.logits_c:g}·max(1, std)")
    how = "bitwise (the engine declares determinism)" if det else "up to near ties and the declared precision"
    if bad:
        return ctx.line(False, f"{mode}, run twice, {how}: " + "; ".join(bad[:4]), time.time() - t0)
    return ctx.line(True, f"{mode}, run twice: {len(ctx.trace.requests)} requests the same, {how}", time.time() - t0)


def _co_arriving(trace) -> list:
    """Requests that arrive in the same step as another, in (arrival_step, id) order (else every request)."""
    reqs = sorted(trace.requests, key=lambda r: (r.arrival_step, r.id))
    steps = [r.arrival_step for r in reqs]
    shared = [r for r in reqs if steps.count(r.arrival_step) > 1]
    return shared or reqs


def solo_trace(trace, request_id: str):
    """The trace with only `request_id`, arriving at step 0; a scripted proposer keeps that request's drafts only
    (its other entries would name requests the trace no longer has)."""
    one = alone(trace, request_id)
    spec = getattr(one.engine, "speculative", None)
    if spec is not None and spec.proposer.kind == "scripted":
        mine = tuple((r, per) for r, per in spec.proposer.proposals if r == request_id)
        spec = dataclasses.replace(spec, proposer=dataclasses.replace(spec.proposer, proposals=mine))
        one = dataclasses.replace(one, engine=dataclasses.replace(one.engine, speculative=spec))
    return one


def _not_alone(ctx: CheckContext, trace) -> str | None:
    """Why a one-request trace cut from another does not fit the model (None: it does)."""
    from oracle.speculative import check_speculative
    from oracle.trace import TraceError, check_against_model
    try:
        check_against_model(trace, ctx.vocab, ctx.oracle_model.config.chunk_size)
        if getattr(trace.engine, "speculative", None) is not None:
            check_speculative(trace, ctx.vocab, ctx.oracle_model.config.chunk_size)
    except TraceError as e:
        return str(e)
    return None


def check_alone(ctx: CheckContext) -> Check | None:
    """A request alone vs in the batch (see the module docstring)."""
    mode, first = _first_run(ctx)
    if first is None:
        return None
    if len(ctx.trace.requests) < 2:
        return ctx.skip("one request: nothing shares its steps")
    bad, picked, t0 = [], _co_arriving(ctx.trace)[:ALONE_MAX], time.time()
    for req in picked:
        one = solo_trace(ctx.trace, req.id)
        why = _not_alone(ctx, one)
        if why is not None:
            return ctx.skip(f"{req.id} alone is no valid trace: {why}")
        solo = _run(ctx, one, mode)
        why = _divergence(ctx, req, first.tokens.get(req.id, []), solo.tokens.get(req.id, []))
        if why is not None:
            bad.append(why)
    names = ", ".join(r.id for r in picked)
    if bad:
        return ctx.line(False, f"{mode}, alone vs in the batch ({names}): " + "; ".join(bad), time.time() - t0)
    return ctx.line(True, f"{mode}: {names} alone gives its tokens in the batch (up to near ties of the oracle)",
                    time.time() - t0)
