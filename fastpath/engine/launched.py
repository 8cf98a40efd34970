"""A launched, unresolved engine step: what the engine, the speculator and the device-draft path hand each other
between a step's launch and its one wait."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oracle.schedule_log import BatchRow, StepRecord

DECODE_KINDS = ("decode", "extra", "shadow")   # shadow: legacy's unlogged copy of an async extra row (shadow_rows)


@dataclass
class Launched:
    """A launched, unresolved step: its batch, which batch entries sample, and its host token copy."""
    step: int
    batch: list[BatchRow]
    record: StepRecord
    samples: list[bool]
    host_tokens: torch.Tensor
    event: object = None
    finalize: object = None     # device-draft verify steps: fills batch/samples/host_tokens after the wait

    @property
    def decode_only(self) -> bool:
        return bool(self.batch) and all(b.kind in DECODE_KINDS for b in self.batch)
