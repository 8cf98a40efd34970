"""The oracle as an engine: its scheduler and fp64 model, with the schedule log (the truth itself)."""
from __future__ import annotations

import torch

from hybridqual.adapters.base import Adapter, Capabilities, RunResult, cache_facts


class OracleAdapter(Adapter):
    """The oracle scheduler itself (fp64 by default): the truth, with its schedule log."""
    CAPABILITIES = Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True,
                                compute_dtype=torch.float64, prefix_cache_reporting=True, speculation_reporting=True,
                                notes=(("logits", "the oracle adapter is the truth itself"),))

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        import oracle
        self.model = oracle.load(self.model_path, dtype=dtype or torch.float64)

    def run_trace(self) -> RunResult:
        import oracle
        r = oracle.run_trace(self.model, self.trace, mode=self.mode)
        return RunResult(r.tokens, r.finish_reasons, r.schedule_log, r.digest, prefix_cache=cache_facts(self.trace, r))
