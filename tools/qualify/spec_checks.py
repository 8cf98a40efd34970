"""Checks of speculative decoding (DESIGN §13) on any engine's schedule log: acceptance recomputed from the LOGGED
proposals, and speculative == non-speculative tokens.

    log_consistency(log)                      # inside the log: accepted drafts are the emitted tokens, then a miss
    recompute_accepted(model, trace, result)  # the oracle's own choices along each row's proposals
    without_speculation(trace)                # the same trace with engine.speculative removed
"""
from __future__ import annotations

import dataclasses

from oracle.sampling import sample
from oracle.schedule_log import ScheduleLog, TraceResult, verify_rows
from oracle.speculative import accepted_count
from oracle.trace import Trace


def log_consistency(log: ScheduleLog | dict) -> list[str]:
    """Problems (empty: none) of a log read alone: count = m+1, 0 <= accepted <= m, emitted <= accepted+1 tokens,
    accepted drafts equal the emitted tokens, and the token after them (when emitted) is not the rejected draft."""
    bad = []
    j = log.to_json() if isinstance(log, ScheduleLog) else log
    for s in j["steps"]:
        for b in s["batch"]:
            if b["kind"] == "verify" and (not b.get("proposals") or b["count"] != len(b["proposals"]) + 1):
                bad.append(f"step {s['step']} {b['request']}: verify count {b['count']} != proposals + 1")
    for v in verify_rows(log):
        p, a, e, where = v["proposals"], v["accepted"], v["emitted"], f"step {v['step']} {v['request']}"
        if not 0 <= a <= len(p):
            bad.append(f"{where}: accepted {a} outside 0..{len(p)}")
            continue
        if not 1 <= len(e) <= a + 1:
            bad.append(f"{where}: {len(e)} tokens emitted for {a} accepted drafts (at most accepted + 1)")
        if e[:a] != p[:len(e[:a])]:
            bad.append(f"{where}: emitted {e} do not start with the accepted drafts {p[:a]}")
        if len(e) == a + 1 and a < len(p) and e[a] == p[a]:
            bad.append(f"{where}: draft {a + 1} ({p[a]}) equals the sampled token yet was rejected")
    return bad


def recompute_accepted(model, trace: Trace, result: TraceResult) -> list[str]:
    """Problems (empty: none) when the truth model recomputes each verify row's acceptance from its logged
    proposals: choices c_i of the request's own sampler at positions pos+1+i, teacher-forced along the request's
    tokens before the row and the proposals; accepted must be the leading matches."""
    bad = []
    for v in verify_rows(result.schedule_log):
        req = trace.request(v["request"])
        n = v["pos"] + 1 - len(req.prompt)                    # tokens generated before this step
        before = result.tokens[req.id][:n]
        logits, _ = model.prefill(list(req.prompt) + before + list(v["proposals"]), None)
        base = len(req.prompt) + n - 1
        choices = [sample(logits[base + i], req.sampling, v["pos"] + 1 + i) for i in range(len(v["proposals"]) + 1)]
        a = accepted_count(v["proposals"], choices)
        if a != v["accepted"]:
            bad.append(f"step {v['step']} {req.id}: logged accepted {v['accepted']}, recomputed {a} "
                       f"(proposals {v['proposals']}, choices {choices})")
    return bad


def without_speculation(trace: Trace) -> Trace:
    """The same trace, engine.speculative removed (the reference for speculative == non-speculative)."""
    return dataclasses.replace(trace, engine=dataclasses.replace(trace.engine, speculative=None))


def acceptance_rate(log: ScheduleLog | dict) -> tuple[int, int]:
    """(accepted drafts, proposed drafts) over every verify row of a log."""
    rows = verify_rows(log)
    return sum(v["accepted"] for v in rows), sum(len(v["proposals"]) for v in rows)


def unfit_reason(trace: Trace, vocab_size: int) -> str | None:
    """Why a speculative trace cannot run on a model of this vocab (scripted ids or the draft's vocab), or None."""
    spec = trace.engine.speculative
    if spec is None:
        return None
    if spec.proposer.kind == "scripted":
        top = max((t for _, per in spec.proposer.proposals for _, toks in per for t in toks), default=-1)
        if top >= vocab_size:
            return f"scripted proposals use token id {top} >= vocab_size {vocab_size}"
    if spec.proposer.kind == "draft":
        import json
        from oracle.speculative import model_path
        v = json.loads((model_path(spec) / "config.json").read_text()).get("vocab_size")
        if v != vocab_size:
            return f"the draft model's vocab_size {v} != {vocab_size}"
    return None


def qualify_check(ctx) -> "Check | None":
    """qualify's line for a speculative trace (None for others; ctx: hybridqual.qualify.context.CheckContext): the
    candidate's logged proposals and accepted counts are consistent and the oracle recomputes every accepted count
    from them (tokens == non-speculative is the tokens check: the truth of a speculative trace is its
    non-speculative tokens)."""
    trace, run = ctx.trace, ctx.run
    if trace.engine.speculative is None:
        return None
    if run.schedule_log is None:
        return ctx.skip("the engine keeps no schedule log (no proposals or accepted counts reported)")
    if not verify_rows(run.schedule_log):
        return ctx.skip("the engine logged no verify rows (it did not speculate)")
    bad = log_consistency(run.schedule_log) + recompute_accepted(ctx.oracle_model, trace, run)
    n = len(verify_rows(run.schedule_log))
    return ctx.line(not bad, "; ".join(bad[:3]) if bad else f"{n} verify rows")


def for_requests(engine, ids: set[str]):
    """The engine config with scripted proposals kept only for these request ids (a trace cut to some of its
    requests, e.g. one request alone: proposals for absent requests would be 'unknown request id')."""
    spec = engine.speculative
    if spec is None or spec.proposer.kind != "scripted":
        return engine
    kept = tuple((rid, per) for rid, per in spec.proposer.proposals if rid in ids)
    proposer = dataclasses.replace(spec.proposer, proposals=kept)
    return dataclasses.replace(engine, speculative=dataclasses.replace(spec, proposer=proposer))
