"""Staggered request traces made of the trained model's task (digit sorting), and its functional score.

    python -m hybridqual.scenarios.task_traces      # (re)writes goldens/traces/task_*.json (deterministic)

The answer of a sorting prompt is a pure function of the prompt, so a trace needs no answer key: `task_accuracy`
recomputes it. This is the suite's "HumanEval": the exact-answer accuracy must be identical in every mode.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hybridqual.scenarios import task
from hybridqual.paths import TRACES

# name -> (engine config, arrival steps, description); requests are the first held-out examples in order.
SPECS = {
    "task_staggered": (
        {"max_requests": 3, "max_tokens_per_step": 24, "prefill_chunk": 16},
        [0, 1, 3, 6, 8, 12],
        "Sorting prompts of 18-22 tokens (chunked prefill: prefill_chunk 16 < prompt), 3 slots for 6 staggered "
        "requests (bank exhaustion), EOS stop tokens, answers of different lengths (compactions with moves)."),
    "task_burst": (
        {"max_requests": 4, "max_tokens_per_step": 12, "prefill_chunk": 8},
        [0, 0, 0, 0, 2],
        "Four requests at once under a 12-token budget: prefill pieces of one chunk while others decode; "
        "one late arrival waits for a freed slot (LIFO reuse of a just-freed slot)."),
}


def answer_for(prompt: Sequence[int]) -> list[int]:
    """The exact expected answer of a sorting prompt: its digits sorted, then EOS."""
    p = list(prompt)
    if len(p) < 2 or p[0] != task.BOS or p[-1] != task.SEP:
        raise ValueError(f"not a sorting prompt: {p}")
    return sorted(p[1:-1]) + [task.EOS]


def is_task_trace(trace) -> bool:
    """Whether every prompt of the trace is a sorting prompt."""
    try:
        for r in trace.requests:
            answer_for(r.prompt)
    except ValueError:
        return False
    return True


def task_accuracy(trace, tokens: dict[str, list[int]]) -> float:
    """Exact-answer accuracy of an engine's outputs on a task trace."""
    hits = [tokens.get(r.id, []) == answer_for(r.prompt) for r in trace.requests]
    return sum(hits) / len(hits)


def build(name: str) -> dict:
    """The trace JSON object for one spec."""
    engine, arrivals, description = SPECS[name]
    examples = task.heldout(len(arrivals))
    requests = [{"id": f"q{i}", "arrival_step": a, "prompt": list(ex.prompt),
                 "max_new_tokens": len(ex.answer) + 2, "stop_token_ids": [task.EOS], "sampling": {"kind": "greedy"}}
                for i, (a, ex) in enumerate(zip(arrivals, examples))]
    return {"schema": "hybridqual.trace/1", "description": description,
            "engine": {**engine, "mode": "legacy"}, "requests": requests}


def main(argv: list[str] | None = None) -> int:
    """Rewrite every task trace of SPECS (no options; --help says so)."""
    argparse.ArgumentParser(prog="python -m hybridqual.scenarios.task_traces",
                            description=__doc__.split("\n")[0]).parse_args(argv)
    from oracle.trace import dump_trace, parse_trace
    for name in SPECS:
        path = TRACES / f"{name}.json"
        path.write_text(dump_trace(parse_trace(build(name))) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
