"""DESIGN §13's proposers inside the llama.cpp worker: scripted, ngram, and a draft GGUF run in its own llama.cpp
context (oracle/speculative.py's rules, rewritten here: the worker imports only the standard library, numpy and
llama_cpp). Verification and rollback stay in worker.py; this module says what a verify row feeds."""
from __future__ import annotations

import numpy as np


class Speculation:
    """The trace's proposer (the oracle's rules: at most k, at most the room left before max_new_tokens, within the
    step's budget; backoff after rows that accepted nothing), the target snapshots taken before a verify step, and
    per-request counts."""

    KINDS = ("scripted", "ngram", "draft")

    def __init__(self, cfg: dict, draft_engine=None) -> None:
        self.k, p = int(cfg["k"]), cfg["proposer"]
        self.kind = p["kind"]
        if self.kind not in self.KINDS:
            raise ValueError(f"engine.speculative.proposer.kind {self.kind!r}: not one of {self.KINDS}")
        if self.kind == "draft" and draft_engine is None:
            raise ValueError("engine.speculative.proposer.model: a draft proposer needs its GGUF (draft_gguf)")
        self.min_n, self.max_n = int(p.get("min_n", 1)), int(p.get("max_n", 1))
        self.table = {rid: {int(n): list(t) for n, t in per.items()} for rid, per in p.get("proposals", {}).items()}
        self.draft = Draft(draft_engine) if draft_engine is not None else None
        self.before: dict[str, bytes] = {}
        self.counts: dict[str, dict] = {}
        self.cap = int(cfg.get("backoff", 0))         # DESIGN §13 backoff (0: off)
        self.misses: dict[str, int] = {}               # verify rows in a row that accepted nothing
        self.pause: dict[str, int] = {}                # decode rows left that propose nothing

    def take(self, rid: str) -> bool:
        """Called once per decode row of `rid`: True when backoff pauses it (it proposes nothing)."""
        left = self.pause.get(rid, 0)
        if left:
            self.pause[rid] = left - 1
        return left > 0

    def record(self, rid: str, accepted: int) -> None:
        """A verify row of `rid` accepted `accepted` drafts: after its n-th miss in a row, its next
        min(2^(n-1), backoff) decode rows propose nothing; an acceptance ends the run of misses."""
        if not self.cap:
            return
        if accepted:
            self.misses.pop(rid, None)
            return
        n = self.misses[rid] = self.misses.get(rid, 0) + 1
        self.pause[rid] = min(1 << min(n - 1, 62), self.cap)

    def room(self, n_generated: int, max_new: int, budget: int) -> int:
        """Most drafts a row may feed: min(k, max_new - n_generated, budget), at least 0."""
        return max(0, min(self.k, max_new - n_generated, budget))

    def propose(self, rid: str, tokens: list[int], n_generated: int, max_new: int, budget: int) -> list[int]:
        """Up to room proposals for one request (scripted, ngram)."""
        room = self.room(n_generated, max_new, budget)
        if room == 0:
            return []
        if self.kind == "scripted":
            return list(self.table.get(rid, {}).get(n_generated, ()))[:room]
        return ngram_propose(tokens, room, self.min_n, self.max_n)

    def propose_step(self, rows: list[tuple[str, int, list[int], int, int]], budget: int) -> tuple[dict, int]:
        """Proposals for a step's decode rows (rid, seq, tokens, n_generated, max_new) in row order, each within
        what the rows before it left of `budget`; ({rid: proposals}, budget left). A draft proposes exactly its
        room, so the rooms are known before the draft model runs, and all rows draft in shared batches."""
        props: dict[str, list[int]] = {}
        want = []
        for rid, seq, toks, n, max_new in rows:
            if self.take(rid):
                continue
            if self.draft is not None:
                room = self.room(n, max_new, budget)
                if room:
                    want.append((rid, seq, toks, room))
                    budget -= room
                continue
            d = self.propose(rid, toks, n, max_new, budget)
            if d:
                props[rid], budget = d, budget - len(d)
        if want:
            props.update(self.draft.propose(want))
        return props, budget

    def forget(self, rid: str, seq: int) -> None:
        """A finished request: its draft sequence is freed."""
        if self.draft is not None:
            self.draft.forget(rid, seq)


class Draft:
    """A draft model's per-request state in its own llama.cpp context (seq id = the target's): it has seen every
    token of the request so far; drafting runs past that state and a snapshot puts it back, so the draft never
    needs the target's rollback (a recurrent sequence cannot drop positions: findings L7)."""

    def __init__(self, engine) -> None:
        self.eng = engine              # worker.Engine (or a test's stand-in): _decode, snapshot, restore, lc, mem
        self.seen: dict[str, int] = {}
        engine.lc.llama_memory_clear(engine.mem, True)

    def propose(self, want: list[tuple[str, int, list[int], int]]) -> dict[str, list[int]]:
        """For each (rid, seq, tokens, room): catch the sequence up on tokens it has not seen (one batch for all
        rows), then room greedy tokens (lowest index on ties, one batch per draft position); the sequences are
        restored to the state after their tokens."""
        eng, catch = self.eng, []
        for rid, seq, toks, _ in want:
            if rid not in self.seen:
                eng.lc.llama_memory_seq_rm(eng.mem, seq, -1, -1)
            n = self.seen.get(rid, 0)
            if n >= len(toks):
                raise RuntimeError(f"request {rid}: the draft has seen {n} tokens and is asked after {len(toks)}")
            catch += [(toks[p], p, seq, p == len(toks) - 1) for p in range(n, len(toks))]
            self.seen[rid] = len(toks)
        last = iter(lg for lg in eng._decode(catch) if lg is not None)
        out = {rid: [int(np.argmax(next(last)))] for rid, _, _, _ in want}     # first maximum: lowest index
        snaps = {rid: eng.snapshot(seq) for rid, seq, _, room in want if room > 1}
        while True:
            rows = [(rid, seq, len(toks) + len(out[rid]) - 1) for rid, seq, toks, room in want if len(out[rid]) < room]
            if not rows:
                break
            for (rid, _, _), lg in zip(rows, eng._decode([(out[rid][-1], pos, seq, True) for rid, seq, pos in rows])):
                out[rid].append(int(np.argmax(lg)))
        for rid, seq, _, _ in want:
            if rid in snaps:
                eng.restore(snaps[rid], seq)
        return out

    def forget(self, rid: str, seq: int) -> None:
        """Free the request's draft sequence."""
        if self.seen.pop(rid, None) is not None:
            self.eng.lc.llama_memory_seq_rm(self.eng.mem, seq, -1, -1)


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup as oracle/speculative.py's: the longest n in max_n..min_n whose last-n suffix occurred
    earlier; up to k tokens that followed its most recent earlier occurrence."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return list(tokens[i + n:i + n + k])
    return []
