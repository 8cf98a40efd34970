"""The oracle as an engine: its scheduler and fp64 model, with the schedule log (the truth itself)."""
from __future__ import annotations

from dataclasses import replace

import torch

from hybridqual.scenarios.step_rule import OURS
from hybridqual.adapters.base import DEFAULT_OPTIONS, Capabilities, EngineOptions, RunResult, TraceAdapter, cache_facts


class OracleAdapter(TraceAdapter):
    """The oracle scheduler itself (fp64): the truth, with its schedule log."""
    CAPABILITIES = Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True,
                                compute_dtype=torch.float64, prefix_cache_reporting=True, speculation_reporting=True,
                                deterministic=True, state_transfer=True,
                                notes=(("logits", "the oracle adapter is the truth itself"),),
                                step_rule=replace(OURS, name="hybridqual oracle (docs/scheduler.md §3.3)"))

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        super().__init__(model_path, trace, mode, device, options)
        import oracle
        self.model = oracle.load(self.model_path, dtype=torch.float64)

    def run_trace(self) -> RunResult:
        import oracle
        r = oracle.run_trace(self.model, self.trace, mode=self.mode)
        return RunResult(r.tokens, r.finish_reasons, r.schedule_log, r.digest, prefix_cache=cache_facts(self.trace, r))
