"""Scenario families that close blind spots of the shipped corpus, and the piece-boundary census.

- request_order: several requests arrive in the same step, listed out of id order and out of arrival order, with
  ids whose string order differs from their numeric order ("r1" < "r10" < "r11" < "r2" < "r9"); fewer slots than
  requests, so the admission order (arrival_step, id as a string) decides rows, slots and the schedule log.
- piece_budget / piece_chunk (family prefill_boundaries): prefill pieces whose remainder is exactly the budget
  left (or prefill_chunk), one less, one more, where that limit is not a multiple of C; a row that gets no piece
  while a later row still fits a short last piece; prompt lengths that are not multiples of C.
- special_ids: bos/pad inside prompts and eos as the stop token, as the model's config names them.
Every request finishes by length only (no stop ids) except in special_ids, so those schedules do not depend on
the model; `piece_census` says which boundaries a schedule log hit (tests/test_scenarios.py asserts them all).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridqual.scenarios.units import Skip, Tokens, Units, request, seeded, trace

MIN_CHUNK = 4     # below this the offsets of the boundary scenarios (+1 .. +5 tokens) wrap past a chunk


def small(start: int, n: int) -> list[int]:
    """n literal ids in [3, 16) (inside the shipped tiny model's vocab, above its bos/eos/pad ids)."""
    return [3 + (start + 5 * j) % 13 for j in range(n)]


def request_order(u: Units, tok: Tokens) -> dict:
    """Same-step arrivals listed out of id and arrival order; string ids that sort unlike their numbers."""
    C = u.chunk
    reqs = [request("r10", 0, tok(small(0, 3)), 3), request("r2", 1, tok(small(1, 2)), 2),
            request("r9", 0, tok(small(2, 4)), 2), request("r20", 0, tok(small(3, 2)), 3),
            request("r1", 0, tok(small(4, 3)), 4), request("r11", 1, tok(small(5, 5)), 2),
            request("a3", 3, tok(small(6, 2)), 2), request("B3", 3, tok(small(7, 3)), 1)]
    return trace("Admission order under shuffled request lists: r10, r9, r20, r1 arrive at step 0 and r2, r11 at "
                 "step 1, listed out of id and arrival order; 2 slots, so they are admitted in (arrival_step, id as a "
                 "string) order r1, r10, r20, r9 | r11, r2 (not file order, not numeric order), then 'B3' before "
                 "'a3' (both step 3: uppercase sorts first). Length-only finishes: the schedule is "
                 "model-independent.", 2, 2 * C + 4, 2 * C, "legacy", reqs)


def piece_budget(u: Units, tok: Tokens) -> dict:
    """Pieces limited by the budget left (B = 2C+3, prefill_chunk 4C never binds)."""
    C = u.chunk
    if C < MIN_CHUNK:
        raise Skip(f"chunk_size {C} < {MIN_CHUNK}: the budget 2C+3 and its +-1 offsets are not distinct "
                   "non-multiples of the chunk")
    B = 2 * C + 3
    reqs = [request("a_eq", 0, tok(small(0, B)), 1),             # remainder == budget left (B, not a multiple)
            request("b_less", 1, tok(small(1, B - 1)), 1),       # one less
            request("c_more", 2, tok(small(2, B + 1)), 1),       # one more: cut at 2C, then a 4-token last piece
            request("d_decoder", 4, tok(small(3, 2)), 6),        # decodes steps 5-9: budget left B-1 for prefills
            request("e_eq", 5, tok(small(4, B - 1)), 1),         # == B-1 = 2C+2 left beside a decode row
            request("f_more", 6, tok(small(5, B)), 1),           # left+1 beside a decode row: cut at 2C
            request("g1", 8, tok(small(6, C + 1)), 1),           # two prefills in one step beside the decoder:
            request("g2", 8, tok(small(7, C + 1)), 1),           # g2's remainder == the C+1 left after g1
            request("h1", 10, tok(small(8, C + 4)), 1),          # leaves C-1: h2 (3C) gets no piece, the scan
            request("h2", 10, tok(small(9, 3 * C)), 1),          # goes on and h3 (2 tokens) still fits
            request("h3", 10, tok(small(10, 2)), 1)]
    return trace(f"Prefill pieces at the budget's edges: budget {B} (2C+3, not a multiple of chunk {C}), "
                 f"prefill_chunk {4 * C}: remainders equal to the budget left, one less and one more, alone and beside "
                 "a decode row and another piece; a row left with less than one chunk gets no piece while a later "
                 "row's short last piece still fits. Length-only finishes: the schedule is model-independent.",
                 3, B, 4 * C, "legacy", reqs)


def piece_chunk(u: Units, tok: Tokens) -> dict:
    """Pieces limited by prefill_chunk P = 2C+3 (not a multiple of C), budget 4C+8."""
    C = u.chunk
    if C < MIN_CHUNK:
        raise Skip(f"chunk_size {C} < {MIN_CHUNK}: prefill_chunk 2C+3 and its +-1 offsets are not distinct "
                   "non-multiples of the chunk")
    P = 2 * C + 3
    reqs = [request("a_eq", 0, tok(small(0, P)), 1),             # remainder == prefill_chunk
            request("b_less", 1, tok(small(1, P - 1)), 1),
            request("c_more", 2, tok(small(2, P + 1)), 2),       # cut at 2C, then 4 tokens
            request("d1", 5, tok(small(3, P + 1)), 1),           # two rows bound by prefill_chunk in one step
            request("d2", 5, tok(small(4, P)), 1),
            request("e_long", 7, tok(small(5, 5 * C + 3)), 2)]   # 5C+3: pieces 2C, 2C, C+3
    return trace(f"Prefill pieces at prefill_chunk's edges: prefill_chunk {P} (2C+3, not a multiple of chunk {C}), "
                 f"budget {4 * C + 8}: remainders equal to prefill_chunk, one less and one more, two such rows in one "
                 f"step, and a {5 * C + 3}-token prompt in three pieces. Length-only finishes: the schedule is "
                 "model-independent.", 2, 4 * C + 8, P, "legacy", reqs)


def special_ids(u: Units, tok: Tokens) -> dict:
    """bos and pad inside prompts, eos as the stop token (the ids the config names)."""
    if u.eos is None or u.pad is None:
        raise Skip("the model's config names no eos_token_id or pad_token_id inside the vocab")
    C, bos, eos, pad = u.chunk, u.bos, u.eos, u.pad
    head = [bos] if bos is not None else []
    t = tok(small(0, 6))
    reqs = [request("pad_inside", 0, head + [t[0], pad, t[1], pad, t[2]], 6, [eos]),
            request("pad_first", 0, [pad, pad] + t[3:5], 6, [eos], seeded(1.0, 11)),
            request("eos_inside", 1, head + [t[5], eos, t[0]], 6, [eos])]
    return trace("Special ids as the config names them: pad inside and at the start of prompts, bos first, eos inside a "
                 "prompt and as every request's stop token (an engine that masks pad or stops on a prompt's eos "
                 "differs).", 2, 2 * C + 4, 2 * C, "legacy", reqs)


EDGES = {"request_order": ("request_order", request_order), "piece_budget": ("prefill_boundaries", piece_budget),
         "piece_chunk": ("prefill_boundaries", piece_chunk), "special_ids": ("special_ids", special_ids)}


# ------------------------------------------------------------------------------------------------ piece census

@dataclass(frozen=True)
class _Config:
    """The two config fields the scheduler reads."""
    vocab_size: int
    chunk_size: int


class ScheduleModel:
    """A stand-in model with constant logits: enough to run the oracle scheduler on traces whose requests finish
    by length only (their schedule does not depend on the logits)."""

    def __init__(self, vocab_size: int, chunk_size: int):
        self.config = _Config(vocab_size, chunk_size)

    def prefill(self, tokens: list[int], state=None):
        """Zero logits for every token (no state)."""
        return torch.zeros(len(tokens), self.config.vocab_size, dtype=torch.float64), None

    def decode(self, token: int, state=None):
        """Zero logits (no state)."""
        return torch.zeros(self.config.vocab_size, dtype=torch.float64), None


def piece_census(trace, log_json: dict, chunk: int) -> set[str]:
    """Which piece-splitter boundaries a legacy schedule log hit (docs/scheduler.md §3.3). Names:
    last_eq_{budget,chunk}, last_less_{budget,chunk}, cut_more_{budget,chunk}: a piece whose remainder was the
    limit (the budget left, or prefill_chunk when that is smaller), the limit - 1, the limit + 1, where the
    limit is not a multiple of C; skip_then_fit: a prefilling row got no piece while a later row got one;
    multi_piece_nonmultiple: a prompt whose length is not a multiple of C finished in its third (or later) piece."""
    if log_json.get("mode") != "legacy":
        raise ValueError("piece_census reads a legacy log (async logs number overlapped rows before compaction)")
    e = trace.engine
    plen = {r.id: len(r.prompt) for r in trace.requests}
    row_of: dict[str, int] = {}
    done, pieces, hits = dict.fromkeys(plen, 0), dict.fromkeys(plen, 0), set()
    for step in log_json["steps"]:
        row_of.update({a["request"]: a["row"] for a in step["admit"]})
        used, fed = 0, []
        for b in step["batch"]:
            if b["kind"] == "prefill":
                rid = b["request"]
                left, rem = e.max_tokens_per_step - used, plen[rid] - b["pos"]
                limit, which = (left, "budget") if left < e.prefill_chunk else (e.prefill_chunk, "chunk")
                kind = {0: "last_eq", 1: "last_less", -1: "cut_more"}.get(limit - rem)
                if kind and limit % chunk:
                    hits.add(f"{kind}_{which}")
                pieces[rid] += 1
                if pieces[rid] >= 3 and plen[rid] % chunk and b["pos"] + b["count"] == plen[rid]:
                    hits.add("multi_piece_nonmultiple")
                fed.append(b["row"])
            used += b["count"]
        skipped = [row_of[rid] for rid in row_of if done[rid] < plen[rid]
                   and not any(b["request"] == rid and b["kind"] == "prefill" for b in step["batch"])]
        if fed and any(r < max(fed) for r in skipped):
            hits.add("skip_then_fit")
        for b in step["batch"]:
            if b["kind"] == "prefill":
                done[b["request"]] = b["pos"] + b["count"]
        for f in step["free"]:
            row_of.pop(f["request"], None)
        for m in step["moves"]:
            row_of[m["request"]] = m["to_row"]
    return hits


def census_of(trace, chunk: int, vocab: int) -> set[str]:
    """piece_census of the oracle scheduler's legacy log for `trace` (length-only finishes: any logits will do)."""
    from oracle.scheduler import run_trace
    return piece_census(trace, run_trace(ScheduleModel(vocab, chunk), trace, "legacy").schedule_log.to_json(), chunk)
