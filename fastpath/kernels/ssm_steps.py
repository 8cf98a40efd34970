"""Decode state updates of W positions per row in one launch (mirrors oracle/ssd.py: ssm_step, applied W times).

The verify step of speculative decoding and the draft's catch-up forward feed each row up to W tokens in a row
(fastpath/engine/verify.py). Position j of row r reads and writes ssm_bank[slot[j, r]]; slot -1 marks a position
the row does not have (before or after its tokens). A program keeps its state tile in registers across the W
positions (loaded once, stored once) where W launches of ssm_step would load and store it W times; every position's
arithmetic is ssm_step's, in its order, so y, the bank and the snapshots have the bits of W ssm_step calls.
Contract (the caller's, like slot uniqueness): every live position of a row carries the same slot. `snap`: the state
after each live position j < W-1 is also stored at snap[j, r], from the registers (a verify's per-position
snapshot). No z gate (the verify path gates in the gated norm). Graph-safe: no host syncs.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, INDEX_DTYPES, KernelInputError, check, dt_limits, pdl_enter, pdl_meta, row_slot
from .ssm_step import head_constants, processed_dt, ssm_step_launch_rule, state_tile

OP = "ssm_steps"


@triton.jit
def ssm_steps_kernel(
    bank_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr, slot_ptr, snap_ptr,
    W, H, P, N, heads_per_group, dt_lo, dt_hi,
    stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n,
    stride_x_w, stride_x_r, stride_x_h, stride_x_p, stride_dt_w, stride_dt_r, stride_dt_h,
    stride_b_w, stride_b_r, stride_b_g, stride_b_n, stride_c_w, stride_c_r, stride_c_g, stride_c_n,
    stride_y_w, stride_y_r, stride_y_h, stride_y_p, stride_slot_w, stride_slot_r,
    stride_snap_w, stride_snap_r, stride_snap_h, stride_snap_p, stride_snap_n,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SNAP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (R, cdiv(H, BLOCK_H), cdiv(P, BLOCK_P)), ssm_step's tiles. The row's slot is the largest over its
    positions (its one slot, or -1: no live position); state tile and per-head constants load before the PDL wait
    (ssm_step_kernel's reasoning), then the positions run in order."""
    r = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    pb = tl.program_id(2)
    g = offs_h // heads_per_group
    slot = row_slot(slot_ptr, r, W, stride_slot_w, stride_slot_r)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mh = tl.where(slot >= 0, offs_h < H, False)
    mp = offs_p < P
    mn = offs_n < N
    m3 = (mh[:, None] & mp[None, :])[:, :, None] & mn[None, None, :]
    tile = state_tile(bank_ptr, slot, offs_h, offs_p, offs_n, stride_bank_s, stride_bank_h, stride_bank_p,
                      stride_bank_n)
    state = tl.load(tile, mask=m3, other=0.0)
    A, bias, Dh = head_constants(A_ptr, dt_bias_ptr, D_ptr, offs_h, mh, HAS_BIAS, HAS_D)
    pdl_enter(PDL)
    for j in range(W):
        live = tl.load(slot_ptr + j * stride_slot_w + r * stride_slot_r) >= 0
        mhj = tl.where(live, mh, False)
        mhp = mhj[:, None] & mp[None, :]
        mhn = mhj[:, None] & mn[None, :]
        x = tl.load(x_ptr + j * stride_x_w + r * stride_x_r + offs_h[:, None] * stride_x_h
                    + offs_p[None, :] * stride_x_p, mask=mhp, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + j * stride_dt_w + r * stride_dt_r + offs_h * stride_dt_h, mask=mhj,
                     other=0.0).to(tl.float32)
        dt, decay = processed_dt(dt, A, bias, dt_lo, dt_hi, HAS_BIAS)
        Bv = tl.load(B_ptr + j * stride_b_w + r * stride_b_r + g[:, None] * stride_b_g + offs_n[None, :] * stride_b_n,
                     mask=mhn, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + j * stride_c_w + r * stride_c_r + g[:, None] * stride_c_g + offs_n[None, :] * stride_c_n,
                     mask=mhn, other=0.0).to(tl.float32)
        new = decay[:, None, None] * state + (dt[:, None] * x)[:, :, None] * Bv[:, None, :]
        state = tl.where(live, new, state)
        if SNAP:
            tl.store(snap_ptr + j * stride_snap_w + r * stride_snap_r + offs_h[:, None, None] * stride_snap_h
                     + offs_p[None, :, None] * stride_snap_p + offs_n[None, None, :] * stride_snap_n, state,
                     mask=m3 & live & (j < W - 1))
        y = tl.sum(state * Cv[:, None, :], axis=2)
        if HAS_D:
            y += Dh[:, None] * x
        y = tl.where(mhp, y, 0.0)
        tl.store(y_ptr + j * stride_y_w + r * stride_y_r + offs_h[:, None] * stride_y_h + offs_p[None, :] * stride_y_p,
                 y.to(y_ptr.dtype.element_ty), mask=(offs_h < H)[:, None] & mp[None, :])
    tl.store(tile, state, mask=m3)


def ssm_steps(ssm_bank: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
              dt_bias: Tensor | None, slot: Tensor, dt_limit: tuple[float, float] = (0.0, math.inf),
              out: Tensor | None = None, snap: Tensor | None = None, _rule: dict | None = None) -> Tensor:
    """W decode tokens per row: x [W,R,H,P], dt raw [W,R,H], B/C [W,R,G,N], slot [W,R] (-1: no token there; a
    row's live positions share one slot); updates ssm_bank [S,H,P,N] -> y [W,R,H,P] (zeros where slot is -1);
    snap [W-1,R,H,P,N] (the bank's dtype): the state after each live position j < W-1."""
    check(OP, "x", x, (None, None, None, None), FLOAT_DTYPES)
    W, R, H, P = x.shape
    dev = x.device
    check(OP, "ssm_bank", ssm_bank, (None, H, P, None), (torch.float32,), dev)
    N = ssm_bank.shape[3]
    check(OP, "dt", dt, (W, R, H), FLOAT_DTYPES, dev)
    check(OP, "A", A, (H,), (torch.float32,), dev)
    check(OP, "B", B, (W, R, None, N), FLOAT_DTYPES, dev)
    G = B.shape[2]
    if G < 1 or H % G != 0:
        raise KernelInputError(f"{OP}: n_heads={H} is not divisible by n_groups={G}")
    check(OP, "C", C, (W, R, G, N), FLOAT_DTYPES, dev)
    check(OP, "D", D, (H,), FLOAT_DTYPES, dev, optional=True)
    check(OP, "dt_bias", dt_bias, (H,), FLOAT_DTYPES, dev, optional=True)
    check(OP, "slot", slot, (W, R), INDEX_DTYPES, dev)
    if out is None:
        out = torch.empty_like(x)
    check(OP, "out", out, (W, R, H, P), FLOAT_DTYPES, dev)
    check(OP, "snap", snap, (W - 1, R, H, P, N), (ssm_bank.dtype,), dev, optional=True)
    if R == 0 or W == 0:
        return out
    lo, hi = dt_limits(dt_limit)
    rule = _rule if _rule is not None else ssm_step_launch_rule(H, P, N)
    bh = rule.get("BLOCK_H", 1)
    sn = snap if snap is not None and W > 1 else ssm_bank.unsqueeze(0)
    ssm_steps_kernel[(R, triton.cdiv(H, bh), triton.cdiv(P, rule["BLOCK_P"]))](
        ssm_bank, x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, out, slot, sn,
        W, H, P, N, H // G, lo, hi, *ssm_bank.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *out.stride(), *slot.stride(), *sn.stride(),
        HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SNAP=snap is not None and W > 1,
        BLOCK_H=bh, BLOCK_P=rule["BLOCK_P"], BLOCK_N=rule["BLOCK_N"], num_warps=rule["num_warps"],
        **pdl_meta(out.device))
    return out
