"""The checks `qualify` runs on one scenario instance (DESIGN §5, §14), each a PASS / FAIL / SKIP line.

Per mode: the engine runs the trace; tokens vs the truth (tie-aware, τ from the candidate's compute dtype, with a
plausibility bound on the number of forgiven near ties); the schedule log vs the oracle's (replayed with the engine's
own tokens when they differ from the truth by forgiven near ties); logits vs the oracle's teacher-forced logits;
greedy tokens vs the engine's own logits rows (argmax, lowest index on exact ties).
Across modes: async == legacy bitwise; task accuracy equal to the oracle's. What the adapter cannot do is a SKIP.
"""
from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from hybridqual import adapters
from hybridqual.goldens import regen as goldens
from hybridqual.scenarios import task_traces
from hybridqual.qualify.compare import (LOGITS_C, compare_bitwise, compare_logits, compare_tie_aware, tau_for, teacher_forced_logits,
                      tie_bound, top_k_for)
from hybridqual.qualify.truth import is_streamed, schedule_model
from hybridqual.qualify.report import Check, Progress
from hybridqual.qualify.validate import describe, validate_result


@lru_cache(maxsize=None)
def _model_sha(model_dir: str) -> str:
    return goldens.model_sha256(Path(model_dir))


def truth_for(model_dir: Path, inst, oracle_model) -> dict:
    """The shipped golden for (model sha256, trace sha256) when both match and it passes its schema and content
    hash (hybridqual.goldens.record.check_golden), else the oracle's record computed now; "source" says which, and
    why a shipped golden was not used ("golden_rejected": a golden that failed its checks, shown on the console)."""
    path = goldens.OUTPUTS / model_dir.name / f"{inst.scenario}.json"
    why, rejected = "no shipped golden for this model and scenario", None
    if path.exists() and getattr(oracle_model, "use_goldens", True):
        try:
            g = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            g, why = None, f"shipped golden {path.name} unreadable ({e})"
        problems = goldens.check_golden(g) if g is not None else []
        if not problems and g is not None and g["model_sha256"] == _model_sha(str(model_dir)) and \
                g["trace_sha256"] == goldens.trace_sha256(inst.trace):     # its requests, against this very trace
            problems = goldens.check_golden(g, inst.trace, oracle_model.config.vocab_size)
        if problems:        # a golden that breaks its schema or its own hash is never the truth: said, recomputed
            g, why = None, (f"shipped golden {path.name} rejected ({'; '.join(problems[:3])}"
                            f"{'; ...' if len(problems) > 3 else ''})")
            rejected = why
        if g is not None:
            if g.get("model_sha256") != _model_sha(str(model_dir)):
                why = f"shipped golden {path.name} is for other model weights (model sha256 differs)"
            elif g.get("trace_sha256") != goldens.trace_sha256(inst.trace):
                why = f"shipped golden {path.name} is for another trace (trace sha256 differs)"
            else:
                g["source"] = f"golden {path.name} (model and trace sha256 match)"
                return g
    if is_streamed(oracle_model):       # no generation: the engine's own tokens are scored (qualify_truth)
        return {"streamed": True, "requests": {}, "source": f"streamed fp64 oracle ({oracle_model.why}): the "
                "engine's tokens scored teacher-forced, the schedule replayed with them"
                + (f" ({rejected})" if rejected else ""), **({"golden_rejected": rejected} if rejected else {})}
    g = goldens.golden_for_trace(oracle_model, model_dir, inst.trace, inst.scenario)
    g["source"] = f"oracle fp64, computed now: {why}"
    if rejected:
        g["golden_rejected"] = rejected
    return g


def continuation(adapter_cls, model_dir: Path, trace, req, device: str,
                 vocab_size: int | None = None) -> Callable[[list[int]], list[int]]:
    """Teacher forcing for the tie-aware check: the engine's own continuation after prompt + the oracle's prefix,
    from a one-request trace through the same engine (its prefix becomes part of the prompt); its result is
    validated as the main run's (hybridqual.qualify.validate), a malformed one raises (the check's FAIL line)."""
    from oracle.trace import parse_trace

    def run(prefix: list[int]) -> list[int]:
        left = req.max_new_tokens - len(prefix)
        if left <= 0 or (prefix and prefix[-1] in req.stop_token_ids):
            return []
        one = parse_trace({"schema": "hybridqual.trace/1", "engine": trace.engine.to_json(),
                           "requests": [{"id": req.id, "arrival_step": 0, "prompt": list(req.prompt) + list(prefix),
                                         "max_new_tokens": left, "stop_token_ids": list(req.stop_token_ids),
                                         "sampling": req.sampling.to_json()}]})
        try:
            res = adapter_cls(model_dir, one, "legacy", device).run_trace()
        except SystemExit as e:
            raise RuntimeError(f"the adapter called sys.exit({e.code!r}) on a continuation trace") from None
        if vocab_size is not None:
            res, problems = validate_result(one, res, vocab_size)
            if problems:
                raise ValueError(f"the engine's result on a continuation trace (prompt + {len(prefix)} tokens) is "
                                 f"malformed: {describe(problems)}")
        return res.tokens[req.id]
    return run


class OracleRows:
    """The oracle's teacher-forced logits for (request, tokens), computed once and shared by the checks."""

    def __init__(self, model) -> None:
        self.model, self.cache = model, {}
        if hasattr(model, "clear"):       # a streamed oracle's prefetched sequences of an earlier instance
            model.clear()

    def prefetch(self, trace, tokens: dict[str, list[int]]) -> None:
        """A streamed oracle scores every request of a run in one pass (instead of one pass per request)."""
        if hasattr(self.model, "prefetch"):
            self.model.prefetch([(r.prompt, tokens.get(r.id, [])) for r in trace.requests])

    def get(self, req, tokens: list[int]) -> torch.Tensor:
        key = (req.id, tuple(tokens))
        if key not in self.cache:
            self.cache[key] = teacher_forced_logits(self.model, req.prompt, list(tokens))
        return self.cache[key]


def dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).replace("torch.", "") + ("" if dtype else " (undeclared)")


def check_tokens(label: str, mode: str, trace, truth: dict, run, rows: OracleRows, cont, tau: float,
                 dtype: torch.dtype | None) -> Check:
    """Tokens vs the truth, tie-aware, every request walked; fails on a non-tie difference or an implausible
    number of forgiven near ties (compare.tie_bound)."""
    t0 = time.time()
    bad, ties, per_req = [], [], {}
    forgiven = eligible = 0
    rows.prefetch(trace, run.tokens)
    for req in trace.requests:
        got = run.tokens.get(req.id, [])
        v = compare_tie_aware(rows.model, req.id, req.prompt, got, req.stop_token_ids, req.max_new_tokens, tau,
                              sampling=req.sampling, oracle_logits=rows.get(req, got), continue_from=cont(req),
                              top_k=top_k_for(dtype))
        forgiven, eligible = forgiven + len(v.near_ties), eligible + v.eligible
        per_req[req.id] = {"forgiven": len(v.near_ties), "eligible": v.eligible, "min_margin": v.min_tie_margin,
                           "exact": (v.ok and not v.near_ties) if truth.get("streamed") else
                           got == truth["requests"][req.id]["tokens"]}
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
    return Check.of(label, f"{mode}: tokens match the truth (tie-aware, τ={tau:g})", not bad,
                    detail, time.time() - t0, requests=per_req, forgiven=forgiven, eligible=eligible, bound=bound,
                    tau=tau, dtype=dtype_name(dtype), top_k=top_k_for(dtype))


def check_schedule(label: str, mode: str, trace, truth: dict, run, oracle_model, caps, batch_invariant: bool) -> Check:
    """The engine's schedule log vs the oracle's: the golden digest when the engine's tokens are the truth's, else
    the oracle's schedule replayed with the engine's tokens (a forgiven near-tie flip legitimately changes when a
    request stops; a scheduling bug still shows)."""
    import oracle
    from oracle.schedule_log import first_difference
    name = f"{mode}: schedule log matches the oracle's"
    if batch_invariant:
        return Check.skip(label, name, "batch-invariant mode cuts prefill pieces per request, not by the default "
                                       "policy (docs/tp.md), so its log is not the oracle's")
    for field, flag, what in (("prefix_cache", "prefix_cache_reporting", "prefix-cache hits, stores and evictions"),
                              ("speculative", "speculation_reporting", "speculative proposals and acceptance")):
        if getattr(trace.engine, field, None) is not None and not getattr(caps, flag):
            return Check.skip(label, name, f"the trace uses engine.{field} and the adapter does not report {what} "
                                           "in its log")
    if run.digest is None:
        if caps.schedule_log:
            return Check.of(label, name, False, "the adapter declares a schedule log but returned none")
        return Check.skip(label, name, caps.why_not("schedule_log", "the adapter keeps no schedule log"))
    t0 = time.time()
    exact = not truth.get("streamed") and all(run.tokens.get(r.id, []) == truth["requests"][r.id]["tokens"]
                                              for r in trace.requests)
    if exact:
        want, against, want_log = truth["schedule_digest"][mode], "the truth's schedule", None
    else:
        replay = oracle.run_trace(schedule_model(oracle_model), trace, mode=mode, forced_tokens=dict(run.tokens))
        if replay.tokens != {r.id: run.tokens.get(r.id, []) for r in trace.requests}:
            return Check.of(label, name, False, "the engine's outputs break the finish rule, so no schedule of the "
                            "policy produces them", time.time() - t0)
        want, want_log = replay.digest, replay.schedule_log
        against = "the oracle's schedule replayed with the engine's tokens"
    ok = run.digest == want
    detail = f"digest {run.digest[:12]} vs {want[:12]} ({against})"
    if not ok and run.schedule_log is not None:
        want_log = want_log or oracle.run_trace(schedule_model(oracle_model), trace, mode=mode,
                                                forced_tokens=dict(run.tokens)).schedule_log   # == the truth's
        detail += f"; first difference (engine vs oracle): {first_difference(run.schedule_log, want_log)}"
    return Check.of(label, name, ok, detail, time.time() - t0, replayed=not exact)


def check_logits(label: str, mode: str, trace, run, rows: OracleRows, caps) -> Check:
    """Every generated position's logits row vs the oracle's teacher-forced row on the engine's own tokens:
    max|Δ| <= c · max(1, std(oracle row)), c = compare.LOGITS_C[compute dtype]."""
    c = LOGITS_C[caps.compute_dtype or torch.float32]
    name = f"{mode}: logits match the oracle's (max|Δ| <= {c:g}·max(1, std))"
    if not caps.logits:
        return Check.skip(label, name, caps.why_not("logits", "the adapter does not return logits"))
    t0 = time.time()
    bad, worst, max_rank = [], None, 0
    for req in trace.requests:
        toks = run.tokens.get(req.id, [])
        if not toks:
            continue
        got = (run.logits or {}).get(req.id)
        if got is None:
            bad.append(f"request {req.id}: no logits returned")
            continue
        v = compare_logits(req.id, got, rows.get(req, toks), c)
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
    return Check.of(label, name, not bad, detail, time.time() - t0, c=c, max_rank=max_rank)


def check_greedy_argmax(label: str, mode: str, trace, run, caps) -> Check | None:
    """Each greedy token is the argmax of the logits row it was sampled from, the lowest index among exact maxima
    (DESIGN §6): the engine judged against its own rows, bit for bit, so no tolerance forgives a wrong tie rule or
    a token taken from other logits than the ones returned. No line when the adapter returns no logits (the logits
    line says so) or the trace has no greedy request."""
    greedy = [r for r in trace.requests if r.sampling.kind == "greedy" and run.tokens.get(r.id)]
    if not caps.logits or not greedy:
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
                           f"{', '.join(str(int(m)) for m in maxima[:6])}; the lowest index {int(maxima[0])} wins a tie")
    detail = "; ".join(bad[:8]) + (f"; ... {len(bad) - 8} more" if len(bad) > 8 else "") if bad else \
        f"{rows} greedy positions, {ties} of them exact ties"
    return Check.of(label, f"{mode}: greedy tokens are their logits rows' argmax (lowest index on ties)", not bad,
                    detail, time.time() - t0, positions=rows, exact_ties=ties)


def check_modes_equal(label: str, runs: dict, caps, modes: list[str]) -> Check | None:
    """async == legacy bitwise, when both modes were asked for."""
    if not ("legacy" in modes and "async" in modes):
        return None
    name = "async == legacy, bitwise"
    if "async" not in caps.modes:
        return Check.skip(label, name, caps.why_not("async", "the adapter has no distinct async mode"))
    missing = [m for m in ("legacy", "async") if m not in runs]
    if missing:
        return Check.skip(label, name, f"no {' and '.join(missing)} run to compare (see the lines above)")
    diffs = compare_bitwise(runs["legacy"].tokens, runs["async"].tokens)
    return Check.of(label, name, not diffs, "; ".join(diffs) or "identical")


def check_task(label: str, trace, truth: dict, runs: dict) -> Check | None:
    """Task accuracy identical in every mode and to the oracle's; skipped when the oracle itself scores 0. With a
    streamed truth the oracle's outputs are the engine's where the tokens check proved them its choices at every
    position (truth["requests"], filled by check_instance); otherwise skipped."""
    if not runs or not task_traces.is_task_trace(trace):
        return None
    name = "task accuracy identical in every mode and to the oracle's"
    unknown = [r.id for r in trace.requests if r.id not in truth["requests"]]
    if unknown:
        return Check.skip(label, name, "streamed truth: the oracle's own outputs are known only where the engine's "
                          "tokens are its choices at every position in every mode (not for "
                          f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''})")
    want = task_traces.task_accuracy(trace, {r: g["tokens"] for r, g in truth["requests"].items()})
    if want == 0:
        return Check.skip(label, name, "the model cannot do the task (the oracle's accuracy is 0.000)")
    got = {mode: task_traces.task_accuracy(trace, run.tokens) for mode, run in runs.items()}
    return Check.of(label, name, all(a == want for a in got.values()),
                    f"oracle {want:.3f}; " + ", ".join(f"{m} {a:.3f}" for m, a in got.items()))


def guarded(label: str, name: str, fn, *args) -> Check:
    """fn(*args), or a FAIL line with the exception when it raises (e.g. the engine crashing on a continuation)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (a check that cannot finish is a failed check, not a lost report)
        return Check.of(label, name, False, f"the check raised {type(e).__name__}: {e}")
    except SystemExit as e:     # an adapter's sys.exit inside a check (a continuation run): a FAIL, not the end
        return Check.of(label, name, False, f"the adapter called sys.exit({e.code!r})")


def check_instance(adapter_cls, model_dir: Path, inst, modes: list[str], oracle_model, device: str,
                   tau: float | None = None, progress: Progress | None = None,
                   on_check: Callable[[Check], None] | None = None, truth: dict | None = None,
                   label: str | None = None) -> list[Check]:
    """Every check for one scenario instance; `tau` None follows the adapter's compute dtype; `label` names it in
    the report (default model/scenario)."""
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
    caps = adapter_cls.capabilities(device)
    tau = tau_for(caps.compute_dtype) if tau is None else tau
    trace = inst.trace
    truth = truth or truth_for(model_dir, inst, oracle_model)
    rows = OracleRows(oracle_model)
    kinds = sorted({r.sampling.kind for r in trace.requests} - set(caps.sampling_kinds))
    runs, proven = {}, None       # proven: request -> tokens shown to be the oracle's own (streamed truth)
    for mode in modes:
        started = progress.start(f"{label} · {mode}")
        before = len(checks)
        if mode not in caps.modes:
            add(Check.skip(label, f"{mode}: engine runs the trace",
                           caps.why_not(mode, f"the adapter does not declare mode {mode!r}")))
        elif kinds:
            users = [r.id for r in trace.requests if r.sampling.kind in kinds]
            add(Check.skip(label, f"{mode}: engine runs the trace",
                           f"{caps.why_not(kinds[0], 'unsupported sampling')} (the adapter supports "
                           f"{', '.join(caps.sampling_kinds)}; {', '.join(kinds)} used by {', '.join(users)})"))
        else:
            t0 = time.time()
            run, problems = None, []
            try:
                run = adapter_cls(model_dir, trace, mode, device).run_trace()
            except Exception as e:  # an engine crash is a failed check with its message, not a traceback
                add(Check.of(label, f"{mode}: engine runs the trace", False, f"{type(e).__name__}: {e}",
                             time.time() - t0))
            except SystemExit as e:     # sys.exit(any code) inside the adapter ends its run, not qualify's
                add(Check.of(label, f"{mode}: engine runs the trace", False,
                             f"SystemExit: the adapter called sys.exit({e.code!r})", time.time() - t0))
            else:
                run, problems = validate_result(trace, run, oracle_model.config.vocab_size)
                if problems:        # the boundary: nothing malformed reaches a check (hybridqual.qualify.validate)
                    add(Check.of(label, f"{mode}: engine result is well-formed", False, describe(problems),
                                 time.time() - t0, problems=problems[:50]))
            if run is not None and not problems:
                vocab = oracle_model.config.vocab_size
                runs[mode] = run
                cont = lambda req: continuation(adapter_cls, model_dir, trace, req, device, vocab)  # noqa: E731
                tok = guarded(label, f"{mode}: tokens match the truth", check_tokens, label, mode, trace, truth, run,
                              rows, cont, tau, caps.compute_dtype)
                add(tok)
                mine = {rid: run.tokens.get(rid, []) for rid, d in tok.data.get("requests", {}).items()
                        if tok.passed and d["exact"]}
                proven = mine if proven is None else {r: t for r, t in proven.items() if mine.get(r) == t}
                add(guarded(label, f"{mode}: schedule log matches the oracle's", check_schedule, label, mode, trace,
                            truth, run, oracle_model, caps, getattr(adapter_cls, "batch_invariant", False)))
                add(guarded(label, f"{mode}: logits match the oracle's", check_logits, label, mode, trace, run, rows,
                            caps))
                add(guarded(label, f"{mode}: greedy tokens are their logits rows' argmax", check_greedy_argmax, label,
                            mode, trace, run, caps))
                from hybridqual.qualify.spec_checks import qualify_check           # speculative traces only (DESIGN §13)
                add(guarded(label, f"{mode}: accepted counts", qualify_check, label, mode, trace, run, oracle_model))
                from hybridqual.qualify.prefix_checks import qualify_check as cache_check     # prefix-cache traces only (DESIGN §12)
                add(guarded(label, f"{mode}: prefix cache events", cache_check, label, mode, trace, run,
                            schedule_model(oracle_model), caps))       # a forced replay: no model math needed
                from hybridqual.qualify.invariance_checks import qualify_check as invariance_check   # batch-invariant engines
                add(guarded(label, f"{mode}: batch-invariant", invariance_check, label, mode, trace, run, adapter_cls,
                            model_dir, device, vocab))
                facts = getattr(adapter_cls, "facts_check", None)   # an engine's own schedule facts (docs/megatron.md)
                if facts is not None and facts.__func__ is not adapters.TraceAdapter.facts_check.__func__:
                    add(guarded(label, f"{mode}: engine schedule facts", facts, label, mode, trace, run,
                                oracle_model))
        progress.end(f"{label} · {mode}", started, checks[before:])
    add(check_modes_equal(label, runs, caps, modes))
    add(check_task(label, trace, dict(truth, requests=proven or {}) if truth.get("streamed") else truth, runs))
    return checks
