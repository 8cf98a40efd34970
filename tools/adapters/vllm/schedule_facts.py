"""vLLM's own per-step schedule facts (RunResult.schedule_facts), recorded from its scheduler and checked.

`Recorder` wraps the engine core's `Scheduler.schedule` for one trace and records, per engine step: every
scheduled request's row (start position = its num_computed_tokens, token count, new / resumed after preemption,
its Mamba state blocks, the drafts scheduled for verification), the requests preempted and finished, the step's
limits (vLLM's token budget and max_num_seqs as the scheduler holds them), and after the step the tokens each
request emitted and the cached prompt tokens vLLM reported for it. vLLM's scheduler is not DESIGN §4's, so there is
no oracle log to compare; `problems` checks what ANY correct schedule under vLLM's limits must satisfy: the budget
and the request limit hold in every step; a request's rows cover its prompt once, contiguously, from 0 (or from a
cached block boundary with prefix caching on; a preempted request may restart lower); each decode row computes
1 + drafts tokens; a request emits only in a step that completes its prompt, at most 1 + drafts tokens, and in all
exactly the tokens it returned; drafts are accepted by the greedy rule (the emitted tokens start with the accepted
drafts, and the first rejected draft is not the token emitted in its place); rows in a step have distinct Mamba
state blocks; cached tokens are 0 with caching off and block-aligned below the prompt length with it on.
"""
from __future__ import annotations

import time


class Recorder:
    """Per-step facts of one trace on one vLLM engine (a context manager: the scheduler is unwrapped on exit)."""

    def __init__(self, engine) -> None:
        self.core = engine.engine_core.engine_core
        self.sched = self.core.scheduler
        self.facts: list[dict] = []
        self.names: dict[str, str] = {}
        self._step: dict | None = None
        self._mamba = [g for g, grp in enumerate(self.sched.kv_cache_config.kv_cache_groups)
                       if type(grp.kv_cache_spec).__name__.startswith("Mamba")]

    def __enter__(self) -> "Recorder":
        orig = self.sched.schedule

        def schedule(*a, **k):
            out = orig(*a, **k)
            self._record(out)
            return out
        self.sched.schedule = schedule
        return self

    def __exit__(self, *exc) -> None:
        self.sched.__dict__.pop("schedule", None)

    def begin(self, k: int, names: dict[str, str]) -> None:
        """Engine step k starts (facts are recorded only for steps in which vLLM schedules)."""
        self.names, self._k, self._step = names, k, None

    def _blocks(self, block_ids) -> list[int]:
        if block_ids is None:
            return []
        return [b for g in self._mamba if g < len(block_ids) for b in block_ids[g]]

    def _record(self, so) -> None:
        # vLLM's input processor gives each request id a random "-xxxxxxxx" suffix
        name = lambda rid: self.names.get(rid, self.names.get(rid.rsplit("-", 1)[0], rid))  # noqa: E731
        rows = []
        spec = so.scheduled_spec_decode_tokens or {}
        for r in so.scheduled_new_reqs:
            rows.append({"request": name(r.req_id), "pos": int(r.num_computed_tokens),
                         "tokens": int(so.num_scheduled_tokens[r.req_id]), "new": True, "resumed": False,
                         "mamba_blocks": self._blocks(r.block_ids), "drafts": list(spec.get(r.req_id, []))})
        c = so.scheduled_cached_reqs
        resumed = getattr(c, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(c.req_ids):
            rows.append({"request": name(rid), "pos": int(c.num_computed_tokens[i]),
                         "tokens": int(so.num_scheduled_tokens[rid]), "new": False, "resumed": rid in resumed,
                         "mamba_blocks": self._blocks(c.new_block_ids[i]), "drafts": list(spec.get(rid, []))})
        self._step = {"step": self._k, "rows": rows, "budget": int(self.sched.max_num_scheduled_tokens),
                      "max_seqs": int(self.sched.max_num_running_reqs),
                      "preempted": sorted(name(r) for r in (so.preempted_req_ids or ())),
                      "finished": sorted(name(r) for r in so.finished_req_ids), "emitted": {}, "cached": {}}
        self.facts.append(self._step)

    def emitted(self, request: str, n: int, cached: int | None) -> None:
        """After the step: `request` emitted n tokens; vLLM reports `cached` prompt tokens for it."""
        if self._step is None:
            self._step = {"step": self._k, "rows": [], "budget": 0, "max_seqs": 0, "preempted": [], "finished": [],
                          "emitted": {}, "cached": {}}
            self.facts.append(self._step)
        self._step["emitted"][request] = self._step["emitted"].get(request, 0) + n
        if cached is not None:
            self._step["cached"][request] = int(cached)


def _step_problems(f: dict) -> list[str]:
    bad = []
    k, rows = f["step"], f["rows"]
    total = sum(r["tokens"] for r in rows)
    if f["budget"] and total > f["budget"]:
        bad.append(f"step {k}: {total} tokens scheduled over vLLM's budget of {f['budget']}")
    if f["max_seqs"] and len(rows) > f["max_seqs"]:
        bad.append(f"step {k}: {len(rows)} requests scheduled over max_num_seqs {f['max_seqs']}")
    blocks = [b for r in rows for b in r["mamba_blocks"] if r["new"] or r["resumed"]]
    if len(set(blocks)) != len(blocks):
        bad.append(f"step {k}: Mamba state blocks {blocks} of newly placed requests not distinct")
    if len({r["request"] for r in rows}) != len(rows):
        bad.append(f"step {k}: a request scheduled twice")
    return bad


def _request_problems(req, got: list[int], facts: list[dict], caching: bool, block: int | None) -> list[str]:
    bad, n = [], len(req.prompt)
    pos, out, cached_ok = None, 0, True
    for f in facts:
        row = next((r for r in f["rows"] if r["request"] == req.id), None)
        e = f["emitted"].get(req.id, 0)
        if row is None:
            if e:
                bad.append(f"{req.id}: step {f['step']} emitted {e} tokens without a row")
            continue
        p, t, d = row["pos"], row["tokens"], row["drafts"]
        if pos is None or row["resumed"] or row["new"]:
            if p and not caching:
                bad.append(f"{req.id}: step {f['step']} starts at {p} with prefix caching off")
            elif p and (p >= n + out or (block and p % block)):
                bad.append(f"{req.id}: step {f['step']} starts at cached position {p} (prompt {n}, block {block})")
        elif p != pos:
            bad.append(f"{req.id}: step {f['step']} row starts at {p}, expected {pos} (contiguous)")
            return bad
        known = n + out             # prompt + tokens emitted so far: what a row may compute without drafts
        if p + t > known and (p != known - 1 or t != 1 + len(d)):
            bad.append(f"{req.id}: step {f['step']} row {p}+{t} with {len(d)} drafts goes past its {known} tokens")
        if e and p + t < known:
            bad.append(f"{req.id}: step {f['step']} emitted before its tokens were computed ({p}+{t} of {known})")
        if e > 1 + len(d):
            bad.append(f"{req.id}: step {f['step']} emitted {e} tokens for {len(d)} drafts")
        if d and e:
            acc, new = e - 1, got[out:out + e]
            if list(new[:acc]) != list(d[:acc]):
                bad.append(f"{req.id}: step {f['step']} accepted {acc} drafts {d[:acc]} but emitted {new[:acc]}")
            elif acc < len(d) and len(new) == e and new[acc] == d[acc] and out + e < len(got):
                bad.append(f"{req.id}: step {f['step']} rejected draft {d[acc]} that the greedy token equals")
        out += e
        pos = p + t - (len(d) - max(e - 1, 0) if d and e else 0)
        cached = f["cached"].get(req.id)
        if cached and (not caching or cached >= n) and cached_ok:
            bad.append(f"{req.id}: vLLM reports {cached} cached prompt tokens (prompt {n}, caching "
                       f"{'on' if caching else 'off'})")
            cached_ok = False
    if pos is None and got:
        bad.append(f"{req.id}: {len(got)} tokens but no row in any step")
    elif pos is not None and pos < n:
        bad.append(f"{req.id}: the prompt ({n} tokens) is not covered (last row ends at {pos})")
    if out != len(got):
        bad.append(f"{req.id}: steps emitted {out} tokens, the request returned {len(got)}")
    return bad


def problems(trace, tokens: dict[str, list[int]], facts: list[dict], caching: bool = False,
             block: int | None = None) -> list[str]:
    """What in the facts no correct schedule under vLLM's limits does (empty: nothing); see the module docstring."""
    bad = [p for f in facts for p in _step_problems(f)]
    for req in trace.requests:
        bad += _request_problems(req, tokens.get(req.id, []), facts, caching, block)
    return bad


def summary(facts: list[dict], trace) -> str:
    """One line: steps, requests and tokens per step, prefill pieces, preemptions, cached tokens, drafts."""
    if not facts:
        return "no steps"
    prompt = {r.id: len(r.prompt) for r in trace.requests}
    parts = [f"{len(facts)} scheduled steps, budget {facts[0]['budget']} tokens, max_num_seqs {facts[0]['max_seqs']}",
             "requests per step " + str([len(f["rows"]) for f in facts]),
             "tokens per step " + str([sum(r["tokens"] for r in f["rows"]) for f in facts])]
    pieces = [f"{r['request']} {r['pos']}+{r['tokens']}@s{f['step']}" for f in facts for r in f["rows"]
              if r["pos"] < prompt.get(r["request"], 0)]
    parts.append("prefill pieces " + ", ".join(pieces[:24]) + (f" (+{len(pieces) - 24})" if len(pieces) > 24 else ""))
    pre = [f"{n}@s{f['step']}" for f in facts for n in f["preempted"]]
    parts.append("preempted " + (", ".join(pre) or "none"))
    cached = {}
    for f in facts:
        cached.update({n: c for n, c in f["cached"].items() if c})
    parts.append("cached prompt tokens " + (", ".join(f"{n} {c}" for n, c in cached.items()) or "none"))
    drafts = [(len(r["drafts"]), f["emitted"].get(r["request"], 0)) for f in facts for r in f["rows"] if r["drafts"]]
    if drafts:
        parts.append(f"ngram drafts: {sum(max(e - 1, 0) for _, e in drafts)} accepted of "
                     f"{sum(d for d, _ in drafts)} proposed in {len(drafts)} verify rows")
    return "; ".join(parts)


def check(ctx, prefix_caching: bool):
    """qualify's line for the vllm engine: its facts are a correct schedule's (see the module docstring);
    `prefix_caching`: whether the run had vLLM's prefix caching on."""
    from hybridqual.qualify.report import Check
    t0 = time.time()
    name = f"{ctx.mode}: vLLM's schedule facts are a correct schedule's"
    facts = getattr(ctx.run, "schedule_facts", None)
    if facts is None:
        return Check.of(ctx.label, name, False, "the adapter returned no RunResult.schedule_facts")
    bad = problems(ctx.trace, ctx.run.tokens, facts, prefix_caching, None)
    line = summary(facts, ctx.trace)
    detail = ("; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "") + f" | facts: {line}") \
        if bad else line
    return Check.of(ctx.label, name, not bad, detail, time.time() - t0, facts=facts)
