"""Deliberately broken engine pieces, shared by the tests that prove a check can fail."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from fastpath.engine.rows import compaction_moves
from hybridqual.adapters import Capabilities, OracleAdapter, RunResult, TraceAdapter


def compact_without_moving_slots(self):
    """RowTable.compact with the bug: a compacted row carries its request but not its slot mapping (keeps -1)."""
    live = [self.row_request[r] is not None for r in range(self.active)]
    moves = compaction_moves(live)
    for m in moves:
        self.row_request[m.dst], self.row_pos[m.dst] = self.row_request[m.src], self.row_pos[m.src]
        self.row_to_slot[m.src], self.row_request[m.src], self.row_pos[m.src] = -1, None, 0
    self.row_to_slot_dev.copy_(torch.tensor(self.row_to_slot, dtype=self.row_to_slot_dev.dtype))
    self.active = sum(live)
    return moves



class CacheReportingEngine(TraceAdapter):
    """An 'external' engine behind the adapter protocol (tools/adapters/__init__.py) that reports its prefix-cache facts in
    RunResult.prefix_cache's JSON form, as an engine outside hybridqual would from its own counters. The fast path
    on the torch stand-ins does the work; subclasses break the cache (`inert`) or stay silent (`report = False`)."""
    inert = False       # the cache is never consulted: every admission misses (tokens still right)
    report = True       # False: the adapter reports no prefix-cache facts
    CAPABILITIES = Capabilities(("greedy",), ("legacy", "async"), compute_dtype=torch.float32,
                                prefix_cache_reporting=True)

    def __init__(self, model_path, trace, mode, device="cpu"):
        from fastpath import Engine, FastOptions
        super().__init__(model_path, trace, mode, device)
        self.engine = Engine.from_pretrained(model_path, trace.engine, device=device, max_len=256,
                                             options=FastOptions(backend="torch"))
        if self.inert and self.engine.prefix is not None:
            self.engine.prefix.lookup = lambda prompt, step: (0, None)

    def run_trace(self) -> RunResult:
        eng = self.engine
        eng.reset(self.mode)
        for r in self.trace.requests:
            eng.add_request(r)
        while eng.step():
            pass
        tokens = {rid: list(s.output) for rid, s in eng.requests.items()}
        if not self.report or eng.prefix is None:
            return RunResult(tokens)
        steps = eng.log.to_json()["steps"]
        facts = {"admit": [{"request": a["request"], "cached_tokens": a["cached_tokens"]}
                           for s in steps for a in s["admit"]],
                 "steps": [{k: s["prefix_cache"][k] for k in ("stored", "evicted")} for s in steps]}
        return RunResult(tokens, prefix_cache=facts)


class InertCacheEngine(CacheReportingEngine):
    """Its prefix cache never hits (the lookup is never consulted) and it says so honestly."""
    inert = True


class SilentCacheEngine(CacheReportingEngine):
    """A working cache whose adapter reports no facts about it."""
    report = False
    CAPABILITIES = Capabilities(("greedy",), ("legacy", "async"), compute_dtype=torch.float32)


class SlowWrongOracle(OracleAdapter):
    """The oracle scheduler with its first request's first token changed, so every trace's tokens check fails; a
    trace whose first request is named "slow" also takes 1 s longer (a later instance of qualify --jobs 2 fails
    first)."""

    def run_trace(self) -> RunResult:
        r = super().run_trace()
        first = self.trace.requests[0].id
        if first == "slow":
            time.sleep(1.0)
        toks = dict(r.tokens)
        toks[first] = [(toks[first][0] + 1) % self.model.config.vocab_size] + toks[first][1:]
        return RunResult(toks, r.finish_reasons, r.schedule_log, r.digest, prefix_cache=r.prefix_cache)


class DyingWorker(OracleAdapter):
    """Says why on stderr and ends its process (exit code 3) in run_trace: a qualify --jobs worker that dies."""

    def run_trace(self) -> RunResult:
        import os
        import sys
        print("DyingWorker: ending this process on purpose", file=sys.stderr, flush=True)
        os._exit(3)


@dataclass(frozen=True)
class Corruption:
    """HostileOracle's settings: `corrupt(result, trace) -> result`, how it rewrites its well-formed result."""
    corrupt: Callable[[RunResult, object], RunResult]


class HostileOracle(OracleAdapter):
    """The oracle adapter whose RunResult is rewritten by the `corrupt(result, trace)` of its options' Corruption
    (none: left as is): an adapter that tries to fool the judge with a malformed result (hybridqual.qualify.validate
    must FAIL it)."""
    CAPABILITIES = Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True, logits=True,
                                compute_dtype=torch.float32)
    OPTIONS = ("settings",)

    def run_trace(self) -> RunResult:
        r = super().run_trace()
        logits = {}
        for req in self.trace.requests:                  # the oracle's own rows: a well-formed result to corrupt
            from hybridqual.qualify.compare import teacher_forced_logits
            logits[req.id] = teacher_forced_logits(self.model, req.prompt, r.tokens[req.id]).float()
        good = RunResult({k: list(v) for k, v in r.tokens.items()}, dict(r.finish_reasons), r.schedule_log, r.digest,
                         logits=logits, prefix_cache=r.prefix_cache)
        how = self.options.settings
        return how.corrupt(good, self.trace) if how is not None else good


class ExitingOracle(OracleAdapter):
    """Calls sys.exit(code) in run_trace (code 0 by default: a 'success' exit in the middle of the judge's run)."""
    code = 0

    def run_trace(self) -> RunResult:
        import sys
        sys.exit(self.code)


class ExitingOracle3(ExitingOracle):
    code = 3


class RaisingOracle(OracleAdapter):
    def run_trace(self) -> RunResult:
        raise RuntimeError("RaisingOracle: the engine broke")


class HangingOracle(OracleAdapter):
    """Never returns from run_trace (a Python-level hang: sleeps in short naps, as a spinning engine would)."""

    def run_trace(self) -> RunResult:
        while True:
            time.sleep(0.05)


class SelfKillingOracle(OracleAdapter):
    """Kills its own process with SIGKILL in run_trace (an engine's native crash, an OOM kill)."""

    def run_trace(self) -> RunResult:
        import os
        import signal
        import sys
        print("SelfKillingOracle: SIGKILL to my own process", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
