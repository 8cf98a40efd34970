"""Rotary position embedding (mirrors oracle/attention.py: rope), rotate-half form on the first rot_dim
dims of each head; rot_dim = head_dim (full), head_dim/2 (Bamba's partial), 0 (none: a copy)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, INDEX_DTYPES, KernelInputError, check, next_pow2, pdl_enter, pdl_meta

OP = "rope"


@triton.jit
def rotate_half(x_ptr, rows, d, mask, ang_pos, inv_freq_ptr, half, ROPE: tl.constexpr):
    """Rows of x [.., BLOCK_D] at x_ptr + rows + d, rotate-half RoPE at position ang_pos on the first 2·half dims,
    rounded to x's dtype; the other dims as loaded. The one formula of rope_kernel and attention_decode."""
    x = tl.load(x_ptr + rows + d[None, :], mask=mask, other=0.0)
    if ROPE:
        lo = d < half
        rot = d < 2 * half
        partner = tl.where(lo, d + half, d - half)
        xp = tl.load(x_ptr + rows + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        ang = ang_pos * tl.load(inv_freq_ptr + tl.where(lo, d, d - half), mask=rot, other=0.0)
        cos = tl.cos(ang)[None, :]
        sin = tl.sin(ang)[None, :]
        xf = x.to(tl.float32)
        r = tl.where(lo[None, :], xf * cos - xp * sin, xf * cos + xp * sin)
        x = tl.where(rot[None, :], r.to(x_ptr.dtype.element_ty), x)
    return x


@triton.jit
def rope_kernel(
    x_ptr, pos_ptr, inv_freq_ptr, o_ptr, H, D, half,
    stride_x_t, stride_x_h, stride_o_t, stride_o_h,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (T, cdiv(H, BLOCK_H)); the last dim of x and out is contiguous."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (offs_h < H)[:, None] & (d < D)[None, :]
    x = rotate_half(x_ptr, t * stride_x_t + offs_h[:, None] * stride_x_h, d, m, tl.load(pos_ptr + t).to(tl.float32),
                    inv_freq_ptr, half, True)
    tl.debug_barrier()                                                    # in place: all reads before writes
    tl.store(o_ptr + t * stride_o_t + offs_h[:, None] * stride_o_h + d[None, :], x.to(o_ptr.dtype.element_ty),
             mask=m)


_INV_FREQ: dict = {}


def inv_freq(rot_dim: int, theta: float, device: torch.device) -> Tensor:
    """theta^(-2i/rot_dim) in fp32, computed as the oracle does (cached per device)."""
    key = (rot_dim, float(theta), str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = (1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32)
                                           / rot_dim))).to(device)
    return _INV_FREQ[key]


def rope(x: Tensor, positions: Tensor, rot_dim: int, theta: float, out: Tensor | None = None) -> Tensor:
    """x [T, H, d] rotated by absolute positions [T] on its first rot_dim dims; out may be x (in place)."""
    check(OP, "x", x, (None, None, None), FLOAT_DTYPES)
    T, H, D = x.shape
    check(OP, "positions", positions, (T,), INDEX_DTYPES, x.device)
    if rot_dim < 0 or rot_dim % 2 != 0 or rot_dim > D:
        raise KernelInputError(f"{OP}: rot_dim={rot_dim} must be even and <= head_dim={D}")
    if out is None:
        out = torch.empty_like(x)
    check(OP, "out", out, (T, H, D), (x.dtype,), x.device)
    if x.stride(2) != 1 or out.stride(2) != 1:
        raise KernelInputError(f"{OP}: the head dim of `x` and `out` must be contiguous")
    if T == 0:
        return out
    half = rot_dim // 2
    freqs = inv_freq(max(rot_dim, 2), theta, x.device)
    bh = min(next_pow2(H), 16)
    rope_kernel[(T, triton.cdiv(H, bh))](
        x, positions, freqs, out, H, D, half, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK_H=bh, BLOCK_D=next_pow2(D), num_warps=4, **pdl_meta(out.device))
    return out
