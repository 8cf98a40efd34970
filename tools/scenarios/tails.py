"""Short last prefill pieces under an engine's own step rule (tools/scenarios/step_rule.py), for piece_tails.

A scenario's requests are written for our rule; under another engine's rule (its budget rounded, no prefill_chunk,
a rule against one-token remainders) the same prompts may not be split at all. `add_rule_tails` finds, for every
last-piece length 1..d_conv the scenario's own requests do not reach under the rule, a small group that does
(one prompt alone, or a filler prompt that leaves the target a sliver of the budget) and appends it, arriving
when the engine is idle (everything before it finished, with slack), so the legacy and async schedules give it
the same pieces. `Shape` is what the instance promises: request -> its last piece's length under the rule.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable

from hybridqual.scenarios.step_rule import OURS, Piece, StepRule, last_pieces, simulate
from hybridqual.scenarios.units import request, trace

MAX_SLOTS = 8    # the most slots a trace gets for filler prompts (check_against_model: B >= R - 1 + C holds)
SLACK = 3        # idle steps between groups: an async engine learns of a finish one step late


@dataclass(frozen=True)
class Shape:
    """What an instance promises an engine under its rule: request -> the length of its last (split) piece."""
    rule: str
    last_pieces: tuple[tuple[str, int], ...]
    unreachable: tuple[int, ...] = ()      # lengths no searched group reaches under the rule

    def to_json(self) -> dict:
        return {"rule": self.rule, "last_pieces": dict(self.last_pieces), "unreachable": list(self.unreachable)}


def split_tails(pieces: dict[str, list[Piece]], prompts: dict[str, int]) -> dict[str, int]:
    """request -> its last piece's length, for prompts split into two or more pieces."""
    last = last_pieces(pieces, prompts)
    return {rid: n for rid, n in last.items() if len(pieces[rid]) >= 2}


def _parse(obj: dict):
    from oracle.trace import parse_trace
    return parse_trace({k: v for k, v in obj.items() if k != "shape"})


def _schedules(rule: StepRule, obj: dict, chunk: int) -> list[dict[str, list[Piece]]]:
    """The pieces under the rule: both modes for our rule (the oracle scheduler), the legacy schedule otherwise."""
    tr = _parse(obj)
    modes = ("legacy", "async") if rule == replace(OURS, name=rule.name) else ("legacy",)
    return [simulate(rule, tr, chunk, m) for m in modes]


def _idle_step(obj: dict, pieces: dict[str, list[Piece]]) -> int:
    """A step at which every request of `obj` has finished under the simulated pieces, plus SLACK."""
    end = 0
    for r in obj["requests"]:
        ps = pieces.get(r["id"]) or [Piece(r["arrival_step"], 0, 0)]
        end = max(end, ps[-1].step + r["max_new_tokens"] + 1)
    return end + SLACK


def _group_pieces(rule: StepRule, engine: dict, chunk: int, prompts: list[int]) -> dict[str, list[Piece]]:
    """The pieces of a group (g0, g1, ...) arriving together into an idle engine."""
    reqs = [request(f"g{i}", 0, [3] * n, 2) for i, n in enumerate(prompts)]
    e = (engine["max_requests"], engine["max_tokens_per_step"], engine["prefill_chunk"])
    if rule == replace(OURS, name=rule.name):
        return simulate(rule, _parse(trace("", *e, "legacy", reqs)), chunk)
    tr = SimpleNamespace(engine=SimpleNamespace(max_requests=e[0], max_tokens_per_step=e[1], prefill_chunk=e[2]),
                         requests=[SimpleNamespace(id=f"g{i}", arrival_step=0, prompt=range(n), max_new_tokens=2)
                                   for i, n in enumerate(prompts)])    # what legacy_pieces reads, unvalidated
    return simulate(rule, tr, chunk)


def _group_tail(rule: StepRule, engine: dict, chunk: int, prompts: list[int]) -> int | None:
    """The last split piece of the group's final prompt, the group arriving alone into an idle engine."""
    pieces = _group_pieces(rule, engine, chunk, prompts)
    return split_tails(pieces, {f"g{i}": n for i, n in enumerate(prompts)}).get(f"g{len(prompts) - 1}")


def _fillers(rule: StepRule, total: int, slots: int, prefill_chunk: int) -> list[int] | None:
    """`total` filler tokens as prompts the rule takes whole in one step (split by its piece cap), or None."""
    cap = min(rule.fixed_piece or total, prefill_chunk if rule.uses_prefill_chunk else total)
    parts = [cap] * (total // cap) + ([total % cap] if total % cap else [])
    return parts if 1 <= len(parts) <= slots else None


def find_group(rule: StepRule, engine: dict, chunk: int, j: int, max_len: int | None) -> list[int] | None:
    """Prompt lengths of a group whose last prompt ends with a j-token piece under `rule`: one prompt alone, else
    fillers then the target (fillers that leave the target a sliver of the budget); None when none does. The
    candidates are a long target's cut points + j (the rule cuts a prompt where it cuts a longer one)."""
    B = rule.budget(engine["max_tokens_per_step"])
    top = 3 * B + j + 1 if max_len is None else min(3 * B + j + 1, max_len)
    groups = [[]] + [f for t in range(B - 1, max(0, B - 2 * j - 4), -1)
                     if (f := _fillers(rule, t, engine["max_requests"] - 1, engine["prefill_chunk"])) is not None]
    for fill in groups:
        pieces = _group_pieces(rule, engine, chunk, fill + [top])[f"g{len(fill)}"]
        cuts = [p.pos for p in pieces[1:]]
        for n in sorted({c + j for c in cuts} | set(range(2, j + 2)) if fill else {c + j for c in cuts}):
            if n <= top and _group_tail(rule, engine, chunk, fill + [n]) == j:
                return fill + [n]
    return None


def add_rule_tails(obj: dict, rule: StepRule, chunk: int, d_conv: int, ids: Callable[[int, int], list[int]],
                   max_len: int | None) -> tuple[dict, Shape]:
    """`obj` with groups appended for every last-piece length 1..d_conv its requests miss under `rule`, and the
    shape the result reaches (verified by simulating the whole trace again). `ids(i, n)`: n prompt ids. Where a
    length needs more filler prompts than the trace has slots (a rule that caps pieces and forbids one-token
    remainders), the trace is built again with MAX_SLOTS slots."""
    out, shape = _add_rule_tails(obj, rule, chunk, d_conv, ids, max_len)
    if shape.unreachable and obj["engine"]["max_requests"] < MAX_SLOTS:
        wide = {**obj, "engine": {**obj["engine"], "max_requests": MAX_SLOTS}}
        out2, shape2 = _add_rule_tails(wide, rule, chunk, d_conv, ids, max_len)
        if len(shape2.unreachable) < len(shape.unreachable):
            return out2, shape2
    return out, shape


def _add_rule_tails(obj: dict, rule: StepRule, chunk: int, d_conv: int, ids: Callable[[int, int], list[int]],
                    max_len: int | None) -> tuple[dict, Shape]:
    """add_rule_tails with the trace's own slots. Under another engine's rule only the legacy schedule is
    simulated, and the scenario's own requests arrive into a busy engine, which an async engine may cut otherwise
    (Megatron's async run split piece_tails' mod64 38 + 27 where legacy cut 63 + 2): there, only the appended groups,
    arriving into an idle engine, count and are promised."""
    ours = rule == replace(OURS, name=rule.name)
    first = _schedules(rule, obj, chunk)
    prompts = {r["id"]: len(r["prompt"]) for r in obj["requests"]}
    reached = [split_tails(p, prompts) for p in first]
    have = set.intersection(*(set(r.values()) for r in reached)) if ours else set()
    reqs, unreachable, at = list(obj["requests"]), [], _idle_step(obj, first[0])
    for j in range(1, d_conv + 1):
        if j in have:
            continue
        group = find_group(rule, obj["engine"], chunk, j, max_len)
        if group is None:
            unreachable.append(j)
            continue
        names = [f"rfill{j}_{i}" for i in range(len(group) - 1)] + [f"rtail{j}"]
        reqs += [request(nm, at, ids(40 + 2 * j + i, n), 2) for i, (nm, n) in enumerate(zip(names, group))]
        grown = {**obj, "requests": reqs}
        at = _idle_step(grown, _schedules(rule, grown, chunk)[0])
    out = {**obj, "requests": reqs}
    final = _schedules(rule, out, chunk)
    prompts = {r["id"]: len(r["prompt"]) for r in reqs}
    tails = [split_tails(p, prompts) for p in final]
    own = set() if ours else {r["id"] for r in obj["requests"]}      # the scenario's own requests
    agreed = {rid: n for rid, n in tails[0].items()
              if all(t.get(rid) == n for t in tails) and n <= d_conv and rid not in own}
    return out, Shape(rule.describe(), tuple(sorted(agreed.items())), tuple(unreachable))
