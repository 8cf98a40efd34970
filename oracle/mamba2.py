"""The Mamba2 mixer, literal form (filled in below process_dt)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def process_dt(dt_raw: Tensor, dt_bias: Tensor, limit: tuple[float, float]) -> Tensor:
    """dt = clamp(softplus(dt_raw + dt_bias), *limit); limit (0, inf) means no clamp."""
    dt = F.softplus(dt_raw + dt_bias)
    lo, hi = limit
    if lo > 0.0 or hi != float("inf"):
        dt = torch.clamp(dt, lo, hi)
    return dt
