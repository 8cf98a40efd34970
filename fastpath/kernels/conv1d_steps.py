"""Decode conv steps of W positions per row in one launch (conv1d_step applied W times, fastpath/kernels/conv1d.py).

The verify step and the draft's catch-up forward feed each row up to W tokens (fastpath/engine/verify.py). Position
j of row r convolves x[j, r] with the window in conv_bank[slot[j, r]] and rolls it; slot -1 marks a position the row
does not have (output zeros, no bank access). A program walks its channels through the W positions in order, with
conv1d_step's arithmetic (conv_window, conv_roll), so y, the bank and the snapshots have the bits of W conv1d_step
calls; a CTA barrier after each roll makes the window it stored visible to the next position's reads (and to the
snapshot, read back from the bank). One launch
also removes the hazard of W back-to-back conv1d_step launches under PDL (each reads its window before its wait).
Contract: a row's live positions share one slot. `snap`: the window after each live position j < W-1 also goes
to snap[j, r]. Graph-safe: no host syncs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, INDEX_DTYPES, check, next_pow2, pdl_enter, pdl_meta, row_slot
from .conv1d import _check_common, conv1d_launch_rule, conv_roll, conv_window

OP = "conv1d_steps"


@triton.jit
def conv1d_steps_kernel(
    x_ptr, w_ptr, bias_ptr, bank_ptr, y_ptr, slot_ptr, snap_ptr, W, Dc,
    stride_x_w, stride_x_r, stride_x_d, stride_w_d, stride_w_k, stride_bank_s, stride_bank_d, stride_bank_k,
    stride_y_w, stride_y_r, stride_y_d, stride_slot_w, stride_slot_r,
    stride_snap_w, stride_snap_r, stride_snap_d, stride_snap_k,
    K: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
    SNAP: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (R, cdiv(Dc, BLOCK_D)). The PDL wait comes first: every window read follows it."""
    r = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < Dc
    slot = row_slot(slot_ptr, r, W, stride_slot_w, stride_slot_r)
    base = bank_ptr + slot * stride_bank_s + offs_d * stride_bank_d
    pdl_enter(PDL)
    for j in range(W):
        live = tl.load(slot_ptr + j * stride_slot_w + r * stride_slot_r) >= 0
        ml = tl.where(live, md, False)
        acc, w_last = conv_window(w_ptr, bias_ptr, base, offs_d, md, ml, stride_w_d, stride_w_k, stride_bank_k,
                                  K, HAS_BIAS)
        x = tl.load(x_ptr + j * stride_x_w + r * stride_x_r + offs_d * stride_x_d, mask=ml, other=0.0).to(tl.float32)
        acc += w_last * x
        if SILU:
            acc = acc * (1.0 / (1.0 + tl.exp(-acc)))
        acc = tl.where(ml, acc, 0.0)
        tl.store(y_ptr + j * stride_y_w + r * stride_y_r + offs_d * stride_y_d, acc.to(y_ptr.dtype.element_ty),
                 mask=md)
        conv_roll(base, x, ml, stride_bank_k, K, KW, base, stride_bank_k, False)
        tl.debug_barrier()                         # the rolled window is visible to every lane's next reads
        if SNAP:                                   # the snapshot: the rolled window read back (the bank's bits)
            taps = tl.arange(0, KW)
            ms = tl.where(j < W - 1, ml, False)[:, None] & (taps < K - 1)[None, :]
            win = tl.load(base[:, None] + taps[None, :] * stride_bank_k, mask=ms, other=0.0)
            tl.store(snap_ptr + j * stride_snap_w + r * stride_snap_r + offs_d[:, None] * stride_snap_d
                     + taps[None, :] * stride_snap_k, win, mask=ms)


def conv1d_steps(x: Tensor, weight: Tensor, bias: Tensor | None, conv_bank: Tensor, slot: Tensor,
                 silu: bool = True, out: Tensor | None = None, snap: Tensor | None = None) -> Tensor:
    """x [W, R, conv_dim] -> y [W, R, conv_dim], rolling conv_bank[slot[j, r]] once per live position (slot [W, R],
    -1: no token there, zeros out; a row's live positions share one slot). snap [W-1, R, conv_dim, K-1] (the
    bank's dtype): the window after each live position j < W-1."""
    check(OP, "x", x, (None, None, None), FLOAT_DTYPES)
    W, R = x.shape[0], x.shape[1]
    Dc, K = _check_common(OP, x[0] if W else x.reshape(0, x.shape[2]), weight, bias, conv_bank)
    dev = x.device
    check(OP, "slot", slot, (W, R), INDEX_DTYPES, dev)
    if out is None:
        out = torch.empty_like(x)
    check(OP, "out", out, (W, R, Dc), FLOAT_DTYPES, dev)
    check(OP, "snap", snap, (W - 1, R, Dc, K - 1), (conv_bank.dtype,), dev, optional=True)
    if R == 0 or W == 0:
        return out
    rule = conv1d_launch_rule(Dc)
    snapping = snap is not None and W > 1
    sn = snap if snapping else conv_bank.unsqueeze(0)
    conv1d_steps_kernel[(R, triton.cdiv(Dc, rule["BLOCK_D"]))](
        x, weight, bias if bias is not None else weight, conv_bank, out, slot, sn, W, Dc,
        *x.stride(), *weight.stride(), *conv_bank.stride(), *out.stride(), *slot.stride(), *sn.stride(),
        K=K, KW=next_pow2(K - 1), HAS_BIAS=bias is not None, SILU=silu, BLOCK_D=rule["BLOCK_D"],
        SNAP=snapping, num_warps=rule["num_warps"], **pdl_meta(dev))
    return out
