"""Speculative decoding, the truth (DESIGN §13): the `engine.speculative` field, the three proposers, verification.

    verify row:  inputs [last emitted token, d_1 .. d_m] at positions [p, p+m]   (m <= k proposals)
                 c_i = the request's own sampler choice after input i, at absolute position p+1+i
                 a   = number of leading drafts with d_{i+1} == c_i                (the accepted count)
                 emitted = c_0 .. c_a   (a accepted drafts, then the bonus c_a), cut by stop / max_new_tokens
    after the step the request's state holds the prompt and every emitted token but the last.

The oracle computes c_i by decoding the inputs one by one and stops at the first rejected draft, so its state
after the step is the state of exactly the a+1 accepted inputs (no rollback needed) and its arithmetic is that
of plain decode: speculation cannot change a token here, which is what makes this side the truth.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sampling import greedy, sample
from .trace_error import TraceError

PROPOSER_KINDS = ("ngram", "draft", "scripted")
ROOT = Path(__file__).resolve().parent.parent
PATH = "engine.speculative"


@dataclass(frozen=True)
class ProposerConfig:
    """One proposer: ngram (min_n..max_n), draft (HF model folder), or scripted ({request: {n_generated: ids}})."""

    kind: str
    min_n: int = 1
    max_n: int = 1
    model: str = ""
    proposals: tuple[tuple[str, tuple[tuple[int, tuple[int, ...]], ...]], ...] = ()

    def table(self) -> dict[str, dict[int, tuple[int, ...]]]:
        """Scripted proposals as {request_id: {n_generated: tokens}}."""
        return {rid: dict(per) for rid, per in self.proposals}

    def to_json(self) -> dict[str, Any]:
        """JSON form (only the fields the kind uses)."""
        if self.kind == "ngram":
            return {"kind": "ngram", "min_n": self.min_n, "max_n": self.max_n}
        if self.kind == "draft":
            return {"kind": "draft", "model": self.model}
        return {"kind": "scripted", "proposals": {rid: {str(n): list(t) for n, t in per}
                                                  for rid, per in self.proposals}}


@dataclass(frozen=True)
class SpecConfig:
    """`engine.speculative`: at most k proposals per row and step, from `proposer`; `backoff` > 0: a request whose
    drafts keep missing drafts less (Backoff), 0: every decode row asks the proposer."""

    k: int
    proposer: ProposerConfig
    backoff: int = 0

    def to_json(self) -> dict[str, Any]:
        """JSON form (backoff only when on)."""
        out = {"k": self.k, "proposer": self.proposer.to_json()}
        if self.backoff:
            out["backoff"] = self.backoff
        return out


# ---------------------------------------------------------------------------------------------------- parsing

def _int(v: Any, path: str, lo: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TraceError(path, f"must be an integer, got {type(v).__name__} {v!r}")
    if v < lo:
        raise TraceError(path, f"must be >= {lo}, got {v}")
    return v


def _keys(obj: Any, path: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(obj, dict):
        raise TraceError(path, f"must be an object, got {type(obj).__name__}")
    missing, unknown = sorted(required - obj.keys()), sorted(obj.keys() - required - optional)
    if missing:
        raise TraceError(f"{path}.{missing[0]}", "missing required field")
    if unknown:
        raise TraceError(f"{path}.{unknown[0]}", "unknown field")
    return obj


def _parse_scripted(obj: Any, path: str) -> tuple:
    if not isinstance(obj, dict):
        raise TraceError(path, f"must be an object {{request_id: {{n_generated: [tokens]}}}}, got "
                         f"{type(obj).__name__}")
    out = []
    for rid in sorted(obj):
        per, p = obj[rid], f"{path}.{rid}"
        if not isinstance(per, dict):
            raise TraceError(p, f"must be an object {{n_generated: [tokens]}}, got {type(per).__name__}")
        rows = []
        for key in per:
            if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
                raise TraceError(f"{p}.{key}", "key must be a number of generated tokens (decimal integer >= 0)")
            toks = per[key]
            if not isinstance(toks, list):
                raise TraceError(f"{p}.{key}", f"must be a list of token ids, got {type(toks).__name__}")
            for j, t in enumerate(toks):
                _int(t, f"{p}.{key}[{j}]", 0)
            rows.append((int(key), tuple(toks)))
        out.append((rid, tuple(sorted(rows))))
    return tuple(out)


def parse_speculative(obj: Any, path: str = PATH) -> SpecConfig:
    """Validate the `engine.speculative` object (docs/trace-format.md); every error names the field."""
    _keys(obj, path, {"k", "proposer"}, {"backoff"})
    k = _int(obj["k"], f"{path}.k", 1)
    backoff = _int(obj.get("backoff", 0), f"{path}.backoff", 0)
    return dataclasses.replace(_parse_proposer(obj, path, k), backoff=backoff)


def _parse_proposer(obj: dict, path: str, k: int) -> SpecConfig:
    """The proposer half of parse_speculative (backoff 0)."""
    p, pp = obj["proposer"], f"{path}.proposer"
    kind = p.get("kind") if isinstance(p, dict) else None
    if kind not in PROPOSER_KINDS:
        raise TraceError(f"{pp}.kind", f"unknown proposer kind {kind!r}; expected one of {PROPOSER_KINDS}")
    if kind == "ngram":
        _keys(p, pp, {"kind", "min_n", "max_n"})
        lo = _int(p["min_n"], f"{pp}.min_n", 1)
        hi = _int(p["max_n"], f"{pp}.max_n", 1)
        if hi < lo:
            raise TraceError(f"{pp}.max_n", f"must be >= min_n {lo}, got {hi}")
        return SpecConfig(k, ProposerConfig("ngram", min_n=lo, max_n=hi))
    if kind == "draft":
        _keys(p, pp, {"kind", "model"})
        if not isinstance(p["model"], str) or not p["model"]:
            raise TraceError(f"{pp}.model", f"must be a non-empty path, got {p['model']!r}")
        return SpecConfig(k, ProposerConfig("draft", model=p["model"]))
    _keys(p, pp, {"kind", "proposals"})
    table = _parse_scripted(p["proposals"], f"{pp}.proposals")
    for rid, per in table:
        for n, toks in per:
            if len(toks) > k:
                raise TraceError(f"{pp}.proposals.{rid}.{n}", f"{len(toks)} proposals > k = {k}")
    return SpecConfig(k, ProposerConfig("scripted", proposals=table))


def model_path(spec: SpecConfig) -> Path:
    """The draft model folder: an absolute path, or relative to the working directory, else to the checkout root;
    a shipped `goldens/...` path also where an installed wheel keeps goldens/ (hybridqual/data/)."""
    p = Path(spec.proposer.model)
    shipped = (ROOT / "hybridqual" / "data" / Path(*p.parts[1:]),) if p.parts[:1] == ("goldens",) else ()
    for cand in ((p,) if p.is_absolute() else (p, ROOT / p, *shipped)):
        if (cand / "config.json").exists():
            return cand
    raise TraceError(f"{PATH}.proposer.model", f"no HF model folder (config.json) at {spec.proposer.model!r}")


def check_speculative(trace, vocab_size: int, chunk_size: int) -> None:
    """Run-time checks of `engine.speculative` against a model: the budget holds every verify row and one chunk
    of prefill (docs/scheduler.md §1), scripted ids < vocab and for known requests, a draft with the same vocab."""
    spec, e = trace.engine.speculative, trace.engine
    R, K, B = e.max_requests, spec.k, e.max_tokens_per_step
    need = max(R * (K + 1), (R - 1) * (K + 1) + chunk_size)
    if B < need:
        raise TraceError(f"{PATH}.k", f"k = {K} needs max_tokens_per_step >= max(R*(k+1), (R-1)*(k+1) + "
                         f"chunk_size) = {need} (every verify row and one chunk of prefill fit a step), got {B}")
    pp = f"{PATH}.proposer"
    if spec.proposer.kind == "scripted":
        ids = {r.id for r in trace.requests}
        for rid, per in spec.proposer.proposals:
            if ids and rid not in ids:
                raise TraceError(f"{pp}.proposals.{rid}", "unknown request id")
            for n, toks in per:
                for j, t in enumerate(toks):
                    if t >= vocab_size:
                        raise TraceError(f"{pp}.proposals.{rid}.{n}[{j}]", f"token id {t} >= vocab_size {vocab_size}")
    if spec.proposer.kind == "draft":
        import json
        folder = model_path(spec)
        v = json.loads((folder / "config.json").read_text()).get("vocab_size")
        if v != vocab_size:
            raise TraceError(f"{pp}.model", f"draft model {folder.name} has vocab_size {v}, the target {vocab_size}: "
                             "a draft must share the target's vocabulary")


# -------------------------------------------------------------------------------------------------- proposers

def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the longest n in max_n..min_n whose last-n suffix occurred earlier; the up to k tokens that
    followed its most recent earlier occurrence (fewer near the end, none if no n matches)."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):          # most recent occurrence that starts before the suffix
            if tokens[i:i + n] == suffix:
                return list(tokens[i + n:i + n + k])
    return []


class NgramProposer:
    """DESIGN §13 ngram: a function of the request's tokens only."""

    def __init__(self, cfg: ProposerConfig):
        self.cfg = cfg

    def propose(self, rid: str, tokens: list[int], n_generated: int, k: int) -> list[int]:
        """Up to k proposals for a request whose tokens (prompt + output) are `tokens`."""
        return ngram_propose(tokens, k, self.cfg.min_n, self.cfg.max_n)


class ScriptedProposer:
    """Proposals read from the trace by (request id, number of generated tokens); absent = none."""

    def __init__(self, cfg: ProposerConfig):
        self.table = cfg.table()

    def propose(self, rid: str, tokens: list[int], n_generated: int, k: int) -> list[int]:
        """The scripted proposals for this request at this output length (at most k)."""
        return list(self.table.get(rid, {}).get(n_generated, ()))[:k]


class DraftProposer:
    """A smaller model with the same vocab, greedy, with its own per-request state covering every token of the
    request seen so far; drafting runs on a copy of that state, so a rejection never needs a rollback here."""

    def __init__(self, model: Any):
        self.model = model
        self.state: dict[str, tuple[Any, int]] = {}       # rid -> (state after tokens[:n], n)

    def propose(self, rid: str, tokens: list[int], n_generated: int, k: int) -> list[int]:
        """Catch the draft up on the request's new tokens, then k greedy draft tokens."""
        state, n = self.state.get(rid, (None, 0))
        logits, state = self.model.prefill(list(tokens[n:]), state)
        self.state[rid] = (copy.deepcopy(state), len(tokens))
        out = [greedy(logits[-1])]
        while len(out) < k:
            last, state = self.model.decode(out[-1], state)
            out.append(greedy(last))
        return out

    def forget(self, rid: str) -> None:
        """Drop a finished request's draft state."""
        self.state.pop(rid, None)


def make_proposer(spec: SpecConfig, dtype=None):
    """The oracle's proposer object for `spec` (the draft model loaded in fp64)."""
    kind = spec.proposer.kind
    if kind == "ngram":
        return NgramProposer(spec.proposer)
    if kind == "scripted":
        return ScriptedProposer(spec.proposer)
    import torch
    from . import load
    return DraftProposer(load(model_path(spec), dtype=dtype or torch.float64))


class Backoff:
    """DESIGN §13 backoff (cap B > 0): after a request's n-th verify row in a row that accepted no draft, its next
    min(2^(n-1), B) decode rows propose nothing; a verify row that accepts a draft ends the run of misses. At 0%
    acceptance a request then verifies once every B + 1 steps at most, which bounds what wrong drafts cost."""

    def __init__(self, cap: int):
        self.cap = cap
        self.misses: dict[str, int] = {}          # request -> verify rows in a row that accepted nothing
        self.pause: dict[str, int] = {}           # request -> decode rows left that propose nothing

    def paused(self, rid: str) -> bool:
        """Whether the next decode row of `rid` proposes nothing."""
        return self.pause.get(rid, 0) > 0

    def take(self, rid: str) -> bool:
        """Called once per decode row built for `rid`: True when this row proposes nothing (a paused step)."""
        left = self.pause.get(rid, 0)
        if left:
            self.pause[rid] = left - 1
        return left > 0

    def record(self, rid: str, accepted: int) -> None:
        """A verify row of `rid` accepted `accepted` drafts."""
        if not self.cap:
            return
        if accepted:
            self.misses.pop(rid, None)
            return
        n = self.misses[rid] = self.misses.get(rid, 0) + 1
        self.pause[rid] = min(1 << min(n - 1, 62), self.cap)


# ----------------------------------------------------------------------------------------------- verification

def accepted_count(proposals: list[int], choices: list[int]) -> int:
    """Leading drafts equal to the sampler's choice before them: d_{i+1} == c_i."""
    a = 0
    while a < len(proposals) and a < len(choices) and proposals[a] == choices[a]:
        a += 1
    return a


def proposal_room(k: int, max_new_tokens: int, n_generated: int) -> int:
    """Most drafts a row may feed: k, and no more than the tokens the request may still emit (so the verify row's
    positions stay below len(prompt) + max_new_tokens, the KV capacity of plain decode)."""
    return max(0, min(k, max_new_tokens - n_generated))


def verify(model: Any, state: Any, last: int, proposals: list[int], choose, pos: int,
           on_state=None) -> tuple[list[int], int, Any]:
    """Decode `last` then the drafts one by one from `state` (input i at position pos+i); c_i = choose(logits,
    pos+1+i), the request's sampler at that absolute position; stop after the first rejected draft.
    `on_state(j, state)`: called with the state after each fed (hence accepted) input j (DESIGN §17 stores).
    Returns (c_0..c_a, a, state after the a+1 accepted inputs)."""
    logits, state = model.decode(last, state)
    if on_state is not None:
        on_state(0, state)
    choices = [choose(logits, pos + 1)]
    for i, d in enumerate(proposals):
        if d != choices[-1]:
            break
        logits, state = model.decode(d, state)
        if on_state is not None:
            on_state(i + 1, state)
        choices.append(choose(logits, pos + 2 + i))
    return choices, len(choices) - 1, state


class SpecRunner:
    """The oracle scheduler's hooks: proposals when building a decode row, verify at forward, tokens at resolve."""

    def __init__(self, trace):
        self.spec = trace.engine.speculative
        self.proposer = make_proposer(self.spec)
        self.backoff = Backoff(self.spec.backoff)
        self.results: dict[str, tuple[list[int], int]] = {}
        self.keep_states = None        # DESIGN §17: callable(request state, position) -> keep the state there

    def row(self, r: int, st, slot: int):
        """A decode row (no proposals) or a verify row of m+1 tokens with its m proposals."""
        from .schedule_log import BatchRow
        req, out = st.req, st.output
        pos, room = len(req.prompt) + len(out) - 1, proposal_room(self.spec.k, req.max_new_tokens, len(out))
        if self.backoff.take(req.id):
            room = 0
        props = self.proposer.propose(req.id, list(req.prompt) + out, len(out), room) if room else []
        if not props:
            return BatchRow(r, req.id, slot, "decode", pos, 1)
        return BatchRow(r, req.id, slot, "verify", pos, len(props) + 1, proposals=list(props))

    def overlappable(self, batch) -> bool:
        """Async (docs/scheduler.md §10): the step after a decode-only `batch` may overlap it when every request
        decoding in it is paused by backoff, so the next step proposes nothing and needs no resolved token."""
        return all(self.backoff.paused(b.request) for b in batch if b.kind == "decode")

    def overlapped(self, batch) -> None:
        """An overlapped step's rows are decode rows built without row(): count their paused step off."""
        for b in batch:
            self.backoff.take(b.request)

    def forward(self, model, st, b, forced: tuple[int, ...] = ()) -> int:
        """Verify the row on the request's own state; returns the first choice (the row samples). `forced`: the
        scheduler's forced output tokens (teacher forcing), which replace the sampler where given."""
        plen = len(st.req.prompt)

        def choose(logits, q: int) -> int:
            return forced[q - plen] if q - plen < len(forced) else sample(logits, st.req.sampling, q)
        keep = self.keep_states

        def on_state(j: int, state) -> None:
            if keep is not None:
                keep(st, b.pos + 1 + j, state)
        choices, a, st.model_state = verify(model, st.model_state, st.output[-1], b.proposals, choose, b.pos,
                                            on_state)
        self.results[b.request] = (choices, a)
        return choices[0]

    def tokens(self, rec, b, tok: int) -> list[int]:
        """The tokens a resolved row emits in order (the caller stops at a stop token or max_new_tokens)."""
        if b.kind != "verify":
            return [tok]
        choices, a = self.results.pop(b.request)
        self.backoff.record(b.request, a)
        if rec.verify is None:
            rec.verify = []
        rec.verify.append({"request": b.request, "accepted": a})
        return choices
