"""Megatron's own per-step schedule facts (RunResult.schedule_facts), read back for the report and checked.

The adapter records, per `step_modern()` call: every batch Megatron sampled in it (per row the request, its context
row, start position, token count and Mamba state slot; the padded token count), the requests that finished, the
ones still active, the CUDA-graph batch size used (None: eager), the waiting / paused / evicted counts, and, when
on, the prefix-cache hits, blocks matched and prompt tokens computed / skipped, and the MTP drafts proposed /
accepted in that step. Megatron's scheduler is not DESIGN §4's, so there is no oracle log to compare; what must
hold for ANY correct continuous-batching schedule is checked here (`check`): a request's rows cover its prompt
once, contiguously, from 0 (or from a prefix-cache block boundary when caching is on); each later row samples one
token (1 + drafts under MTP); a request keeps its Mamba state slot for its whole life (compaction moves its row,
not its state: the zoo's compact_slot_not_moved bug breaks exactly this); rows and Mamba slots are distinct within
a batch; every request that produced tokens finishes exactly once. `summary` is the report line a user reads.
"""
from __future__ import annotations

from typing import Any


def rows_by_request(facts: list[dict]) -> dict[str, list[dict]]:
    """Each request's rows in the order Megatron ran them, with the step index added."""
    out: dict[str, list[dict]] = {}
    for k, fact in enumerate(facts):
        for b in fact["batches"]:
            for r in b["rows"]:
                out.setdefault(r["request"], []).append(dict(r, step=k))
    return out


def problems(trace, tokens: dict[str, list[int]], facts: list[dict], prefix_caching: bool = False,
             block: int = 16, speculative: int = 0) -> list[str]:
    """What in the facts no correct schedule does (empty: nothing); see the module docstring."""
    bad: list[str] = []
    for k, fact in enumerate(facts):
        for b in fact["batches"]:
            rows = [r["slot"] for r in b["rows"]]
            slots = [r["mamba_slot"] for r in b["rows"] if r["mamba_slot"] >= 0]
            if len(set(rows)) != len(rows) or len(set(slots)) != len(slots):
                bad.append(f"step {k}: context rows {rows} / Mamba slots {slots} not distinct within a batch")
            if b["padded_tokens"] < sum(r["tokens"] for r in b["rows"]):
                bad.append(f"step {k}: padded token count {b['padded_tokens']} below the rows' "
                           f"{sum(r['tokens'] for r in b['rows'])}")
    per = rows_by_request(facts)
    finished: dict[str, list[int]] = {}
    for k, fact in enumerate(facts):
        for name in fact["finished"]:
            finished.setdefault(name, []).append(k)
    for req in trace.requests:
        rows, n, got = per.get(req.id, []), len(req.prompt), tokens.get(req.id, [])
        if not rows:
            if got:
                bad.append(f"{req.id}: {len(got)} tokens but no row of it in any batch")
            continue
        p0 = rows[0]["pos"]
        if p0 != 0 and not (prefix_caching and p0 % block == 0 and p0 < n):
            bad.append(f"{req.id}: first row starts at position {p0}" + (
                "" if prefix_caching else " with prefix caching off (the prompt must be computed from 0)"))
        pos = p0
        evictions = any(f.get("evicted") for f in facts)
        for r in rows:
            if evictions and r["pos"] == 0 and pos != 0:
                pos = 0             # an evicted request is recomputed from its start when it is re-admitted
            if r["pos"] != pos:
                bad.append(f"{req.id}: step {r['step']} row starts at {r['pos']}, expected {pos} (contiguous)")
                break
            if r["pos"] >= n and r["tokens"] != 1 + speculative:
                bad.append(f"{req.id}: step {r['step']} decode row of {r['tokens']} tokens (expected "
                           f"{1 + speculative})")
            if speculative and r["pos"] >= n:
                break       # a verify row advances by the drafts it accepted: positions must only increase
            pos += r["tokens"]
        # one life per admission: an evicted request may come back in another slot, from position 0
        lives = [k for k, r in enumerate(rows) if k == 0 or (evictions and r["pos"] == 0)] + [len(rows)]
        if speculative:
            for s0, s1 in zip(lives, lives[1:]):
                ps = [r["pos"] for r in rows[s0:s1]]
                if ps != sorted(ps) or len(set(ps)) != len(ps):
                    bad.append(f"{req.id}: row positions {ps} do not increase")
        ends = [r["pos"] + r["tokens"] for r in rows if r["pos"] < n]
        if not ends or max(ends) < n:
            bad.append(f"{req.id}: the prompt ({n} tokens) is not covered by its prefill rows (last ends at "
                       f"{max(ends) if ends else p0})")
        moves = [f"step {b['step']} row {b['slot']}: slot {b['mamba_slot']}" for s0, s1 in zip(lives, lives[1:])
                 for a, b in zip(rows[s0:s1], rows[s0 + 1:s1]) if a["mamba_slot"] != b["mamba_slot"]]
        if moves:
            bad.append(f"{req.id}: its Mamba state slot changed during its life ({'; '.join(moves[:3])}; "
                       f"started in slot {rows[0]['mamba_slot']}): a row moved without its state")
        if got and len(finished.get(req.id, [])) != 1:
            bad.append(f"{req.id}: finished {len(finished.get(req.id, []))} times (expected once)")
    return bad


def summary(facts: list[dict], trace=None) -> str:
    """One line: steps, tokens per step, prefill pieces, finishes, Mamba slots, row moves, cache hits, MTP."""
    if not facts:
        return "no steps"
    per = rows_by_request(facts)
    prompt = {r.id: len(r.prompt) for r in trace.requests} if trace is not None else {}
    toks = [sum(r["tokens"] for b in f["batches"] for r in b["rows"]) for f in facts]
    padded = [sum(b["padded_tokens"] for b in f["batches"]) for f in facts]
    prefill_steps = sum(any(r["pos"] < prompt.get(r["request"], 0) for b in f["batches"] for r in b["rows"])
                        for f in facts)
    parts = [f"{len(facts)} steps ({prefill_steps} with a prefill piece); tokens per step {toks}, padded {padded}"]
    pieces = [f"{name} {r['pos']}+{r['tokens']}@s{r['step']}" for name, rows in per.items() for r in rows
              if r["pos"] < prompt.get(name, 0)]
    if pieces:
        parts.append("prefill pieces " + ", ".join(pieces))
    fin = [f"{n}@s{k}" for k, f in enumerate(facts) for n in f["finished"]]
    parts.append("finished " + (", ".join(fin) or "none"))
    parts.append("Mamba slots " + " ".join(f"{n}:{'/'.join(str(s) for s in dict.fromkeys(r['mamba_slot'] for r in rows))}"
                                           for n, rows in per.items()))
    moves = [f"{n} row{a['slot']}→row{b['slot']}@s{b['step']}" for n, rows in per.items()
             for a, b in zip(rows, rows[1:]) if a["slot"] != b["slot"]]
    parts.append("row moves " + (", ".join(moves) or "none"))
    graphs = sorted({f["cuda_graph"] for f in facts if f.get("cuda_graph")})
    parts.append(f"CUDA graphs: batch sizes {graphs}" if graphs else "CUDA graphs: none (eager)")
    pc = [f["prefix_cache"] for f in facts if f.get("prefix_cache")]
    if pc:
        hits = sum(p["hits"] for p in pc)
        skipped = sum(p["skipped_tokens"] for p in pc)
        starts = [f"{n} from {rows[0]['pos']}" for n, rows in per.items() if rows[0]["pos"] > 0]
        parts.append(f"prefix cache: {hits} hits, {sum(p['blocks_matched'] for p in pc)} blocks matched, "
                     f"{skipped} prompt tokens skipped" + (f" ({', '.join(starts)})" if starts else ""))
    sp = [f["mtp"] for f in facts if f.get("mtp")]
    if sp:
        parts.append(f"MTP drafts: {sum(s['accepted'] for s in sp)} accepted of {sum(s['proposed'] for s in sp)} "
                     "proposed")
    if any(f.get("evicted") for f in facts):
        parts.append(f"evicted {sum(f.get('evicted', 0) for f in facts)}")
    return "; ".join(parts)


def verify_log(trace, tokens: dict[str, list[int]], facts: list[dict]) -> dict:
    """The verify rows of MTP steps as a log in oracle.schedule_log's JSON shape (only what tools/qualify/spec_checks.py
    reads): per row its drafts and accepted count, emitted = the request's tokens from that position on (at most
    accepted + 1: the accepted drafts and the bonus token)."""
    steps = []
    for k, fact in enumerate(facts):
        for b in fact["batches"]:
            rows = [r for r in b["rows"] if "proposals" in r]
            if not rows:
                continue
            sampled = []
            for r in rows:
                n = r["pos"] + 1 - len(trace.request(r["request"]).prompt)
                sampled += [{"request": r["request"], "token": t}
                            for t in tokens.get(r["request"], [])[n:n + r["accepted"] + 1]]
            steps.append({"step": k, "sampled": sampled,
                          "batch": [{"kind": "verify", "request": r["request"], "pos": r["pos"],
                                     "count": r["tokens"], "proposals": r["proposals"]} for r in rows],
                          "verify": [{"request": r["request"], "accepted": r["accepted"]} for r in rows]})
    return {"steps": steps}


def check(label: str, mode: str, trace, run: Any, adapter_cls: Any, oracle_model: Any = None):
    """qualify's line: Megatron's facts are those of a correct schedule (detail: the summary; data: the facts);
    under MTP also tools/qualify/spec_checks.py on the verify rows (drafts -> accepted, recomputed by the oracle)."""
    from types import SimpleNamespace
    from hybridqual.qualify.report import Check
    name = f"{mode}: Megatron's schedule facts are consistent with its tokens"
    facts = getattr(run, "schedule_facts", None)
    if facts is None:
        return Check.of(label, name, False, "the adapter returned no RunResult.schedule_facts")
    pc = getattr(trace.engine, "prefix_cache", None)
    block = pc.block_size if (adapter_cls.prefix_caching and pc is not None) else 16
    k = adapter_cls.speculative_k(trace)
    bad = problems(trace, run.tokens, facts, adapter_cls.prefix_caching, block, k)
    line = summary(facts, trace)
    if k:
        from hybridqual.qualify.spec_checks import acceptance_rate, log_consistency, recompute_accepted
        log = verify_log(trace, run.tokens, facts)
        bad += log_consistency(log)
        if oracle_model is not None:
            bad += recompute_accepted(oracle_model, trace, SimpleNamespace(schedule_log=log, tokens=run.tokens))
        acc, prop = acceptance_rate(log)
        line += (f"; {sum(len(s['batch']) for s in log['steps'])} verify rows, accepted counts recomputed by the "
                 f"oracle ({acc} of {prop} drafts accepted)" if oracle_model is not None else "")
    return Check.of(label, name, not bad, ("; ".join(bad[:4]) + f" | facts: {line}") if bad else line,
                    facts=facts)
