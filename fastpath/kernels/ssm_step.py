"""Decode state update over the bank (mirrors oracle/ssd.py: ssm_step), one token per row.

Row r reads and writes ssm_bank[slot[r]] in place; rows with slot -1 are padding: no bank read or write,
output zero. dt processing (softplus(dt + dt_bias), clamp) inside; D skip; optional z gate y · silu(z).
Graph-safe: no host syncs (slot uniqueness is the caller's contract here; prefill validates it).
`snap` (a speculative verify's per-position snapshot): each live row's new state is also stored at snap[r], from
the same registers as the bank's, so a snapshot is the bank row's bits without a copy kernel.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import (FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, KernelInputError, check, dt_limits, next_pow2,
                      pdl_enter, pdl_meta, sigmoid, softplus)

OP = "ssm_step"


@triton.jit
def ssm_step_kernel(
    bank_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, z_ptr, y_ptr, slot_ptr, snap_ptr,
    H, P, N, heads_per_group, dt_lo, dt_hi,
    stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n,
    stride_x_r, stride_x_h, stride_x_p, stride_dt_r, stride_dt_h,
    stride_b_r, stride_b_g, stride_b_n, stride_c_r, stride_c_g, stride_c_n,
    stride_z_r, stride_z_h, stride_z_p, stride_y_r, stride_y_h, stride_y_p,
    stride_snap_r, stride_snap_h, stride_snap_p, stride_snap_n,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, SNAP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (R, cdiv(H, BLOCK_H), cdiv(P, BLOCK_P)); a program updates the [BLOCK_H, BLOCK_P, BLOCK_N] state tile
    of BLOCK_H heads. The state tile, slot and per-head constants are loaded before the PDL wait: a decode row's
    state is written only by this kernel in earlier steps (each step begins with non-PDL torch kernels, full
    barriers; prefill kernels of the same step write other slots), so under PDL they stream in while the kernel
    that produces x, dt, B, C drains."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    pb = tl.program_id(2)
    g = offs_h // heads_per_group
    slot = tl.load(slot_ptr + r).to(tl.int64)
    live = slot >= 0
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mh = tl.where(live, offs_h < H, False)
    mp = offs_p < P
    mn = offs_n < N
    mhp = mh[:, None] & mp[None, :]                                          # [BLOCK_H, BLOCK_P]
    mhn = mh[:, None] & mn[None, :]                                          # [BLOCK_H, BLOCK_N]
    m3 = mhp[:, :, None] & mn[None, None, :]
    tile = state_tile(bank_ptr, slot, offs_h, offs_p, offs_n, stride_bank_s, stride_bank_h, stride_bank_p,
                      stride_bank_n)
    state = tl.load(tile, mask=m3, other=0.0)
    A, bias, Dh = head_constants(A_ptr, dt_bias_ptr, D_ptr, offs_h, mh, HAS_BIAS, HAS_D)
    pdl_enter(PDL)
    xhp = offs_h[:, None] * stride_x_h + offs_p[None, :] * stride_x_p
    x = tl.load(x_ptr + r * stride_x_r + xhp, mask=mhp, other=0.0).to(tl.float32)
    if HAS_Z:                       # loaded with x, not after the state update
        z = tl.load(z_ptr + r * stride_z_r + offs_h[:, None] * stride_z_h + offs_p[None, :] * stride_z_p,
                    mask=mhp, other=0.0)
    dt = tl.load(dt_ptr + r * stride_dt_r + offs_h * stride_dt_h, mask=mh, other=0.0).to(tl.float32)
    dt, decay = processed_dt(dt, A, bias, dt_lo, dt_hi, HAS_BIAS)
    Bv = tl.load(B_ptr + r * stride_b_r + g[:, None] * stride_b_g + offs_n[None, :] * stride_b_n, mask=mhn,
                 other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + r * stride_c_r + g[:, None] * stride_c_g + offs_n[None, :] * stride_c_n, mask=mhn,
                 other=0.0).to(tl.float32)
    state = decay[:, None, None] * state + (dt[:, None] * x)[:, :, None] * Bv[:, None, :]
    tl.store(tile, state, mask=m3)
    if SNAP:
        tl.store(snap_ptr + r * stride_snap_r + offs_h[:, None, None] * stride_snap_h
                 + offs_p[None, :, None] * stride_snap_p + offs_n[None, None, :] * stride_snap_n, state, mask=m3)
    y = tl.sum(state * Cv[:, None, :], axis=2)
    if HAS_D:
        y += Dh[:, None] * x
    if HAS_Z:
        z = z.to(tl.float32)
        y = y * (z * sigmoid(z))
    y = tl.where(mhp, y, 0.0)
    tl.store(y_ptr + r * stride_y_r + offs_h[:, None] * stride_y_h + offs_p[None, :] * stride_y_p,
             y.to(y_ptr.dtype.element_ty), mask=(offs_h < H)[:, None] & mp[None, :])


@triton.jit
def state_tile(bank_ptr, slot, offs_h, offs_p, offs_n, stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n):
    """Pointers of bank[slot]'s [BLOCK_H, BLOCK_P, BLOCK_N] state tile (ssm_step and ssm_steps)."""
    return (bank_ptr + slot * stride_bank_s + offs_h[:, None, None] * stride_bank_h
            + offs_p[None, :, None] * stride_bank_p + offs_n[None, None, :] * stride_bank_n)


@triton.jit
def head_constants(A_ptr, dt_bias_ptr, D_ptr, offs_h, mh, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr):
    """(A, dt_bias, D) of the program's heads in fp32 (0 on masked heads; 0.0 for an absent dt_bias or D)."""
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(dt_bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    return A, bias, Dh


@triton.jit
def processed_dt(dt, A, bias, dt_lo, dt_hi, HAS_BIAS: tl.constexpr):
    """One token's (dt, exp(dt·A)): dt + dt_bias, softplus, clamped to [dt_lo, dt_hi] (oracle/mamba2.py's order)."""
    if HAS_BIAS:
        dt += bias
    dt = tl.minimum(tl.maximum(softplus(dt), dt_lo), dt_hi)
    return dt, tl.exp(dt * A)


def ssm_step_launch_rule(H: int, P: int, N: int) -> dict:
    """~4K fp32 state elements per program (16 KB), 8 warps, one head per program; keyed on the model shape only,
    so a row's bits never depend on the batch. Chosen by timing: docs/kernels.md, "Launch rules". In the
    Triton interpreter (CPU) a program costs its op count whatever its tile, so one program takes every head."""
    bn = next_pow2(N)
    if INTERPRET:
        return dict(BLOCK_N=bn, BLOCK_P=next_pow2(P), BLOCK_H=next_pow2(H), num_warps=8)
    return dict(BLOCK_N=bn, BLOCK_P=min(next_pow2(P), max(1, 4096 // bn)), BLOCK_H=1, num_warps=8)


def ssm_step(ssm_bank: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
             dt_bias: Tensor | None, slot: Tensor, z: Tensor | None = None,
             dt_limit: tuple[float, float] = (0.0, math.inf), out: Tensor | None = None,
             snap: Tensor | None = None, _rule: dict | None = None) -> Tensor:
    """One decode token per row: x [R,H,P], dt raw [R,H], B/C [R,G,N]; updates ssm_bank [S,H,P,N] -> y [R,H,P];
    snap [R,H,P,N] (the bank's dtype): live rows' new states also stored there (rows with slot -1 untouched)."""
    check(OP, "x", x, (None, None, None), FLOAT_DTYPES)
    R, H, P = x.shape
    dev = x.device
    check(OP, "ssm_bank", ssm_bank, (None, H, P, None), (torch.float32,), dev)
    N = ssm_bank.shape[3]
    check(OP, "dt", dt, (R, H), FLOAT_DTYPES, dev)
    check(OP, "A", A, (H,), (torch.float32,), dev)
    check(OP, "B", B, (R, None, N), FLOAT_DTYPES, dev)
    G = B.shape[1]
    if G < 1 or H % G != 0:
        raise KernelInputError(f"{OP}: n_heads={H} is not divisible by n_groups={G}")
    check(OP, "C", C, (R, G, N), FLOAT_DTYPES, dev)
    check(OP, "D", D, (H,), FLOAT_DTYPES, dev, optional=True)
    check(OP, "dt_bias", dt_bias, (H,), FLOAT_DTYPES, dev, optional=True)
    check(OP, "slot", slot, (R,), INDEX_DTYPES, dev)
    check(OP, "z", z, (R, H, P), FLOAT_DTYPES, dev, optional=True)
    if out is None:
        out = torch.empty_like(x)
    check(OP, "out", out, (R, H, P), FLOAT_DTYPES, dev)
    check(OP, "snap", snap, (R, H, P, N), (ssm_bank.dtype,), dev, optional=True)
    if R == 0:
        return out
    lo, hi = dt_limits(dt_limit)
    rule = _rule if _rule is not None else ssm_step_launch_rule(H, P, N)   # _rule: benchmark hook
    zz = z if z is not None else x
    bh = rule.get("BLOCK_H", 1)
    sn = snap if snap is not None else ssm_bank
    ssm_step_kernel[(R, triton.cdiv(H, bh), triton.cdiv(P, rule["BLOCK_P"]))](
        ssm_bank, x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, zz, out, slot,
        sn, H, P, N, H // G, lo, hi, *ssm_bank.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *zz.stride(), *out.stride(), *sn.stride(),
        HAS_D=D is not None, HAS_BIAS=dt_bias is not None, HAS_Z=z is not None, SNAP=snap is not None,
        BLOCK_H=bh, BLOCK_P=rule["BLOCK_P"], BLOCK_N=rule["BLOCK_N"], num_warps=rule["num_warps"],
        **pdl_meta(out.device))
    return out
