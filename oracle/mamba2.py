"""The Mamba2 mixer of one layer, literal form (one sequence, no batch).

    [z | xBC | dt] = in_proj(u)                              z [L, d_inner]  xBC [L, conv_dim]  dt [L, H]
    xBC = silu(causal_conv1d(xBC, rolling window))            -> x [L, H, P], B [L, G, N], C [L, G, N]
    dt = clamp(softplus(dt + dt_bias), *dt_limit);  A = -exp(A_log)
    y, h = scan(x, dt, A, B, C, D, h0)                        (oracle.ssd: recurrence or chunked SSD)
    out = out_proj(rms_norm_gated(y, z, groups = n_groups))

Projections run in the model dtype; the scan runs in float64 for a float64 model, else float32 (the
state is kept in that dtype too, as the fast path's fp32 state bank does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import HybridConfig
from .conv1d import causal_conv1d
from .gated_norm import rms_norm_gated
from .mlp import linear
from .ssd import ssd_chunked, ssm_recurrence


def process_dt(dt_raw: Tensor, dt_bias: Tensor, limit: tuple[float, float]) -> Tensor:
    """dt = clamp(softplus(dt_raw + dt_bias), *limit); limit (0, inf) means no clamp."""
    dt = F.softplus(dt_raw + dt_bias)
    lo, hi = limit
    if lo > 0.0 or hi != float("inf"):
        dt = torch.clamp(dt, lo, hi)
    return dt


def scan_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the SSM scan and state for a model of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_in_proj(c: HybridConfig, zxbcdt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[L, in_proj_dim] -> z [L, d_inner], xBC [L, conv_dim], dt [L, H]."""
    return torch.split(zxbcdt, [c.d_inner, c.conv_dim, c.mamba_n_heads], dim=-1)


def split_xbc(c: HybridConfig, xBC: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[L, conv_dim] -> x [L, H, P], B [L, G, N], C [L, G, N]."""
    L, G, N = xBC.shape[0], c.mamba_n_groups, c.mamba_d_state
    x, B, C = torch.split(xBC, [c.d_inner, G * N, G * N], dim=-1)
    return x.reshape(L, c.mamba_n_heads, c.mamba_head_dim), B.reshape(L, G, N), C.reshape(L, G, N)


def mamba2_mixer(c: HybridConfig, w: dict[str, Tensor], prefix: str, u: Tensor, conv_window: Tensor,
                 ssm_state: Tensor, start_pos: int, scan: str = "chunked") -> tuple[Tensor, Tensor, Tensor]:
    """u [L, D] -> (out [L, D], new conv window [conv_dim, K-1], new ssm state [H, P, N])."""
    zxbcdt = linear(u, w[prefix + "in_proj.weight"], w.get(prefix + "in_proj.bias"))
    y, new_window, h = mamba2_sequence(c, w, prefix, zxbcdt, conv_window, ssm_state, start_pos, scan)
    out = linear(y, w[prefix + "out_proj.weight"], w.get(prefix + "out_proj.bias"))
    return out, new_window, h


def mamba2_sequence(c: HybridConfig, w: dict[str, Tensor], prefix: str, zxbcdt: Tensor, conv_window: Tensor,
                    ssm_state: Tensor, start_pos: int, scan: str = "chunked") -> tuple[Tensor, Tensor, Tensor]:
    """The mixer between its projections, the part that walks one sequence: in_proj's output [L, in_proj_dim] ->
    (the gated-norm output y [L, d_inner] in the model dtype, new conv window, new ssm state)."""
    z, xBC, dt_raw = split_in_proj(c, zxbcdt)
    xBC, new_window = causal_conv1d(xBC, w[prefix + "conv1d.weight"], w.get(prefix + "conv1d.bias"), conv_window)
    x, B, C = split_xbc(c, F.silu(xBC))

    sd = scan_dtype(zxbcdt.dtype)
    dt = process_dt(dt_raw.to(sd), w[prefix + "dt_bias"].to(sd), c.dt_limit)
    A = -torch.exp(w[prefix + "A_log"].to(sd))
    D = w[prefix + "D"].to(sd)
    args = (x.to(sd), dt, A, B.to(sd), C.to(sd), D)
    if scan == "chunked":
        y, h = ssd_chunked(*args, h0=ssm_state.to(sd), chunk_size=c.chunk_size, start_pos=start_pos)
    elif scan == "recurrence":
        y, h = ssm_recurrence(*args, h0=ssm_state.to(sd))
    else:
        raise ValueError(f"scan: {scan!r} is not 'chunked' or 'recurrence'")

    y = y.reshape(zxbcdt.shape[0], c.d_inner)
    y = rms_norm_gated(y, z.to(sd), w[prefix + "norm.weight"], c.mamba_n_groups, c.norm_eps).to(zxbcdt.dtype)
    return y, new_window, h
