"""The logits check on what a server returns: top-k logprobs, not whole rows (the rule of `judge_position`).

A logprob is the logit minus the row's log-sum-exp, so a server's logprobs are its logits up to one unknown constant
C per row. At every generated position, with t the server's token, S its returned {id: logprob} and o the
oracle's fp64 teacher-forced row on the server's own tokens:

1. own greedy choice: t has the largest logprob in S (ties allowed). A sampler that is not greedy on the row it
   reports (penalties, a banned token, logprobs from another row) fails here.
2. values: with dev_i = S[i] - o[i] over the returned ids (underflowed entries, below UNDERFLOW_LOGPROB, count as
   not returned), the least max|Δlogit| that any logits row with these logprobs can have is
   R = max((max dev - min dev) / 2, (o_miss - min S + max dev) / 2), o_miss = the oracle's largest logit among the
   ids not returned (a token the oracle ranks high that the server left out of its top-k: its logit there is at most
   min S + C). The rule is R <= c · max(1, std(o)), c = compare.LOGITS_C of the compute dtype — compare_logits'
   bound, applied to the best-aligned row the evidence allows, so a PASS here never hides an error the full-row
   check would see on these ids, and with k >= vocab it is that check.
3. ties: where the oracle's top-1 differs from t, the oracle's gap o[top-1] - o[t] must be <= τ and its top-1 must
   be among the returned ids (the tokens check applies the same τ and rank bound; here the server's own evidence
   is also required to show the tie).
Fewer entries than asked (min(k, vocab)) at any position is a FAIL naming the position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridqual.adapters.openai.client import UNDERFLOW_LOGPROB


@dataclass
class PositionVerdict:
    ok: bool
    residual: float          # R (see module docstring)
    bound: float             # c · max(1, std(o))
    problem: str = ""
    near_tie: bool = False


def judge_position(row: dict[int, float], sampled_lp: float | None, tok: int, oracle_row: torch.Tensor,
                   c: float, tau: float) -> PositionVerdict:
    """The rule of the module docstring at one position."""
    o = oracle_row.double()
    scale = max(1.0, float(o.std()))
    bound = c * scale
    s = dict(row)
    if tok not in s and sampled_lp is not None:
        s[tok] = sampled_lp
    if tok not in s:
        return PositionVerdict(False, float("inf"), bound, f"the server's token {tok} has no logprob")
    best = max(s.values())
    if s[tok] < best:
        top = max(s, key=lambda i: (s[i], -i))
        return PositionVerdict(False, float("inf"), bound,
                               f"the server's token {tok} (logprob {s[tok]:.6g}) is not the top-1 of its own "
                               f"logprobs (token {top}, {best:.6g}): not greedy on the row it reports")
    kept = {i: v for i, v in s.items() if v > UNDERFLOW_LOGPROB and 0 <= i < o.numel()}
    dev = [v - float(o[i]) for i, v in kept.items()]
    r = (max(dev) - min(dev)) / 2
    missing = torch.ones(o.numel(), dtype=torch.bool)
    missing[list(kept)] = False
    if bool(missing.any()):
        o_miss = float(o[missing].max())
        r = max(r, (o_miss - min(kept.values()) + max(dev)) / 2)
    o_top = int(torch.argmax(o))
    tie = False
    if o_top != tok:
        gap = float(o[o_top] - o[tok])
        if gap > tau:
            return PositionVerdict(False, r, bound, f"oracle top-1 {o_top} is {gap:.3g} above the server's token "
                                                    f"{tok} (> τ={tau:g})")
        if o_top not in kept:
            return PositionVerdict(False, r, bound, f"the oracle's top-1 {o_top} (gap {gap:.3g} <= τ) is not among "
                                                    "the server's returned logprobs")
        tie = True
    if not r <= bound:
        return PositionVerdict(False, r, bound, f"server logprobs vs oracle logits: least max|Δlogit| {r:.3g} > "
                                                f"{bound:.3g}")
    return PositionVerdict(True, r, bound, near_tie=tie)
