"""Comparison rules between a candidate engine and the truth (DESIGN §5), shared by tests, qualify and replay.

Two kinds of comparison:
- same engine, two modes: tokens must be *bitwise* equal (`compare_bitwise`);
- candidate vs oracle (different arithmetic): *tie-aware* (`compare_tie_aware`). Where tokens differ, the
  difference is a near tie only if the oracle's logit gap between its own top-1 and the candidate's token is
  ≤ τ(dtype) and the candidate's token is in the oracle's top-k(dtype); the check then continues teacher-forced
  (the candidate is asked to continue from the oracle's prefix) so one tie does not end it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


class PerDtype(dict):
    """Constants per compute dtype; a dtype that is an adapters.base.MeasuredPrecision brings its own (`attr`)."""

    def __init__(self, attr: str, values: dict) -> None:
        super().__init__(values)
        self.attr = attr

    def __missing__(self, dtype):
        if hasattr(dtype, self.attr):
            return getattr(dtype, self.attr)
        raise KeyError(dtype)

    def get(self, dtype, default=None):
        return self[dtype] if dtype in self or hasattr(dtype, self.attr) else default


# τ: the largest oracle logit gap accepted as a near tie, per candidate compute dtype. A gap above τ cannot be
# explained by that dtype's rounding: if every logit is off by at most e, a flip needs a gap <= 2e, so τ must be at
# least TAU_MIN_RATIO × the largest |Δlogit| `python -m hybridqual.measure_tau` measured for the dtype against the fp64
# oracle on every shipped model × corpus trace (MEASURED_ERR; the measurements: docs/qualification.md, "Comparison
# rules"). bf16 is therefore a much weaker check than fp32 (a flip across a gap of about one logit is accepted, and
# reported): run strict qualifications in fp32. fp16 is provisional (not measured). qualify picks τ from the
# candidate's declared compute dtype (`tau_for`); `--tau` overrides it.
TAU = PerDtype("tau", {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 1.25, torch.float16: 0.05})
TAU_MIN_RATIO = {torch.float32: 10.0, torch.bfloat16: 2.5}     # τ / largest measured |Δlogit|, at least
# largest |Δlogit| measured, per dtype (docs/qualification.md, "Comparison rules")
MEASURED_ERR = PerDtype("measured_err", {torch.float32: 1.17e-5, torch.bfloat16: 0.443})
# The rank part of the near-tie rule (DESIGN §5, vLLM's "each side's token in the other's top-k"; this checks the
# oracle's side): the candidate's token must be among the oracle's top k. fp32: k = 5 (τ = 1e-3: rounding cannot
# reach past the first few tokens); bf16: TAU_MIN_RATIO × the deepest oracle rank of a flip the measured error
# explains (docs/qualification.md, "Comparison rules"; docs/findings.md).
TOP_K = PerDtype("top_k", {torch.float64: 5, torch.float32: 5, torch.bfloat16: 23, torch.float16: 5})

# The logits check (`compare_logits`): at every generated position, max|Δlogit| <= c · max(1, std(oracle row)).
# Scaling by the row's spread makes the rule about the logit *scale*: a transform that keeps the argmax (logits × 1.01,
# a multiplier applied the wrong way) moves every logit by ~1% of its size and fails, while rounding noise does not.
# c per dtype: at least LOGITS_MIN_RATIO × the largest scaled error `python -m hybridqual.measure_tau` measured
# (docs/qualification.md, "Comparison rules", with the distributions).
LOGITS_C = PerDtype("logits_c", {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 1.25,
                                  torch.float16: 0.05})
LOGITS_MIN_RATIO = {torch.float32: 10.0, torch.bfloat16: 2.5}


def tau_for(dtype: torch.dtype | None) -> float:
    """The near-tie threshold for a candidate computing in `dtype` (float32's when undeclared: the strictest used)."""
    return TAU[dtype or torch.float32]


def top_k_for(dtype: torch.dtype | None) -> int:
    """The rank bound of the near-tie rule for a candidate computing in `dtype` (float32's when undeclared)."""
    return TOP_K[dtype or torch.float32]


def tie_bound(eligible: int, dtype: torch.dtype | None, tau: float) -> int:
    """Most forgiven near ties that are plausible among `eligible` positions (oracle margin <= τ) for `dtype`.

    A position flips only if the candidate's error on the gap exceeds the oracle's margin there, i.e. margin <= 2E
    (E = the dtype's largest measured |Δlogit|). With margins spread evenly over [0, τ], a fraction p = 2E/τ of the
    eligible positions can flip at all; the bound is the binomial mean plus 3σ, plus one. An engine that takes the
    runner-up whenever it is close (a bias, not rounding) flips nearly every eligible position and exceeds it.
    """
    e = MEASURED_ERR.get(dtype or torch.float32)
    p = 1.0 if e is None else min(1.0, 2 * e / tau) if tau > 0 else 1.0
    return int(p * eligible + 3 * (eligible * p * (1 - p)) ** 0.5) + 1


def logit_scale(row: torch.Tensor) -> float:
    """max(1, std(row)) of an oracle logits row: the unit the logits check measures errors in."""
    return max(1.0, float(row.double().std()))


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
    oracle_rank: int = 0     # oracle logits strictly above the candidate's token (its 0-based rank; TOP_K bounds it)


@dataclass
class Verdict:
    """Result of comparing one request's tokens.

    `near_ties` are the forgiven flips (on the candidate's own tokens, then on its continuations from the oracle's
    prefix); `eligible` counts the positions walked whose oracle margin is <= τ (where a flip could be forgiven).
    """
    request: str
    ok: bool
    compared: int
    near_ties: list[Mismatch] = field(default_factory=list)
    failure: Mismatch | None = None
    note: str = ""
    eligible: int = 0

    @property
    def min_tie_margin(self) -> float | None:
        """The smallest oracle margin among the forgiven near ties (None without any)."""
        return min((m.oracle_margin for m in self.near_ties), default=None)


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit (fp64)."""
    v = torch.topk(logits.double(), 2).values
    return float(v[0] - v[1])


def teacher_forced_logits(model, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Oracle logits that predicted each of `tokens` given prompt + the tokens before it: [len(tokens), vocab]."""
    if hasattr(model, "teacher_forced_logits"):     # oracle.streamed.StreamedOracle: one streamed fp64 pass
        return model.teacher_forced_logits(prompt, tokens)
    # One prefill of prompt + tokens[:-1]: the same rows as a prefill then one decode per token up to fp64 rounding
    # (chunked scan vs recurrence, ~1e-14), one pass over the weights instead of len(tokens) (a 3B oracle on a GPU).
    logits, _ = model.prefill(list(prompt) + [int(t) for t in tokens[:-1]])
    return logits[len(prompt) - 1:] if tokens else logits.new_zeros(0, logits.shape[-1])


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


def _judge(request_id: str, row: torch.Tensor, tok: int, pos: int, tau: float, verdict: Verdict,
           top_k: int = TOP_K[torch.float32]) -> Mismatch | None:
    """None when the oracle's choice in decision row `row` is `tok`, else the Mismatch (near tie or not)."""
    margin = top2_margin(row)
    verdict.eligible += margin <= tau
    o_tok = int(torch.argmax(row))
    if o_tok == tok:
        return None
    gap = float(row[o_tok] - row[tok])
    topk = torch.topk(row, min(top_k, row.numel())).indices.tolist()
    rank = int((row > row[tok]).sum())
    return Mismatch(request_id, pos, o_tok, int(tok), gap, margin, gap <= tau and tok in topk, rank)


def _finish_rule(cand: list[int], stop_token_ids: Sequence[int], max_new_tokens: int) -> str:
    """'' when `cand` obeys the finish rule (stop token last, or exactly max_new_tokens), else why not."""
    stops = set(stop_token_ids)
    if any(t in stops for t in cand[:-1]):
        return "a stop token appears before the end of the output"
    if len(cand) > max_new_tokens or (len(cand) < max_new_tokens and not (cand and cand[-1] in stops)):
        return f"length {len(cand)} breaks the finish rule (max_new_tokens={max_new_tokens})"
    return ""


def compare_tie_aware(model, request_id: str, prompt: Sequence[int], candidate: Sequence[int],
                      stop_token_ids: Sequence[int], max_new_tokens: int, tau: float,
                      continue_from: Callable[[list[int]], list[int]] | None = None,
                      oracle_logits: torch.Tensor | None = None, sampling=None,
                      top_k: int = TOP_K[torch.float32]) -> Verdict:
    """Walk the candidate's tokens under the oracle, teacher-forced; see module docstring.

    Two walks: (1) every token the candidate emitted, on its own prefix (`oracle_logits`, if given, are the oracle's
    rows for exactly that); (2) DESIGN §5: after the first near tie, the candidate's continuation from the oracle's
    prefix, `continue_from(prefix)` (tokens after the prefix), again and again at every further tie. Without
    `continue_from`, walk (2) is not done and `note` says so. `sampling` (a trace request's) makes seeded requests
    compare in the sampler's decision space (`decision_row`). `top_k`: the rank bound (`top_k_for` the dtype).
    """
    cand = list(candidate)
    verdict = Verdict(request_id, ok=True, compared=0)
    logits = oracle_logits if oracle_logits is not None else teacher_forced_logits(model, prompt, cand)
    first_tie = None
    for pos, tok in enumerate(cand):
        mm = _judge(request_id, decision_row(logits[pos], sampling, len(prompt) + pos), tok, pos, tau, verdict, top_k)
        verdict.compared = pos + 1
        if mm is not None and not mm.near_tie:
            verdict.ok, verdict.failure = False, mm
            return verdict
        if mm is not None:
            verdict.near_ties.append(mm)
            first_tie = pos if first_tie is None else first_tie
    why = _finish_rule(cand, stop_token_ids, max_new_tokens)
    if why or first_tie is None:
        verdict.ok, verdict.note = not why, why
        return verdict
    if continue_from is None:
        verdict.note = (f"stopped at near tie, position {first_tie}: the continuation from the oracle's prefix was "
                        "not checked (no teacher-forced continuation available)")
        return verdict
    tie = verdict.near_ties[0]
    while tie is not None:
        pos = tie.position
        cand = cand[:pos] + [tie.oracle_token] + continue_from(cand[:pos] + [tie.oracle_token])
        start, tie = pos + 1, None
        logits = teacher_forced_logits(model, list(prompt) + cand[:start], cand[start:])
        for i, tok in enumerate(cand[start:]):
            p = start + i
            mm = _judge(request_id, decision_row(logits[i], sampling, len(prompt) + p), tok, p, tau, verdict, top_k)
            if mm is not None and not mm.near_tie:
                verdict.ok, verdict.failure = False, mm
                verdict.note = "after a near tie, the continuation from the oracle's prefix diverges"
                return verdict
            if mm is not None:
                verdict.near_ties.append(mm)
                tie = mm
                break
    why = _finish_rule(cand, stop_token_ids, max_new_tokens)
    verdict.ok, verdict.note = not why, why and f"continuation from the oracle's prefix: {why}"
    return verdict


@dataclass
class LogitsVerdict:
    """Result of the logits check for one request: the worst position and its error against the bound."""
    request: str
    ok: bool
    positions: int
    worst_position: int = -1
    worst_error: float = 0.0          # max|Δlogit| at worst_position
    worst_bound: float = 0.0          # c · max(1, std(oracle row)) there
    note: str = ""
    max_rank: int = 0                 # largest rank of the candidate's argmax in the oracle's row (0 = same top-1)


def compare_logits(request_id: str, got: torch.Tensor, want: torch.Tensor, c: float) -> LogitsVerdict:
    """Candidate logits rows `got` [n, V] vs the oracle's teacher-forced rows `want` [n, V] for the same tokens:
    at every position max|Δ| <= c · max(1, std(want row)); the worst position (largest error/bound) is reported."""
    if got.shape != want.shape:
        return LogitsVerdict(request_id, False, 0, note=f"shape {tuple(got.shape)} vs oracle {tuple(want.shape)}")
    v = LogitsVerdict(request_id, True, got.shape[0])
    worst = -1.0
    for i in range(got.shape[0]):
        row = want[i].double()
        err = float((got[i].double() - row).abs().max())
        bound = c * logit_scale(row)
        v.max_rank = max(v.max_rank, int((row > row[int(torch.argmax(got[i]))]).sum()))
        if not err <= bound:          # NaN fails too
            v.ok = False
        if not err / bound <= worst:
            worst = err / bound if err == err else float("inf")
            v.worst_position, v.worst_error, v.worst_bound = i, err, bound
    return v
