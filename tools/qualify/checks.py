"""The checks `qualify` runs on one scenario instance (DESIGN §5, §14), each a PASS / FAIL / SKIP line.

Per mode: the engine runs the trace; tokens vs the truth (tie-aware, τ from the candidate's compute dtype, with a
plausibility bound on the number of forgiven near ties); the schedule log vs the oracle's (replayed with the engine's
own tokens when they differ from the truth by forgiven near ties); logits vs the oracle's teacher-forced logits;
greedy tokens vs the engine's own logits rows (argmax, lowest index on exact ties); the speculative, prefix-cache and
batch-invariance lines; the engine's own facts line (its adapter's `facts_check` hook).
Across modes: async == legacy bitwise; task accuracy equal to the oracle's. What the adapter cannot do is a SKIP.

Every check is `check(ctx: CheckContext) -> Check | None` (None: no line for this instance), listed once in
`PER_MODE` or `ACROSS_MODES` with its line's name; `check_instance` walks those lists in order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hybridqual.adapters.base import Capabilities, Engine, RunResult, TraceAdapter, as_engine
from hybridqual.scenarios import task_traces
from hybridqual.qualify.compare import compare_bitwise, compare_logits, compare_tie_aware, tau_for, tie_bound, top_k_for
from hybridqual.qualify.context import CheckContext, OracleRows, continuation  # noqa: F401  (re-exported)
from hybridqual.qualify.truth import Truth, schedule_model
from hybridqual.qualify.truth_source import truth_for
from hybridqual.qualify.report import Check, Progress
from hybridqual.qualify.validate import describe, validate_result


def dtype_name(dtype) -> str:
    import torch
    return str(dtype or torch.float32).replace("torch.", "") + ("" if dtype else " (undeclared)")


def check_tokens(ctx: CheckContext) -> Check:
    """Tokens vs the truth, tie-aware, every request walked; fails on a non-tie difference or an implausible
    number of forgiven near ties (compare.tie_bound)."""
    trace, run, rows, tau, dtype = ctx.trace, ctx.run, ctx.rows, ctx.tau, ctx.dtype
    t0 = time.time()
    bad, ties, per_req = [], [], {}
    forgiven = eligible = 0
    rows.prefetch(trace, run.tokens)
    for req in trace.requests:
        got = run.tokens.get(req.id, [])
        v = compare_tie_aware(rows.model, req.id, req.prompt, got, req.stop_token_ids, req.max_new_tokens, tau,
                              sampling=req.sampling, oracle_logits=rows.get(req, got),
                              continue_from=ctx.continuation(req), top_k=top_k_for(dtype))
        forgiven, eligible = forgiven + len(v.near_ties), eligible + v.eligible
        per_req[req.id] = {"forgiven": len(v.near_ties), "eligible": v.eligible, "min_margin": v.min_tie_margin,
                           "exact": (v.ok and not v.near_ties) if ctx.truth.streamed else
                           got == ctx.truth.tokens[req.id]}
        ties += [f"{m.request}@{m.position}: oracle {m.oracle_token} vs {m.candidate_token}, "
                 f"gap {m.oracle_gap:.2e}, margin {m.oracle_margin:.2e}, rank {m.oracle_rank}" for m in v.near_ties]
        if not v.ok:
            f = v.failure
            bad.append(f"request {req.id} position {f.position}: oracle token {f.oracle_token} "
                       f"(margin {f.oracle_margin:.3g}) vs engine {f.candidate_token} (oracle gap {f.oracle_gap:.3g}, "
                       f"rank {f.oracle_rank} in the oracle's row)"
                       + (f" [{v.note}]" if v.note else "") if f else f"request {req.id}: {v.note}")
    bound = tie_bound(eligible, dtype, tau)
    if forgiven > bound:
        bad.append(f"implausible near-tie rate: {forgiven} forgiven of {eligible} positions with oracle margin <= τ "
                   f"(at most {bound} plausible for {dtype_name(dtype)}; compare.tie_bound)")
    summary = "; ".join(f"{r}: {d['forgiven']} near tie(s) forgiven, smallest margin {d['min_margin']:.2e}"
                        for r, d in per_req.items() if d["forgiven"])
    if bad:
        detail = "; ".join(bad) + (f"; near ties: {'; '.join(ties)}" if ties else "")
    elif ties:
        detail = f"near ties: {'; '.join(ties)}; {summary}; {forgiven} of {eligible} eligible (bound {bound})"
    else:
        detail = f"{len(trace.requests)} requests exact"
    return ctx.line(not bad, detail, time.time() - t0, requests=per_req, forgiven=forgiven, eligible=eligible,
                    bound=bound, tau=tau, dtype=dtype_name(dtype), top_k=top_k_for(dtype))


def _schedule_skip(ctx: CheckContext) -> Check | None:
    """The schedule line's SKIP (or FAIL: a declared log missing) before any replay, or None to judge the log."""
    caps = ctx.caps
    if ctx.engine.options.batch_invariant:
        return ctx.skip("batch-invariant mode cuts prefill pieces per request, not by the default policy "
                        "(docs/tp.md), so its log is not the oracle's")
    for field, flag, what in (("prefix_cache", "prefix_cache_reporting", "prefix-cache hits, stores and evictions"),
                              ("speculative", "speculation_reporting", "speculative proposals and acceptance")):
        if getattr(ctx.trace.engine, field, None) is not None and not getattr(caps, flag):
            return ctx.skip(f"the trace uses engine.{field} and the adapter does not report {what} in its log")
    if ctx.run.digest is None:
        if caps.schedule_log:
            return ctx.line(False, "the adapter declares a schedule log but returned none")
        return ctx.skip(caps.why_not("schedule_log", "the adapter keeps no schedule log"))
    return None


def check_schedule(ctx: CheckContext) -> Check:
    """The engine's schedule log vs the oracle's: the golden digest when the engine's tokens are the truth's, else
    the oracle's schedule replayed with the engine's tokens (a forgiven near-tie flip legitimately changes when a
    request stops; a scheduling bug still shows)."""
    import oracle
    from oracle.schedule_log import first_difference
    early = _schedule_skip(ctx)
    if early is not None:
        return early
    trace, run, mode = ctx.trace, ctx.run, ctx.mode
    t0 = time.time()
    exact = not ctx.truth.streamed and all(run.tokens.get(r.id, []) == ctx.truth.tokens[r.id]
                                           for r in trace.requests)
    if exact:
        want, against, want_log = ctx.truth.schedule_digest[mode], "the truth's schedule", None
    else:
        replay = oracle.run_trace(schedule_model(ctx.oracle_model), trace, mode=mode, forced_tokens=dict(run.tokens))
        if replay.tokens != {r.id: run.tokens.get(r.id, []) for r in trace.requests}:
            return ctx.line(False, "the engine's outputs break the finish rule, so no schedule of the policy "
                            "produces them", time.time() - t0)
        want, want_log = replay.digest, replay.schedule_log
        against = "the oracle's schedule replayed with the engine's tokens"
    ok = run.digest == want
    detail = f"digest {run.digest[:12]} vs {want[:12]} ({against})"
    if not ok and run.schedule_log is not None:
        want_log = want_log or oracle.run_trace(schedule_model(ctx.oracle_model), trace, mode=mode,
                                                forced_tokens=dict(run.tokens)).schedule_log   # == the truth's
        detail += f"; first difference (engine vs oracle): {first_difference(run.schedule_log, want_log)}"
    return ctx.line(ok, detail, time.time() - t0, replayed=not exact)


def check_logits(ctx: CheckContext) -> Check:
    """Every generated position's logits row vs the oracle's teacher-forced row on the engine's own tokens:
    max|Δ| <= c · max(1, std(oracle row)), c = compare.LOGITS_C[compute dtype]."""
    c, caps, run = ctx.logits_c, ctx.caps, ctx.run
    if not caps.logits:
        return ctx.skip(caps.why_not("logits", "the adapter does not return logits"))
    t0 = time.time()
    bad, worst, max_rank = [], None, 0
    for req in ctx.trace.requests:
        toks = run.tokens.get(req.id, [])
        if not toks:
            continue
        got = (run.logits or {}).get(req.id)
        if got is None:
            bad.append(f"request {req.id}: no logits returned")
            continue
        v = compare_logits(req.id, got, ctx.rows.get(req, toks), c)
        max_rank = max(max_rank, v.max_rank)
        if worst is None or v.worst_error / max(v.worst_bound, 1e-300) > worst.worst_error / max(worst.worst_bound,
                                                                                                  1e-300):
            worst = v
        if not v.ok:
            bad.append(f"request {req.id} position {v.worst_position}: max|Δlogit| {v.worst_error:.3g} > "
                       f"{v.worst_bound:.3g}" + (f" ({v.note})" if v.note else ""))
    detail = "; ".join(bad) or (f"worst {worst.request}@{worst.worst_position}: max|Δlogit| {worst.worst_error:.3g} "
                                f"<= {worst.worst_bound:.3g}" if worst else "no generated tokens")
    detail += f"; the engine's argmax ranks at most {max_rank} in the oracle's rows"
    return ctx.line(not bad, detail, time.time() - t0, c=c, max_rank=max_rank)


def check_greedy_argmax(ctx: CheckContext) -> Check | None:
    """Each greedy token is the argmax of the logits row it was sampled from, the lowest index among exact maxima
    (DESIGN §6): the engine judged against its own rows, bit for bit, so no tolerance forgives a wrong tie rule or
    a token taken from other logits than the ones returned. No line when the adapter returns no logits (the logits
    line says so) or the trace has no greedy request."""
    run = ctx.run
    greedy = [r for r in ctx.trace.requests if r.sampling.kind == "greedy" and run.tokens.get(r.id)]
    if not ctx.caps.logits or not greedy:
        return None
    t0 = time.time()
    bad, ties, rows = [], 0, 0
    for req in greedy:
        got = (run.logits or {}).get(req.id)
        if got is None:
            bad.append(f"request {req.id}: no logits returned")
            continue
        for i, tok in enumerate(run.tokens[req.id]):
            row = got[i]
            top = row.max()
            maxima = (row == top).nonzero().flatten()
            rows, ties = rows + 1, ties + (len(maxima) > 1)
            if row[tok] != top:
                bad.append(f"request {req.id} position {i}: token {tok} has logit {float(row[tok]):.6g}, below its "
                           f"row's maximum {float(top):.6g} (token {int(maxima[0])})")
            elif int(maxima[0]) != tok:
                bad.append(f"request {req.id} position {i}: token {tok} ties the row's maximum with "
                           f"{', '.join(str(int(m)) for m in maxima[:6])}; the lowest index {int(maxima[0])} "
                           "wins a tie")
    detail = "; ".join(bad[:8]) + (f"; ... {len(bad) - 8} more" if len(bad) > 8 else "") if bad else \
        f"{rows} greedy positions, {ties} of them exact ties"
    return ctx.line(not bad, detail, time.time() - t0, positions=rows, exact_ties=ties)


def check_engine_facts(ctx: CheckContext) -> Check | None:
    """The engine's own schedule facts, judged by its adapter's `facts_check` hook (None: the adapter has none)."""
    return ctx.engine.facts_check(ctx)


def check_modes_equal(ctx: CheckContext) -> Check | None:
    """async == legacy bitwise, when both modes were asked for."""
    modes, caps, runs = ctx.modes, ctx.caps, ctx.runs
    if not ("legacy" in modes and "async" in modes):
        return None
    if "async" not in caps.modes:
        return ctx.skip(caps.why_not("async", "the adapter has no distinct async mode"))
    missing = [m for m in ("legacy", "async") if m not in runs]
    if missing:
        return ctx.skip(f"no {' and '.join(missing)} run to compare (see the lines above)")
    diffs = compare_bitwise(runs["legacy"].tokens, runs["async"].tokens)
    return ctx.line(not diffs, "; ".join(diffs) or "identical")


def check_task(ctx: CheckContext) -> Check | None:
    """Task accuracy identical in every mode and to the oracle's; skipped when the oracle itself scores 0. With a
    streamed truth the oracle's outputs are the engine's where the tokens check proved them its choices at every
    position (ctx.truth.tokens, filled by check_instance); otherwise skipped."""
    trace, runs, truth = ctx.trace, ctx.runs, ctx.truth
    if not runs or not task_traces.is_task_trace(trace):
        return None
    unknown = [r.id for r in trace.requests if r.id not in truth.tokens]
    if unknown:
        return ctx.skip("streamed truth: the oracle's own outputs are known only where the engine's tokens are its "
                        "choices at every position in every mode (not for "
                        f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''})")
    want = task_traces.task_accuracy(trace, truth.tokens)
    if want == 0:
        return ctx.skip("the model cannot do the task (the oracle's accuracy is 0.000)")
    got = {mode: task_traces.task_accuracy(trace, run.tokens) for mode, run in runs.items()}
    return ctx.line(all(a == want for a in got.values()),
                    f"oracle {want:.3f}; " + ", ".join(f"{m} {a:.3f}" for m, a in got.items()))


def _speculation(ctx: CheckContext) -> Check | None:
    from hybridqual.qualify.spec_checks import qualify_check           # speculative traces only (DESIGN §13)
    return qualify_check(ctx)


def _prefix_cache(ctx: CheckContext) -> Check | None:
    from hybridqual.qualify.prefix_checks import qualify_check        # prefix-cache traces only (DESIGN §12)
    return qualify_check(ctx)


def _shape(ctx: CheckContext) -> Check | None:
    from hybridqual.qualify.shape_checks import check_shape            # instances that promise a shape
    return check_shape(ctx)


def _repeat(ctx: CheckContext) -> Check | None:
    from hybridqual.qualify.repeat_checks import check_repeat          # every engine
    return check_repeat(ctx)


def _alone(ctx: CheckContext) -> Check | None:
    from hybridqual.qualify.repeat_checks import check_alone           # every engine
    return check_alone(ctx)


def _batch_invariant(ctx: CheckContext) -> Check | None:
    from hybridqual.qualify.invariance_checks import qualify_check    # batch-invariant engines
    return qualify_check(ctx)


@dataclass(frozen=True)
class QualifyCheck:
    """A check as the registry lists it: its key, its line's name (a format string over the context: {mode},
    {tau}, {logits_c}), and the function judging it."""
    key: str
    title: str
    judge: Callable[[CheckContext], Check | None]

    def name(self, ctx: CheckContext) -> str:
        """The line's name for this context (its part before " (" when a figure in it cannot be had)."""
        try:
            return self.title.format(mode=ctx.mode, tau=ctx.tau,
                                     logits_c=ctx.logits_c if "{logits_c" in self.title else None)
        except (KeyError, ValueError, TypeError):
            return self.title.split(" (")[0].format(mode=ctx.mode)


PER_MODE: tuple[QualifyCheck, ...] = (
    QualifyCheck("tokens", "{mode}: tokens match the truth (tie-aware, τ={tau:g})", check_tokens),
    QualifyCheck("schedule", "{mode}: schedule log matches the oracle's", check_schedule),
    QualifyCheck("logits", "{mode}: logits match the oracle's (max|Δ| <= {logits_c:g}·max(1, std))", check_logits),
    QualifyCheck("greedy_argmax", "{mode}: greedy tokens are their logits rows' argmax (lowest index on ties)",
                 check_greedy_argmax),
    QualifyCheck("speculation", "{mode}: accepted counts recomputed from the logged proposals", _speculation),
    QualifyCheck("prefix_cache", "{mode}: prefix cache events as the policy predicts", _prefix_cache),
    QualifyCheck("batch_invariant", "{mode}: batch-invariant: each request alone gives the same tokens and logits, "
                 "bitwise", _batch_invariant),
    QualifyCheck("engine_facts", "{mode}: engine schedule facts", check_engine_facts),
    QualifyCheck("shape", "{mode}: the short last pieces the step rule promises happened", _shape),
)
ACROSS_MODES: tuple[QualifyCheck, ...] = (
    QualifyCheck("modes_equal", "async == legacy, bitwise", check_modes_equal),
    QualifyCheck("task", "task accuracy identical in every mode and to the oracle's", check_task),
    QualifyCheck("repeat", "the same trace run twice gives the same tokens", _repeat),
    QualifyCheck("alone", "a request alone gives its tokens in the batch", _alone),
)
REGISTRY: dict[str, QualifyCheck] = {c.key: c for c in PER_MODE + ACROSS_MODES}


def run_check(key: str, ctx: CheckContext) -> Check | None:
    """Check `key` of the registry on `ctx` under its declared name; a FAIL line with the exception when it raises
    (e.g. the engine crashing on a continuation), never a lost report."""
    spec = REGISTRY[key]
    ctx = ctx.named(spec.name(ctx))
    try:
        return spec.judge(ctx)
    except Exception as e:  # noqa: BLE001  (a check that cannot finish is a failed check, not a lost report)
        return ctx.line(False, f"the check raised {type(e).__name__}: {e}")
    except SystemExit as e:     # an adapter's sys.exit inside a check (a continuation run): a FAIL, not the end
        return ctx.line(False, f"the adapter called sys.exit({e.code!r})")


def context(engine: Engine | type[TraceAdapter] | None, model_dir: Path, trace, oracle_model, device: str = "cpu",
            tau: float | None = None, truth: Truth | None = None, label: str = "", modes=("legacy",),
            caps: Capabilities | None = None, **per_mode) -> CheckContext:
    """A CheckContext with the defaults filled in (the engine's capabilities unless `caps`, τ of the compute dtype,
    an empty truth); `per_mode`: mode, run, runs. A check that builds no adapter may be given no engine."""
    engine = as_engine(engine) if engine is not None else None
    caps = caps if caps is not None else engine.capabilities(device)
    return CheckContext(label, Path(model_dir), trace, engine, device, oracle_model,
                        truth if truth is not None else Truth(""), tau_for(caps.compute_dtype) if tau is None else tau,
                        caps, tuple(modes), **per_mode)


TRANSFER_SKIP = ("the adapter does not declare state_transfer: it cannot hand a request and its state to another engine "
                 "instance (DESIGN §19)")


def run_mode(ctx: CheckContext, add: Callable[[Check | None], None]) -> RunResult | None:
    """One mode's run: the engine runs the trace (a SKIP line when the mode or a sampling kind is outside its
    capabilities, a FAIL line when it raises or returns a malformed result). Returns the validated run, or None."""
    caps, trace, mode = ctx.caps, ctx.trace, ctx.mode
    name = f"{mode}: engine runs the trace"
    kinds = sorted({r.sampling.kind for r in trace.requests} - set(caps.sampling_kinds))
    if mode not in caps.modes:
        add(Check.skip(ctx.label, name, caps.why_not(mode, f"the adapter does not declare mode {mode!r}")))
        return None
    moved = [r.id for r in trace.requests if r.transfer]
    if moved and not caps.state_transfer:           # DESIGN §19
        add(Check.skip(ctx.label, name, f"{caps.why_not('state_transfer', TRANSFER_SKIP)} (transfers: "
                       f"{', '.join(moved)})"))
        return None
    if kinds:
        users = [r.id for r in trace.requests if r.sampling.kind in kinds]
        add(Check.skip(ctx.label, name, f"{caps.why_not(kinds[0], 'unsupported sampling')} (the adapter supports "
                       f"{', '.join(caps.sampling_kinds)}; {', '.join(kinds)} used by {', '.join(users)})"))
        return None
    t0 = time.time()
    try:
        run = ctx.engine(ctx.model_dir, trace, mode, ctx.device).run_trace()
    except Exception as e:  # an engine crash is a failed check with its message, not a traceback
        add(Check.of(ctx.label, name, False, f"{type(e).__name__}: {e}", time.time() - t0))
        return None
    except SystemExit as e:     # sys.exit(any code) inside the adapter ends its run, not qualify's
        add(Check.of(ctx.label, name, False, f"SystemExit: the adapter called sys.exit({e.code!r})",
                     time.time() - t0))
        return None
    run, problems = validate_result(trace, run, ctx.vocab)
    if problems:        # the boundary: nothing malformed reaches a check (hybridqual.qualify.validate)
        add(Check.of(ctx.label, f"{mode}: engine result is well-formed", False, describe(problems),
                     time.time() - t0, problems=problems[:50]))
        return None
    return run


def check_instance(adapter: Engine | type[TraceAdapter], model_dir: Path, inst, modes: list[str], oracle_model,
                   device: str, tau: float | None = None, progress: Progress | None = None,
                   on_check: Callable[[Check], None] | None = None, truth: Truth | None = None,
                   label: str | None = None) -> list[Check]:
    """Every check for one scenario instance, in the registry's order; `adapter` an Engine or an adapter class
    (default options); `tau` None follows the adapter's compute dtype; `label` names it in the report (default
    model/scenario)."""
    label = label or f"{model_dir.name}/{inst.scenario}"
    progress = progress or Progress(quiet=True)
    checks: list[Check] = []

    def add(c: Check | None) -> None:
        if c is not None:
            checks.append(c)
            progress.check(c)
            if on_check:
                on_check(c)
    if inst.trace is None:
        add(Check.skip(label, "scenario runs on this model", inst.skip_reason or "no concrete trace"))
        return checks
    ctx = context(adapter, model_dir, inst.trace, oracle_model, device, tau,
                  truth or truth_for(model_dir, inst, oracle_model), label, modes, shape=getattr(inst, "shape", None))
    proven = None       # request -> tokens shown to be the oracle's own (streamed truth)
    for mode in modes:
        started = progress.start(f"{label} · {mode}")
        before = len(checks)
        run = run_mode(ctx.for_mode(mode), add)
        if run is not None:
            ctx.runs[mode] = run
            per = ctx.for_mode(mode, run)
            for spec in PER_MODE:
                c = run_check(spec.key, per)
                add(c)
                if spec.key == "tokens":
                    mine = {rid: run.tokens.get(rid, []) for rid, d in c.data.get("requests", {}).items()
                            if c.passed and d["exact"]}
                    proven = mine if proven is None else {r: t for r, t in proven.items() if mine.get(r) == t}
        progress.end(f"{label} · {mode}", started, checks[before:])
    if ctx.truth.streamed:
        ctx.truth = ctx.truth.with_tokens(proven or {})
    for spec in ACROSS_MODES:
        add(run_check(spec.key, ctx.for_mode(None)))
    return checks
