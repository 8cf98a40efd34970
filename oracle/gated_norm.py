"""RMSNorm, plain and gated (Mamba2's output norm), literal form.

    rms_norm(x)              = x / sqrt(mean(x^2) + eps) * weight
    rms_norm_gated(y, z)     = rmsnorm_per_group(y * silu(z)) * weight

The gated form normalises each group of D / n_groups consecutive channels on its own (n_groups = 1:
the whole D). Grouped is the truth for every architecture (DESIGN §2). Statistics are computed in at
least float32 (float64 stays float64) and the result is cast back to the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D] -> x / rms(x) * weight."""
    cd = _compute_dtype(x.dtype)
    xf = x.to(cd)
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    return (weight.to(cd) * (xf * torch.rsqrt(variance + eps))).to(x.dtype)


def rms_norm_gated(y: Tensor, z: Tensor | None, weight: Tensor, n_groups: int, eps: float) -> Tensor:
    """y, z [..., D] -> rmsnorm over each group of D/n_groups channels of (y * silu(z)), times weight [D]."""
    D = y.shape[-1]
    if n_groups < 1 or D % n_groups != 0:
        raise ValueError(f"rms_norm_gated: D={D} is not divisible by n_groups={n_groups}")
    cd = _compute_dtype(y.dtype)
    g = y.to(cd)
    if z is not None:
        g = g * F.silu(z.to(cd))
    grouped = g.reshape(*g.shape[:-1], n_groups, D // n_groups)
    variance = grouped.pow(2).mean(dim=-1, keepdim=True)
    normed = (grouped * torch.rsqrt(variance + eps)).reshape(g.shape)
    return (weight.to(cd) * normed).to(y.dtype)
