"""qualify's "server logprobs" line for the OpenAI-compatible server adapter: the logprobs rule (logprobs.py) at
every generated position, and the server's per-request facts checked for consistency and summarised."""
from __future__ import annotations

import time

import torch

from hybridqual.adapters.openai.logprobs import judge_position
from hybridqual.qualify.compare import LOGITS_C, tau_for, teacher_forced_logits
from hybridqual.qualify.report import Check


def overlap(facts: list[dict]) -> int:
    """The most requests in flight at once (from their send and answer times)."""
    ev = sorted([(f["sent_s"], 1) for f in facts] + [(f["done_s"], -1) for f in facts], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def fact_problems(trace, run) -> list[str]:
    """Inconsistencies in what the server reported per request."""
    bad = []
    for f in run.schedule_facts or []:
        req = trace.request(f["request"])
        if f.get("prompt_tokens") is not None and f["prompt_tokens"] != len(req.prompt):
            bad.append(f"request {req.id}: the server counted {f['prompt_tokens']} prompt tokens for the "
                       f"{len(req.prompt)} sent (a token added, e.g. BOS, changes the model's input)")
        if f.get("cached_tokens") is not None and not 0 <= f["cached_tokens"] <= len(req.prompt):
            bad.append(f"request {req.id}: cached_tokens {f['cached_tokens']} outside 0..{len(req.prompt)}")
        if f.get("draft_n") is not None and not 0 <= (f.get("draft_n_accepted") or 0) <= f["draft_n"]:
            bad.append(f"request {req.id}: draft_n_accepted {f.get('draft_n_accepted')} outside 0..{f['draft_n']}")
    return bad


def summary(run) -> str:
    facts = run.schedule_facts or []
    parts = [f"{len(facts)} requests, at most {overlap(facts)} in flight at once" if facts else "no requests"]
    late = [f["sent_s"] - f["due_s"] for f in facts if "due_s" in f]
    if late:
        parts.append(f"sent at most {max(late) * 1e3:.0f} ms after their arrival time")
    if getattr(run, "probe", ""):
        parts.append(run.probe)
    cut = [f for f in facts if f["cut_after_stop"]]
    if cut:
        parts.append(f"{len(cut)} cut client-side after a stop id (the server generated "
                     f"{sum(f['cut_after_stop'] for f in cut)} tokens past them: it does not honour stop_token_ids)")
    hits = [f for f in facts if f.get("cached_tokens")]
    if any(f.get("cached_tokens") is not None for f in facts):
        src = next(f["cached_source"] for f in facts if f.get("cached_tokens") is not None)
        parts.append(f"cached prompt tokens ({src}): " + (", ".join(f"{f['request']} {f['cached_tokens']}"
                                                                   for f in hits) or "none"))
    drafts = [f for f in facts if f.get("draft_n") is not None]
    if drafts:
        parts.append(f"speculative: {sum(f['draft_n_accepted'] or 0 for f in drafts)} of "
                     f"{sum(f['draft_n'] for f in drafts)} drafted tokens accepted over {len(drafts)} requests")
    return "; ".join(parts)


def logprobs_check(engine, label: str, mode: str, trace, run, oracle_model) -> Check:
    """The line: every position's returned logprobs by the rule of logprobs.py, then the facts' consistency;
    `engine` (a hybridqual.adapters.Engine) declares the server's compute dtype."""
    dtype = engine.capabilities("cpu").compute_dtype
    c, tau = LOGITS_C[dtype or torch.float32], tau_for(dtype)
    name = f"{mode}: server logprobs (top-k) agree with the oracle (tie-aware, τ={tau:g}, c={c:g})"
    t0 = time.time()
    notes = getattr(run, "logprobs_notes", {}) or {}
    rows_of = getattr(run, "logprobs", {}) or {}
    want = [r for r in trace.requests if run.tokens.get(r.id)]
    if want and all(rows_of.get(r.id) is None for r in want):
        why = next(iter(notes.values()), "the server returned no logprobs")
        return Check.skip(label, name, f"{why}; facts: {summary(run)}")
    asked = getattr(run, "asked_logprobs", 0)
    bad, ties, positions = [], [], 0
    worst = None
    for req in want:
        toks, rows = run.tokens[req.id], rows_of.get(req.id)
        if rows is None:
            bad.append(f"request {req.id}: no logprobs ({notes.get(req.id, 'none returned')})")
            continue
        sampled = (run.sampled_logprobs or {}).get(req.id) or [None] * len(toks)
        short = [(p, len(rw)) for p, rw in enumerate(rows) if len(rw) < asked]
        if short:
            p, n = short[0]
            bad.append(f"request {req.id} position {p}: fewer logprobs than asked ({n} of {asked}; "
                       f"{len(short)} such positions)")
            continue
        oracle_rows = teacher_forced_logits(oracle_model, req.prompt, toks)
        for p, tok in enumerate(toks):
            v = judge_position(rows[p], sampled[p], tok, oracle_rows[p], c, tau)
            positions += 1
            if v.near_tie:
                ties.append(f"{req.id}@{p}")
            if v.residual == v.residual and (worst is None or v.residual / v.bound > worst[0]):
                worst = (v.residual / v.bound, req.id, p, v.residual, v.bound)
            if not v.ok:
                bad.append(f"request {req.id} position {p}: {v.problem}")
                break
    bad += fact_problems(trace, run)
    w = (f"worst {worst[1]}@{worst[2]}: least max|Δlogit| {worst[3]:.3g} vs bound {worst[4]:.3g}"
         if worst else "no positions")
    detail = ("; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "") + f"; {w}") if bad else \
        (f"{positions} positions, {asked} logprobs each; {w}" + (f"; near ties shown by the server's own "
                                                                 f"logprobs: {', '.join(ties)}" if ties else ""))
    detail += f"; facts: {summary(run)}"
    return Check.of(label, name, not bad, detail, time.time() - t0, positions=positions, near_ties=ties,
                    worst=worst and {"request": worst[1], "position": worst[2], "residual": worst[3],
                                     "bound": worst[4]},
                    facts=run.schedule_facts)
