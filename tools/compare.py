"""Comparison rules between a candidate engine and the truth (DESIGN §5), shared by tests, qualify and replay.

Two kinds of comparison:
- same engine, two modes: tokens must be *bitwise* equal (`compare_bitwise`);
- candidate vs oracle (different arithmetic): *tie-aware* (`compare_tie_aware`). Where tokens differ, the
  difference is a near tie only if the oracle's logit gap between its own top-1 and the candidate's token is
  ≤ τ(dtype) and the candidate's token is in the oracle's top-k; the check then continues teacher-forced
  (the candidate is asked to continue from the oracle's prefix) so one tie does not end it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

# τ: the largest oracle logit gap we accept as a near tie, per candidate compute dtype. A gap above τ cannot be
# explained by that dtype's rounding: if every logit is off by at most e, a flip needs a gap <= 2e, so τ must be
# >= 2× the largest |Δlogit| (TAU_MIN_RATIO keeps headroom above that). Both measured by `python -m tools.measure_tau`
# on every shipped model × corpus trace against the fp64 oracle, 2026-11-30:
#   fp32 (CPU, Triton interpreter): largest |Δlogit| 1.17e-5 -> τ = 1e-3 (~86×);
#   bf16 (H200, compiled kernels): largest |Δlogit| 0.353 (zoo-mamba2; tiny-sort 0.126) -> τ = 1.0 (~2.8×).
# bf16 qualification is therefore a much weaker check than fp32 (a flip across a gap of up to one logit is
# accepted, and reported); run strict qualifications in fp32. fp16 is provisional (not measured). Large models may
# need more: on anchor-3b random weights bf16 vs fp32 first-token logits differed by up to 0.49 (docs/tp.md).
TAU = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 1.0, torch.float16: 0.05}
TAU_MIN_RATIO = {torch.float32: 10.0, torch.bfloat16: 2.5}     # τ / largest measured |Δlogit|, at least
TOP_K = 5


@dataclass
class Mismatch:
    """One differing position: where, both tokens, and the oracle's view of them."""
    request: str
    position: int            # index into the generated tokens
    oracle_token: int
    candidate_token: int
    oracle_gap: float        # oracle logit[oracle_token] - logit[candidate_token]  (>= 0)
    oracle_margin: float     # oracle top-1 minus top-2
    near_tie: bool


@dataclass
class Verdict:
    """Result of comparing one request's tokens."""
    request: str
    ok: bool
    compared: int
    near_ties: list[Mismatch] = field(default_factory=list)
    failure: Mismatch | None = None
    note: str = ""


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit (fp64)."""
    v = torch.topk(logits.double(), 2).values
    return float(v[0] - v[1])


def teacher_forced_logits(model, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Oracle logits that predicted each of `tokens` given prompt + the tokens before it: [len(tokens), vocab]."""
    logits, state = model.prefill(list(prompt))
    rows = [logits[-1]]
    for tok in tokens[:-1]:
        step, state = model.decode(int(tok), state)
        rows.append(step)
    return torch.stack(rows) if tokens else logits.new_zeros(0, logits.shape[-1])


def compare_bitwise(a: dict[str, list[int]], b: dict[str, list[int]]) -> list[str]:
    """Differences between two token dicts that must be identical; [] when equal."""
    problems = []
    for rid in sorted(set(a) | set(b)):
        ta, tb = a.get(rid), b.get(rid)
        if ta != tb:
            if ta is None or tb is None:
                problems.append(f"request {rid}: present on one side only")
                continue
            pos = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            problems.append(f"request {rid}: first difference at generated position {pos} "
                            f"({ta[pos] if pos < len(ta) else 'end'} vs {tb[pos] if pos < len(tb) else 'end'}), "
                            f"lengths {len(ta)} vs {len(tb)}")
    return problems


def decision_row(row: torch.Tensor, sampling, position: int) -> torch.Tensor:
    """The values the sampler takes the first argmax of: the logits (greedy), or logits/T + Gumbel noise of
    (seed, position) for seeded sampling (docs/scheduler.md §6) — so near ties are judged where the choice is made."""
    row = row.double()
    if sampling is None or sampling.kind == "greedy":
        return row
    from oracle.sampling import gumbel_noise
    return row / sampling.temperature + gumbel_noise(sampling.seed, position, row.numel())


def compare_tie_aware(model, request_id: str, prompt: Sequence[int], candidate: Sequence[int],
                      stop_token_ids: Sequence[int], max_new_tokens: int, tau: float,
                      continue_from: Callable[[list[int]], list[int]] | None = None,
                      oracle_logits: torch.Tensor | None = None, sampling=None) -> Verdict:
    """Walk the candidate's tokens under the oracle, teacher-forced; see module docstring.

    `continue_from(prefix)` returns the candidate's continuation after prompt+prefix (tokens after the
    prefix); without it, the check stops at the first near tie and says so in `note`. `sampling` (a trace
    request's) makes seeded requests compare in the sampler's decision space (`decision_row`).
    """
    cand = list(candidate)
    verdict = Verdict(request_id, ok=True, compared=0)
    start = 0
    while True:
        logits = teacher_forced_logits(model, list(prompt) + cand[:start], cand[start:]) \
            if (oracle_logits is None or start > 0) else oracle_logits
        for i, tok in enumerate(cand[start:]):
            pos = start + i
            row = decision_row(logits[i], sampling, len(prompt) + pos)
            o_tok = int(torch.argmax(row))
            verdict.compared = pos + 1
            if o_tok == tok:
                continue
            gap = float(row[o_tok] - row[tok])
            topk = torch.topk(row, min(TOP_K, row.numel())).indices.tolist()
            mm = Mismatch(request_id, pos, o_tok, int(tok), gap, top2_margin(row), gap <= tau and tok in topk)
            if not mm.near_tie:
                verdict.ok, verdict.failure = False, mm
                return verdict
            verdict.near_ties.append(mm)
            if continue_from is None:
                verdict.note = f"stopped at near tie, position {pos}: no teacher-forced continuation available"
                return verdict
            cand = cand[:pos] + [o_tok] + continue_from(cand[:pos] + [o_tok])
            start = pos + 1
            break
        else:
            break
    # Length rule: the candidate must stop exactly where the oracle would on these tokens.
    ends_on_stop = bool(cand) and cand[-1] in set(stop_token_ids)
    if len(cand) > max_new_tokens or (len(cand) < max_new_tokens and not ends_on_stop):
        verdict.ok = False
        verdict.note = f"length {len(cand)} breaks the finish rule (max_new_tokens={max_new_tokens})"
    if any(t in set(stop_token_ids) for t in cand[:-1]):
        verdict.ok = False
        verdict.note = "a stop token appears before the end of the output"
    return verdict
