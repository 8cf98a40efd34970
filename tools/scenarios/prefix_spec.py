"""Prefix caching × speculative decoding traces (DESIGN §17): decode stores made by verify rows, hits on them.

    python -m hybridqual.scenarios.prefix_spec [MODEL_DIR [OUT_DIR]]   # writes OUT_DIR (default goldens/traces/)
                                                                       # prefix_spec{,_async}.json

A long request `long` (prompt of 6 ids, 28 generated, block 8) verifies scripted drafts built from its own greedy
output, so the block boundaries of its generated tokens fall where each rule of §17 is decided:
    legacy  n=2  a=0 of 3: boundary 8 is the state after input 0 (the rollback target, a snapshot)
            n=8  a=3 of 3: boundary 16 inside the accepted inputs (a snapshot, not the slot)
            n=15 a=2 of 3: boundary 24 one past the emitted tokens (the rejected draft's position: never stored
                           there; the request stores it from its own token at the next step)
            n=24 a=0 of 3: boundary 32 is lookahead (never stored from the drafts; stored two steps later)
    async   backoff 8, misses at n=1, 3, 6, 11: the paused rows at pos 23 (boundary 24) and after are decode-only
            steps async would overlap; §17 makes the boundary step drain first
Requests `b<p>` arrive when the boundary p is stored (or after `long` finished) with prompt = its tokens [0:p] + a
few ids, so each hits a decode-stored checkpoint; `b16` is admitted while `long` still verifies; `brief` finishes
first in row 0, so `long` moves (a compaction while it verifies).
Concrete traces for one model (their prompts are its greedy tokens), shipped for zoo-bamba.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridqual.paths import MODELS, TRACES

PROMPT = (20, 37, 54, 23, 40, 57)
N_NEW = 28
BLOCK = 8
LONG = {"id": "long", "arrival_step": 0, "prompt": list(PROMPT), "max_new_tokens": N_NEW}
BRIEF = {"id": "brief", "arrival_step": 0, "prompt": [30, 31, 32], "max_new_tokens": 2}   # row 0: its finish
                                                                                          # moves `long` (compaction)


def greedy_tokens(model, prompt: tuple[int, ...], n: int) -> list[int]:
    """The request's own greedy tokens (the oracle, alone)."""
    from oracle.scheduler import run_request_alone
    from oracle.trace import Request
    return run_request_alone(model, Request("a", 0, prompt, n))[0]


def _wrong(tok: int, vocab: int) -> int:
    """An id that is not `tok` (a rejected draft)."""
    return (tok + 1) % vocab


def _engine(mode: str, proposals: dict, backoff: int) -> dict:
    spec = {"k": 3, "proposer": {"kind": "scripted", "proposals": {"long": proposals}}}
    if backoff:
        spec["backoff"] = backoff
    return {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 16, "mode": mode, "speculative": spec,
            "prefix_cache": {"block_size": BLOCK, "capacity": 8, "store_decoded": True}}


def _legacy_proposals(o: list[int], vocab: int) -> dict:
    return {"2": [_wrong(o[2], vocab), o[3], o[4]],
            "8": [o[8], o[9], o[10]],
            "15": [o[15], o[16], _wrong(o[17], vocab)],
            "24": [_wrong(o[24], vocab), o[25], o[26]]}


def _async_proposals(o: list[int], vocab: int) -> dict:
    return {str(n): [_wrong(o[n], vocab), o[n + 1]] for n in (1, 3, 6, 11)}


def _store_steps(model, engine: dict) -> tuple[dict[int, int], int]:
    """Run `long` alone: the step each of its decode boundaries is stored at, and its last step."""
    from oracle.scheduler import run_trace
    from oracle.trace import parse_trace
    obj = {"schema": "hybridqual.trace/1", "engine": engine, "requests": [LONG]}
    res = run_trace(model, parse_trace(obj, model.config.vocab_size))
    stored = {s["pos"]: rec.step for rec in res.schedule_log.steps for s in rec.cache["stored"]}
    return stored, res.schedule_log.steps[-1].step


def build(model, mode: str) -> dict:
    """The concrete trace for `model` (legacy: prefix_spec, async: prefix_spec_async)."""
    V = model.config.vocab_size
    o = greedy_tokens(model, PROMPT, N_NEW)
    legacy = mode == "legacy"
    engine = _engine(mode, _legacy_proposals(o, V) if legacy else _async_proposals(o, V), 0 if legacy else 8)
    stored, last = _store_steps(model, engine)
    full = list(PROMPT) + o
    hits = (8, 16, 24, 32) if legacy else (24,)
    reqs = [LONG, BRIEF]
    for j, p in enumerate(hits):
        during = legacy and p == 16                      # admitted while `long` still verifies
        arrive = stored[p] + 2 if during else last + 1 + j
        reqs.append({"id": f"b{p}", "arrival_step": arrive, "prompt": full[:p] + [3 + j, 9 + j][: 1 + j % 2],
                     "max_new_tokens": 4})
    what = ("a verify row's decode stores at a snapshot (rollback target, accepted input), one past the emitted "
            "tokens and in the lookahead; b16 hits while long still verifies" if legacy else
            "async with backoff: paused decode rows reach boundary 24, the step after drains before the store")
    return {"schema": "hybridqual.trace/1",
            "description": f"Prefix caching x speculation (DESIGN §17, {mode}): {what}; b<p> hits a's checkpoint at "
                           "p (built by tools/scenarios/prefix_spec.py from the model's greedy tokens).",
            "engine": engine, "requests": reqs}


def write(model_dir: Path, out_dir: Path = TRACES) -> list[Path]:
    """Write both traces for the model into `out_dir` (goldens/traces/ for the shipped zoo-bamba; another model's
    instances elsewhere, e.g. for an engine that cannot run zoo-bamba)."""
    import oracle
    model = oracle.load(model_dir)
    out = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for mode, name in (("legacy", "prefix_spec"), ("async", "prefix_spec_async")):
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(build(model, mode), indent=1) + "\n")
        out.append(path)
    return out


if __name__ == "__main__":
    print(*write(Path(sys.argv[1]) if len(sys.argv) > 1 else MODELS / "zoo-bamba",
                 *([Path(sys.argv[2])] if len(sys.argv) > 2 else [])), sep="\n")
