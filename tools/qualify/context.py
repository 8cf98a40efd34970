"""What every qualify check reads: one `CheckContext` per instance (and per mode), so every check has one
signature, `check(ctx) -> Check | None` (tools/qualify/checks.py lists them).

Also the two things the checks share: the oracle's teacher-forced rows (`OracleRows`, computed once per
(request, tokens)) and the engine's own continuation after a prefix (`continuation`, for the tie-aware rule).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from hybridqual.adapters.base import Capabilities, Engine, RunResult
from hybridqual.qualify.compare import LOGITS_C, teacher_forced_logits
from hybridqual.qualify.report import Check
from hybridqual.qualify.truth import Truth
from hybridqual.qualify.validate import describe, validate_result


class OracleRows:
    """The oracle's teacher-forced logits for (request, tokens), computed once and shared by the checks."""

    def __init__(self, model) -> None:
        self.model, self.cache = model, {}
        if hasattr(model, "clear"):       # a streamed oracle's prefetched sequences of an earlier instance
            model.clear()

    def prefetch(self, trace, tokens: dict[str, list[int]]) -> None:
        """Every request of a run scored in one pass over the weights instead of one pass per request: a streamed
        oracle's own prefetch, else the in-memory oracle's oracle.batched pass (on the CPU bitwise each request's own
        teacher_forced_logits, oracle/batched.py)."""
        if hasattr(self.model, "prefetch"):
            self.model.prefetch([(r.prompt, tokens.get(r.id, [])) for r in trace.requests])
            return
        from oracle.batched import Segment, batches, forward_segments
        todo = [(r, list(tokens[r.id])) for r in trace.requests
                if tokens.get(r.id) and (r.id, tuple(tokens[r.id])) not in self.cache]
        if not batches(self.model) or len(todo) < 2:
            return
        passed = forward_segments(self.model, [Segment(list(r.prompt) + [int(t) for t in toks[:-1]], None)
                                               for r, toks in todo])
        for (r, toks), (logits, _) in zip(todo, passed):
            self.cache[(r.id, tuple(toks))] = logits[len(r.prompt) - 1:]

    def get(self, req, tokens: list[int]) -> torch.Tensor:
        key = (req.id, tuple(tokens))
        if key not in self.cache:
            self.cache[key] = teacher_forced_logits(self.model, req.prompt, list(tokens))
        return self.cache[key]


def continuation(engine: Engine, model_dir: Path, trace, req, device: str,
                 vocab_size: int | None = None) -> Callable[[list[int]], list[int]]:
    """Teacher forcing for the tie-aware check: the engine's own continuation after prompt + the oracle's prefix,
    from a one-request trace through the same engine (its prefix becomes part of the prompt); its result is
    validated as the main run's (hybridqual.qualify.validate), a malformed one raises (the check's FAIL line)."""
    from oracle.trace import parse_trace

    def run(prefix: list[int]) -> list[int]:
        left = req.max_new_tokens - len(prefix)
        if left <= 0 or (prefix and prefix[-1] in req.stop_token_ids):
            return []
        one = parse_trace({"schema": "hybridqual.trace/1", "engine": trace.engine.to_json(),
                           "requests": [{"id": req.id, "arrival_step": 0, "prompt": list(req.prompt) + list(prefix),
                                         "max_new_tokens": left, "stop_token_ids": list(req.stop_token_ids),
                                         "sampling": req.sampling.to_json()}]})
        try:
            res = engine(model_dir, one, "legacy", device).run_trace()
        except SystemExit as e:
            raise RuntimeError(f"the adapter called sys.exit({e.code!r}) on a continuation trace") from None
        if vocab_size is not None:
            res, problems = validate_result(one, res, vocab_size)
            if problems:
                raise ValueError(f"the engine's result on a continuation trace (prompt + {len(prefix)} tokens) is "
                                 f"malformed: {describe(problems)}")
        return res.tokens[req.id]
    return run


@dataclass
class CheckContext:
    """One instance under judgement: the engine and its options, the trace, the truth, the oracle, τ, the modes
    asked for; per mode, the mode and its validated run; across modes, every mode's run. `name` is the line's name
    the registry declares for the check being run (set by checks.run_check)."""
    label: str                          # the instance's name in the report (model/scenario [configuration])
    model_dir: Path
    trace: object                       # oracle.trace.Trace
    engine: Engine                      # the adapter class with the run's options
    device: str
    oracle_model: object                # the fp64 oracle (in memory, on a device, or streamed)
    truth: Truth
    tau: float
    caps: Capabilities
    modes: tuple[str, ...]
    rows: OracleRows | None = None
    mode: str | None = None             # per-mode checks: the mode judged
    run: RunResult | None = None        # per-mode checks: that mode's validated result
    runs: dict[str, RunResult] = field(default_factory=dict)   # across modes: every mode's validated result
    shape: dict | None = None           # what the instance promises under the engine's step rule (Instance.shape)
    name: str = ""

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = OracleRows(self.oracle_model)

    @property
    def vocab(self) -> int:
        return self.oracle_model.config.vocab_size

    @property
    def dtype(self):
        """The engine's declared compute dtype (None: undeclared, judged as float32)."""
        return self.caps.compute_dtype

    @property
    def logits_c(self) -> float:
        """The logits check's c for the compute dtype (compare.LOGITS_C)."""
        return LOGITS_C[self.caps.compute_dtype or torch.float32]

    def for_mode(self, mode: str, run: RunResult | None = None) -> "CheckContext":
        """The context of one mode's checks (sharing the oracle rows)."""
        return dataclasses.replace(self, mode=mode, run=run)

    def named(self, name: str) -> "CheckContext":
        return dataclasses.replace(self, name=name)

    def continuation(self, req) -> Callable[[list[int]], list[int]]:
        """The engine's own continuation of request `req` after a prefix (validated like the main run)."""
        return continuation(self.engine, self.model_dir, self.trace, req, self.device, self.vocab)

    def line(self, passed: bool, detail: str, seconds: float = 0.0, **data) -> Check:
        """This check's PASS / FAIL line."""
        return Check.of(self.label, self.name, passed, detail, seconds, **data)

    def skip(self, reason: str) -> Check:
        """This check's SKIP line."""
        return Check.skip(self.label, self.name, reason)
