"""An engine's step rule (how it forms a step's prefill pieces) and the pieces a trace gets under it.

A corpus aimed only at our scheduler's pieces (whole chunks under prefill_chunk) never gives an engine that cuts at
its own budget a short last piece. `StepRule` is what an adapter declares (Capabilities.step_rule) or a user gives
(`qualify --engine-budget`): the budget's rounding, whether decode rows take budget, whether prefill_chunk binds,
whether non-last pieces are cut to whole model chunks, a fixed piece, a rule against one-token remainders, at most
one partial prefill at a time, and the engine's cache block sizes. `simulate` runs a trace's length-only schedule
under a rule (legacy semantics: an arrival into an idle engine is scheduled the same in both modes, which is how
the scenarios place what must reach both); under our own rule (`OURS`) it is the oracle scheduler itself.
`observed_pieces` reads the pieces an engine ran from its schedule log or schedule facts, so the report can say
whether a scenario reached its shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from hybridqual.scenarios.units import ScenarioError


@dataclass(frozen=True)
class StepRule:
    """How an engine forms a step (docs/qualification.md, "The engine's step rule")."""
    name: str = "hybridqual"                 # who declared it (the report quotes it)
    budget_multiple: int = 1                 # the trace's max_tokens_per_step is rounded UP to a multiple of this
    decode_takes_budget: bool = True         # a decode row uses one token of the step's budget
    uses_prefill_chunk: bool = True          # the trace's prefill_chunk caps a piece (Megatron has no such limit)
    chunk_aligned: bool = True               # a non-last piece is cut to whole model chunks (ours), else to the budget
    fixed_piece: int | None = None           # a piece is at most this many tokens (n_ubatch-style), if set
    no_one_token_remainder: bool = False     # a cut that would leave 1 token is made 1 shorter, a 1-token
                                             # cut deferred (Megatron): no split prompt ends with 1 token
    one_partial_prefill: bool = False        # FIFO admission by budget: at most one prompt partly prefilled, and
                                             # nothing behind it is admitted (Megatron's schedule_chunked_prefill)
    mamba_block: int | None = None           # the Mamba state cache's block (hits resume at multiples); None: the
    attention_block: int | None = None       # trace's prefix_cache.block_size; likewise the KV cache's block

    def __post_init__(self) -> None:
        for f in ("budget_multiple", "fixed_piece", "mamba_block", "attention_block"):
            v = getattr(self, f)
            if v is None and f != "budget_multiple":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 16:
                raise ScenarioError(f"step rule {f}: must be an integer in [1, 65536], got {v!r}")
        for f in ("decode_takes_budget", "uses_prefill_chunk", "chunk_aligned", "no_one_token_remainder",
                  "one_partial_prefill"):
            if not isinstance(getattr(self, f), bool):
                raise ScenarioError(f"step rule {f}: must be true or false, got {getattr(self, f)!r}")

    def budget(self, trace_budget: int) -> int:
        """The per-step token budget the engine really uses for a trace's max_tokens_per_step."""
        m = self.budget_multiple
        return -(-trace_budget // m) * m

    def cache_block(self, chunk: int) -> int:
        """The prefix-cache block a hit must land on: a multiple of the chunk and of every declared block."""
        return math.lcm(chunk, self.mamba_block or chunk, self.attention_block or chunk)

    def piece(self, start: int, prompt_len: int, left: int, prefill_chunk: int, chunk: int) -> int:
        """Tokens of a prompt's next piece with `left` budget tokens left in the step (0: none this step)."""
        cap = left
        if self.uses_prefill_chunk:
            cap = min(cap, prefill_chunk)
        if self.fixed_piece is not None:
            cap = min(cap, self.fixed_piece)
        rest = prompt_len - start
        if rest <= cap:
            return rest
        n = cap // chunk * chunk if self.chunk_aligned else cap
        if self.no_one_token_remainder and rest - n == 1:
            n -= 1                      # a 1-token cut is deferred (0): the rest waits for a step with more budget
        return max(n, 0)

    def describe(self) -> str:
        """One line for reports and descriptions."""
        parts = [f"budget rounded up to {self.budget_multiple}" if self.budget_multiple > 1 else "budget as given",
                 "decode rows take budget" if self.decode_takes_budget else "decode rows outside the budget",
                 "prefill_chunk binds" if self.uses_prefill_chunk else "no prefill_chunk",
                 "pieces cut to whole chunks" if self.chunk_aligned else "pieces cut at the budget left"]
        if self.fixed_piece:
            parts.append(f"pieces of at most {self.fixed_piece}")
        if self.no_one_token_remainder:
            parts.append("no one-token remainder")
        if self.one_partial_prefill:
            parts.append("one partial prefill at a time (FIFO)")
        for f in ("mamba_block", "attention_block"):
            if getattr(self, f):
                parts.append(f"{f.replace('_', ' ')} {getattr(self, f)}")
        return f"{self.name}: " + ", ".join(parts)


OURS = StepRule()        # docs/scheduler.md §3.3: the oracle's and the fast path's rule


def parse_step_rule(text: str, name: str = "--engine-budget") -> StepRule:
    """A rule from `key=value,key=value` (keys: StepRule's fields; true/false, an integer or none), over OURS
    with name `name`; a ScenarioError names a bad key or value."""
    known = {f.name: f for f in fields(StepRule) if f.name != "name"}
    values: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip().lower()
        if key not in known or not eq:
            raise ScenarioError(f"{name} {item!r}: expected key=value with key one of {sorted(known)}")
        if raw in ("true", "yes", "1") and known[key].type == "bool":
            values[key] = True
        elif raw in ("false", "no", "0") and known[key].type == "bool":
            values[key] = False
        elif raw == "none" and "None" in str(known[key].type):
            values[key] = None
        elif known[key].type == "bool":
            raise ScenarioError(f"{name} {key}: must be true or false, got {raw!r}")
        else:
            try:
                values[key] = int(raw)
            except ValueError:
                raise ScenarioError(f"{name} {key}: must be an integer, got {raw!r}") from None
    try:
        return replace(OURS, name=name, **values)
    except ScenarioError as e:
        raise ScenarioError(f"{name}: {e}") from None


# ------------------------------------------------------------------------------------------------- simulation

@dataclass
class _Req:
    rid: str
    arrival: int
    prompt: int
    max_new: int
    done: int = 0
    out: int = 0
    admitted: bool = False
    finished: bool = False


@dataclass(frozen=True)
class Piece:
    """One prefill piece a request got: step, start position, token count."""
    step: int
    pos: int
    count: int


def simulate(rule: StepRule, trace, chunk: int, mode: str = "legacy", max_steps: int = 20_000
             ) -> dict[str, list[Piece]]:
    """Each request's prefill pieces when `trace` (an oracle Trace, every finish by length) runs under `rule`.
    OURS runs the oracle scheduler itself (in `mode`); any other rule runs the legacy schedule below."""
    if rule == replace(OURS, name=rule.name):
        return _oracle_pieces(trace, chunk, mode)
    return legacy_pieces(rule, trace, chunk, max_steps)


def legacy_pieces(rule: StepRule, trace, chunk: int, max_steps: int = 20_000) -> dict[str, list[Piece]]:
    """The legacy schedule's pieces under any rule: finishes resolved, then admission (by free slots; or FIFO by
    budget under one_partial_prefill), decode rows first, then pieces in admission order within the budget."""
    e = trace.engine
    B, R = rule.budget(e.max_tokens_per_step), e.max_requests
    reqs = sorted((_Req(r.id, r.arrival_step, len(r.prompt), r.max_new_tokens) for r in trace.requests),
                  key=lambda q: (q.arrival, q.rid))
    out: dict[str, list[Piece]] = {q.rid: [] for q in reqs}
    rows: list[_Req] = []
    sampling: list[_Req] = []
    for k in range(max_steps):
        for q in sampling:                                      # resolve the previous step
            q.out += 1
            if q.out >= q.max_new:
                q.finished = True
        rows = [q for q in rows if not q.finished]
        if all(q.finished for q in reqs):
            return out
        decode = [q for q in rows if q.done >= q.prompt]
        used = len(decode) if rule.decode_takes_budget else 0
        sampling = list(decode)
        prefilling = [q for q in rows if q.done < q.prompt]
        waiting = [q for q in reqs if not q.admitted and q.arrival <= k]
        if not rule.one_partial_prefill:                      # admission by free slots, then pieces in row order
            for q in waiting[:R - len(rows)]:
                q.admitted = True
                rows.append(q)
                prefilling.append(q)
            waiting = []
        for q in prefilling + waiting:
            if rule.one_partial_prefill and not q.admitted and len(rows) >= R:
                break
            n = rule.piece(q.done, q.prompt, B - used, e.prefill_chunk, chunk)
            if n <= 0:
                if rule.one_partial_prefill:
                    break
                continue
            if not q.admitted:
                q.admitted = True
                rows.append(q)
            out[q.rid].append(Piece(k, q.done, n))
            q.done += n
            used += n
            if q.done >= q.prompt:
                sampling.append(q)
            elif rule.one_partial_prefill:
                break
    raise ScenarioError(f"the schedule under {rule.describe()} made no progress within {max_steps} steps")


def _oracle_pieces(trace, chunk: int, mode: str) -> dict[str, list[Piece]]:
    """The oracle scheduler's pieces (a stand-in model: every finish is by length)."""
    from oracle.scheduler import run_trace
    from hybridqual.scenarios.edges import ScheduleModel
    vocab = 1 + max([t for r in trace.requests for t in r.prompt] + [0])
    log = run_trace(ScheduleModel(vocab, chunk), trace, mode).schedule_log.to_json()
    return pieces_from_log(log, [r.id for r in trace.requests])


def pieces_from_log(log: dict, ids: list[str]) -> dict[str, list[Piece]]:
    """Prefill pieces per request from a schedule log in oracle.schedule_log's JSON shape."""
    out: dict[str, list[Piece]] = {i: [] for i in ids}
    for s in log.get("steps", []):
        for b in s.get("batch", []):
            if b.get("kind") == "prefill":
                out.setdefault(b["request"], []).append(Piece(s["step"], b["pos"], b["count"]))
    return out


def pieces_from_facts(facts: list, prompts: dict[str, int]) -> dict[str, list[Piece]]:
    """Prefill pieces per request from an engine's schedule facts (batches of rows {request, pos, tokens}, as
    tools/adapters/megatron/schedule_facts.py records): a row starting before the prompt's end is a piece."""
    out: dict[str, list[Piece]] = {i: [] for i in prompts}
    for k, fact in enumerate(facts):
        batches = fact.get("batches", []) if isinstance(fact, dict) else []
        for b in batches if isinstance(batches, list) else []:
            rows = b.get("rows", []) if isinstance(b, dict) else []
            for r in rows if isinstance(rows, list) else []:
                if not (isinstance(r, dict) and {"request", "pos", "tokens"} <= set(r)):
                    continue
                if r["request"] in prompts and r["pos"] < prompts[r["request"]]:
                    out[r["request"]].append(Piece(k, r["pos"], r["tokens"]))
    return out


def observed_pieces(trace, run) -> dict[str, list[Piece]] | None:
    """The pieces an engine ran, from its RunResult's schedule log or schedule facts (None: it reports neither, or
    facts without per-row pieces)."""
    prompts = {r.id: len(r.prompt) for r in trace.requests}
    log = getattr(run, "schedule_log", None)
    if log is not None:
        return pieces_from_log(log.to_json() if hasattr(log, "to_json") else log, list(prompts))
    facts = getattr(run, "schedule_facts", None)
    if facts is not None:
        pieces = pieces_from_facts(facts, prompts)
        return pieces if any(pieces.values()) else None      # facts of another kind (e.g. counts only)
    return None


def last_pieces(pieces: dict[str, list[Piece]], prompts: dict[str, int]) -> dict[str, int]:
    """request -> the token count of the piece that ended its prompt (requests with no such piece left out)."""
    return {rid: p.count for rid, ps in pieces.items() for p in ps if p.pos + p.count == prompts.get(rid)}
