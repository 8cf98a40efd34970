"""Greedy sampling (mirrors oracle/sampling.py): torch.argmax into a preallocated int64 buffer.

BF16 and FP32 logits are read as they are (no float cast, no values buffer); the lowest index wins ties.
The buffer is written in place, so its address is stable (CUDA graphs)."""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import KernelInputError, check

OP = "greedy_sample"


def greedy_sample(logits: Tensor, out: Tensor) -> Tensor:
    """argmax over the last dim of logits [R, V] (bf16/fp32) into out [R] int64, in place; returns out."""
    check(OP, "logits", logits, (None, None), (torch.bfloat16, torch.float32))
    if logits.shape[1] == 0:
        raise KernelInputError(f"{OP}: `logits` has an empty vocabulary dim")
    check(OP, "out", out, (logits.shape[0],), (torch.int64,), logits.device)
    torch.argmax(logits, dim=-1, out=out)
    return out
