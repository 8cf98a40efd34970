"""Causal depthwise conv1d over the state bank (mirrors oracle/conv1d.py), prefill (varlen) and decode.

Window convention: conv_bank[slot] is [conv_dim, K-1], the last K-1 inputs of each channel, oldest first.
    y_t[d] = bias[d] + Σ_k weight[d, k] · u[t + k][d],   u = concat(window, x) along time,
then SiLU when `silu=True`. Sequence s starts from conv_bank[slot[s]] when has_initial_state[s] (zeros
otherwise) and leaves its last K-1 inputs there. Slot -1: no bank read or write (prefill: zero window, outputs
still computed; decode: output zero).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import (FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, KernelInputError, check, check_slots, host_ints,
                      next_pow2, pdl_enter, pdl_meta, token_sequence_index)

OP_PREFILL = "causal_conv1d_varlen"
OP_STEP = "conv1d_step"


@triton.jit
def conv1d_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, bank_ptr, y_ptr, tok_seq_ptr, cu_ptr, slot_ptr, has_init_ptr,
    T, Dc,
    stride_x_t, stride_x_d, stride_w_d, stride_w_k, stride_bank_s, stride_bank_d, stride_bank_k,
    stride_y_t, stride_y_d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Outputs. Grid (cdiv(T, BLOCK_T), cdiv(Dc, BLOCK_D)); reads windows, never writes them."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mt = offs_t < T
    md = offs_d < Dc
    seq = tl.load(tok_seq_ptr + offs_t, mask=mt, other=0)
    first = tl.load(cu_ptr + seq, mask=mt, other=0).to(tl.int64)
    i = offs_t - first                                                    # index within its sequence
    slot = tl.load(slot_ptr + seq, mask=mt, other=-1).to(tl.int64)
    from_bank = mt & (slot >= 0) & (tl.load(has_init_ptr + seq, mask=mt, other=0) != 0)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        j = i + (k - (K - 1))                                             # u index - (K-1): < 0 is the window
        xv = tl.load(x_ptr + (offs_t + (k - (K - 1)))[:, None] * stride_x_t + offs_d[None, :] * stride_x_d,
                     mask=(mt & (j >= 0))[:, None] & md[None, :], other=0.0).to(tl.float32)
        wv = tl.load(bank_ptr + slot[:, None] * stride_bank_s + offs_d[None, :] * stride_bank_d
                     + (j + (K - 1))[:, None] * stride_bank_k,
                     mask=(from_bank & (j < 0))[:, None] & md[None, :], other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + offs_d * stride_w_d + k * stride_w_k, mask=md, other=0.0).to(tl.float32)
        acc += wk[None, :] * (xv + wv)
    if SILU:
        acc = acc * (1.0 / (1.0 + tl.exp(-acc)))
    tl.store(y_ptr + offs_t[:, None] * stride_y_t + offs_d[None, :] * stride_y_d,
             acc.to(y_ptr.dtype.element_ty), mask=mt[:, None] & md[None, :])


@triton.jit
def conv1d_window_update_kernel(
    x_ptr, bank_ptr, cu_ptr, slot_ptr, has_init_ptr, Dc,
    stride_x_t, stride_x_d, stride_bank_s, stride_bank_d, stride_bank_k,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """New windows = last K-1 entries of concat(old window, x). Grid (n_seqs, cdiv(Dc, BLOCK_D))."""
    s = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < Dc
    slot = tl.load(slot_ptr + s).to(tl.int64)
    live = slot >= 0
    init = live & (tl.load(has_init_ptr + s) != 0)
    first = tl.load(cu_ptr + s).to(tl.int64)
    L = tl.load(cu_ptr + s + 1).to(tl.int64) - first
    kk = tl.arange(0, BLOCK_K)
    src = L + kk                                                          # index into u
    mk = kk < K - 1
    old_m = tl.where(init, (mk & (src < K - 1))[None, :] & md[:, None], False)
    new_m = tl.where(live, (mk & (src >= K - 1))[None, :] & md[:, None], False)
    base = bank_ptr + slot * stride_bank_s + offs_d[:, None] * stride_bank_d
    old = tl.load(base + src[None, :] * stride_bank_k, mask=old_m, other=0.0)
    new = tl.load(x_ptr + (first + src - (K - 1))[None, :] * stride_x_t + offs_d[:, None] * stride_x_d,
                  mask=new_m, other=0.0).to(tl.float32)
    win = old + new
    tl.debug_barrier()                                                    # all reads of the old window first
    tl.store(base + kk[None, :] * stride_bank_k, win.to(bank_ptr.dtype.element_ty),
             mask=tl.where(live, mk[None, :] & md[:, None], False))


@triton.jit
def conv_window(w_ptr, bias_ptr, base, d, md, ml, stride_w_d, stride_w_k, stride_bank_k,
                K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The decode conv of channels d without the new input: (bias + Σ_{k<K-1} weight[d, k] · window[k],
    weight[d, K-1]) in fp32, taps added in order (so every caller rounds alike); the window at base
    (+ k · stride_bank_k) is read where ml."""
    acc = tl.zeros(d.shape, dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=md, other=0.0).to(tl.float32)
    for k in tl.static_range(K - 1):
        wk = tl.load(w_ptr + d * stride_w_d + k * stride_w_k, mask=md, other=0.0).to(tl.float32)
        acc += wk * tl.load(base + k * stride_bank_k, mask=ml, other=0.0).to(tl.float32)
    return acc, tl.load(w_ptr + d * stride_w_d + (K - 1) * stride_w_k, mask=md, other=0.0).to(tl.float32)


@triton.jit
def conv_roll(base, x_new, ml, stride_bank_k, K: tl.constexpr, KW: tl.constexpr, snap, stride_snap_k,
              SNAP: tl.constexpr):
    """Shift each window (where ml) left by one and append x_new. Every tap is loaded before a CTA barrier and
    stored after it, so lanes holding the same channel (replicated layouts) cannot read a tap already shifted.
    SNAP: the rolled window is also stored at `snap` (+ k · stride_snap_k), from the same registers."""
    if K > 1:
        j = tl.arange(0, KW)
        m = ml[:, None] & (j < K - 1)[None, :]
        win = tl.load(base[:, None] + j[None, :] * stride_bank_k, mask=m, other=0.0)
        tl.debug_barrier()
        tl.store(base[:, None] + (j - 1)[None, :] * stride_bank_k, win, mask=m & (j >= 1)[None, :])
        tl.store(base + (K - 2) * stride_bank_k, x_new.to(base.dtype.element_ty), mask=ml)
        if SNAP:
            tl.store(snap[:, None] + (j - 1)[None, :] * stride_snap_k, win, mask=m & (j >= 1)[None, :])
            tl.store(snap + (K - 2) * stride_snap_k, x_new.to(snap.dtype.element_ty), mask=ml)


@triton.jit
def conv1d_step_kernel(
    x_ptr, w_ptr, bias_ptr, bank_ptr, y_ptr, slot_ptr, snap_ptr, Dc,
    stride_x_r, stride_x_d, stride_w_d, stride_w_k, stride_bank_s, stride_bank_d, stride_bank_k,
    stride_y_r, stride_y_d, stride_snap_r, stride_snap_d, stride_snap_k,
    K: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
    SNAP: tl.constexpr, PDL: tl.constexpr,
):
    """Decode: one token per row. Grid (R, cdiv(Dc, BLOCK_D)). The window part (bias, taps · state) is computed
    before the PDL wait: only this kernel writes the bank, so it overlaps the kernel that produces x. SNAP: the
    rolled window also goes to snap[r] (conv_roll)."""
    r = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < Dc
    slot = tl.load(slot_ptr + r).to(tl.int64)
    ml = tl.where(slot >= 0, md, False)
    base = bank_ptr + slot * stride_bank_s + offs_d * stride_bank_d
    acc, w_last = conv_window(w_ptr, bias_ptr, base, offs_d, md, ml, stride_w_d, stride_w_k, stride_bank_k,
                              K, HAS_BIAS)
    pdl_enter(PDL)
    x = tl.load(x_ptr + r * stride_x_r + offs_d * stride_x_d, mask=ml, other=0.0).to(tl.float32)
    acc += w_last * x
    if SILU:
        acc = acc * (1.0 / (1.0 + tl.exp(-acc)))
    acc = tl.where(ml, acc, 0.0)
    tl.store(y_ptr + r * stride_y_r + offs_d * stride_y_d, acc.to(y_ptr.dtype.element_ty), mask=md)
    conv_roll(base, x, ml, stride_bank_k, K, KW, snap_ptr + r * stride_snap_r + offs_d * stride_snap_d,
              stride_snap_k, SNAP)


def conv1d_launch_rule(Dc: int) -> dict:
    """Channel tile 128 (or less), 16 tokens per prefill program, 4 warps; in the Triton interpreter (CPU), where a
    program costs its op count whatever its tile, every channel in one tile."""
    return dict(BLOCK_D=min(next_pow2(Dc), 8192 if INTERPRET else 128), BLOCK_T=16, num_warps=4)


def _check_common(op: str, x: Tensor, weight: Tensor, bias: Tensor | None, conv_bank: Tensor) -> tuple[int, int]:
    check(op, "x", x, (None, None), FLOAT_DTYPES)
    Dc = x.shape[1]
    check(op, "weight", weight, (Dc, None), FLOAT_DTYPES, x.device)
    K = weight.shape[1]
    if K < 1:
        raise KernelInputError(f"{op}: `weight` has kernel width {K}")
    check(op, "bias", bias, (Dc,), FLOAT_DTYPES, x.device, optional=True)
    check(op, "conv_bank", conv_bank, (None, Dc, K - 1), FLOAT_DTYPES, x.device)
    return Dc, K


def causal_conv1d_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, conv_bank: Tensor,
                         cu_seqlens: Tensor, slot: Tensor, has_initial_state: Tensor, silu: bool = True,
                         out: Tensor | None = None, validate: bool = True, tok_seq: Tensor | None = None) -> Tensor:
    """Packed x [T, conv_dim] -> y [T, conv_dim]; each sequence's window continued from/written to the bank.

    validate=False skips the host-side checks of cu_seqlens and slots (no host sync; the caller checked);
    tok_seq: token_sequence_index(cu_seqlens, T), when the caller built it once for every layer of a step."""
    op = OP_PREFILL
    Dc, K = _check_common(op, x, weight, bias, conv_bank)
    T, dev = x.shape[0], x.device
    check(op, "cu_seqlens", cu_seqlens, (None,), INDEX_DTYPES, dev)
    n_seq = cu_seqlens.shape[0] - 1
    check(op, "slot", slot, (n_seq,), INDEX_DTYPES, dev)
    check(op, "has_initial_state", has_initial_state, (n_seq,), (torch.bool, torch.int32, torch.int8), dev)
    if validate:
        cu = host_ints(op, "cu_seqlens", cu_seqlens)
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise KernelInputError(f"{op}: `cu_seqlens` must rise from 0 to T={T}, got {cu[:4]}...{cu[-1:]}")
        check_slots(op, host_ints(op, "slot", slot), conv_bank.shape[0])
    if out is None:
        out = torch.empty_like(x)
    check(op, "out", out, (T, Dc), FLOAT_DTYPES, dev)
    if n_seq == 0:
        return out
    rule = conv1d_launch_rule(Dc)
    has_init = has_initial_state.to(torch.int32)
    if tok_seq is None:
        tok_seq = token_sequence_index(cu_seqlens, T)
    check(op, "tok_seq", tok_seq, (T,), INDEX_DTYPES, dev)
    b = bias if bias is not None else weight
    if T > 0:
        conv1d_varlen_kernel[(triton.cdiv(T, rule["BLOCK_T"]), triton.cdiv(Dc, rule["BLOCK_D"]))](
            x, weight, b, conv_bank, out, tok_seq, cu_seqlens, slot, has_init, T, Dc,
            *x.stride(), *weight.stride(), *conv_bank.stride(), *out.stride(),
            K=K, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=rule["BLOCK_T"], BLOCK_D=rule["BLOCK_D"],
            num_warps=rule["num_warps"])
    if K > 1:
        conv1d_window_update_kernel[(n_seq, triton.cdiv(Dc, rule["BLOCK_D"]))](
            x, conv_bank, cu_seqlens, slot, has_init, Dc, *x.stride(), *conv_bank.stride(),
            K=K, BLOCK_K=next_pow2(K - 1), BLOCK_D=rule["BLOCK_D"], num_warps=rule["num_warps"])
    return out


def conv1d_step(x: Tensor, weight: Tensor, bias: Tensor | None, conv_bank: Tensor, slot: Tensor,
                silu: bool = True, out: Tensor | None = None, snap: Tensor | None = None) -> Tensor:
    """Decode x [R, conv_dim] -> y [R, conv_dim]; rolls conv_bank[slot[r]] by one; slot -1 rows give zeros.
    snap [R, conv_dim, K-1] (the bank's dtype): live rows' rolled windows also stored there."""
    op = OP_STEP
    Dc, K = _check_common(op, x, weight, bias, conv_bank)
    R, dev = x.shape[0], x.device
    check(op, "slot", slot, (R,), INDEX_DTYPES, dev)
    if out is None:
        out = torch.empty_like(x)
    check(op, "out", out, (R, Dc), FLOAT_DTYPES, dev)
    check(op, "snap", snap, (R, Dc, K - 1), (conv_bank.dtype,), dev, optional=True)
    if R == 0:
        return out
    rule = conv1d_launch_rule(Dc)
    sn = snap if snap is not None else conv_bank
    conv1d_step_kernel[(R, triton.cdiv(Dc, rule["BLOCK_D"]))](
        x, weight, bias if bias is not None else weight, conv_bank, out, slot, sn, Dc,
        *x.stride(), *weight.stride(), *conv_bank.stride(), *out.stride(), *sn.stride(),
        K=K, KW=next_pow2(K - 1), HAS_BIAS=bias is not None, SILU=silu, BLOCK_D=rule["BLOCK_D"],
        SNAP=snap is not None, num_warps=rule["num_warps"], **pdl_meta(dev))
    return out
