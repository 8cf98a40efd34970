"""One-row projection y = x · Wᵀ (+ b) for bs1 decode: a weight-streaming GEMV, fp32 accumulation.

x [1, K], W [N, K] (row-major, K contiguous), y [1, N]. Each program owns BLOCK_N output rows and walks K in
BLOCK_K tiles, so W is read exactly once with long contiguous loads; the tile shape is keyed on (N, K) only
(never on the call), so every call of a given projection has the same bits.

The x row may be computed in the load itself, so that the small kernel which would have produced it is gone
(bs1 decode is a chain of ~300 dependent kernels; each one costs ~2 µs of latency, see docs/performance.md):

    act="silu"|"relu2"     x = act(gate) · up of a gate_up row [1, 2K], rounded exactly as act_mul rounds it.
    norm=RowNorm(w, eps)   x = rmsnorm(h (+ delta·m)) · w, the row's stream h (+ the previous sublayer's output,
                           h + delta then written to norm.h_out); gate=z: x = rmsnorm(y · silu(z)) · w (one group).
                           Every program sees the whole row, so each accumulates Σ x² beside Σ x·w·W and scales
                           its sums by the row's 1/rms at the end: rmsnorm is a per-row scalar, it commutes out
                           of the dot product. (The normalised row is never rounded to the dtype: other bits than
                           norm-then-GEMV, same math.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import (FLOAT_DTYPES, KernelInputError, check, gdc_launch_dependents, gdc_wait, next_pow2, pdl_meta,
                      sigmoid)
from .matmul import split_sum_kernel

OP = "gemv"
# x-load modes (tl.constexpr: the kernel branches on them at compile time)
PLAIN, SILU, RELU2, NORM, ADD_NORM, GATED_NORM = (tl.constexpr(i) for i in range(6))
ACTS = {None: PLAIN.value, "silu": SILU.value, "relu2": RELU2.value}


@dataclass
class RowNorm:
    """The RMSNorm computed in the GEMV's x load (see the module docstring)."""
    weight: Tensor                 # [K] norm weight
    eps: float
    delta: Tensor | None = None    # [1, K] residual add: x is the stream h, normalised is h + delta·multiplier
    multiplier: float = 1.0
    h_out: Tensor | None = None    # [1, K] in h's dtype: receives h + delta·multiplier (required with delta)
    gate: Tensor | None = None     # [1, K] gated norm: x is y, normalised is y · silu(gate)


@dataclass
class ConvStep:
    """The decode conv step (conv1d.conv1d_step, SiLU) of output columns [first, first + Dc), done in the GEMV's
    epilogue: each program convolves its own columns with their window in bank[slot], writes out[:, c] and rolls
    the window (each column belongs to exactly one program, so no two programs touch the same state)."""
    weight: Tensor                 # [Dc, KC]
    bias: Tensor | None            # [Dc]
    bank: Tensor                   # [S, Dc, KC-1]
    slot: Tensor                   # [1] int32/int64 (-1: padding row: no bank access, zeros out)
    out: Tensor                    # [1, Dc]
    first: int                     # the GEMV output column of conv channel 0


@triton.jit
def gemv_kernel(x_ptr, x2_ptr, nw_ptr, hout_ptr, w_ptr, b_ptr, y_ptr, N, K, K_SPLIT, stride_w_n, eps, mult,
                cw_ptr, cb_ptr, cbank_ptr, cslot_ptr, cout_ptr, c0, Dc, s_cw_d, s_cw_k, s_bank_s, s_bank_d, s_bank_k,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, MODE: tl.constexpr, HAS_MULT: tl.constexpr, CONV: tl.constexpr,
                KC: tl.constexpr, HAS_CBIAS: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT); program s reduces K in [s·K_SPLIT, (s+1)·K_SPLIT) (PARTIAL: fp32 at y[s];
    only MODE < NORM splits). The weight tile of the next step is loaded before x: under PDL the first one is in
    flight while the kernel that produces x drains (the weights never depend on it); nothing is read from x or
    written before gdc_wait()."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ps = tl.program_id(1)
    mn = n < N
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    wrow = w_ptr + n.to(tl.int64)[:, None] * stride_w_n
    k_lo = ps * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    wv = _w_tile(wrow, k_lo + k0, k_hi, mn, EVEN_K)
    if CONV:                        # the conv window part (bias + taps · state) never depends on x: before the wait
        c = n - c0
        mc = mn & (c >= 0) & (c < Dc)
        slot = tl.load(cslot_ptr).to(tl.int64)
        ml = tl.where(slot >= 0, mc, False)
        cbase = cbank_ptr + slot * s_bank_s + c.to(tl.int64) * s_bank_d
        cacc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_CBIAS:
            cacc += tl.load(cb_ptr + c, mask=mc, other=0.0).to(tl.float32)
        for j in tl.static_range(KC - 1):
            wj = tl.load(cw_ptr + c * s_cw_d + j * s_cw_k, mask=mc, other=0.0).to(tl.float32)
            cacc += wj * tl.load(cbase + j * s_bank_k, mask=ml, other=0.0).to(tl.float32)
        c_last = tl.load(cw_ptr + c * s_cw_d + (KC - 1) * s_cw_k, mask=mc, other=0.0).to(tl.float32)
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL == 1:
        gdc_wait()
        gdc_launch_dependents()
    store_h = tl.program_id(0) == 0
    for k in range(k_lo, k_hi - BLOCK_K, BLOCK_K):          # every tile but the last: a next tile exists
        kk = k + k0
        xv, sq = _x_tile(x_ptr, x2_ptr, nw_ptr, hout_ptr, y_ptr, kk, K, kk < k_hi, store_h, mult, MODE, HAS_MULT)
        wn = _w_tile(wrow, kk + BLOCK_K, k_hi, mn, EVEN_K)
        acc += wv.to(tl.float32) * xv[None, :]
        ss += sq
        wv = wn
    kk = k_lo + ((k_hi - k_lo - 1) // BLOCK_K) * BLOCK_K + k0   # the last tile (wv holds it)
    xv, sq = _x_tile(x_ptr, x2_ptr, nw_ptr, hout_ptr, y_ptr, kk, K, kk < k_hi, store_h, mult, MODE, HAS_MULT)
    acc += wv.to(tl.float32) * xv[None, :]
    ss += sq
    y = tl.sum(acc, axis=1)
    if MODE >= NORM:
        y = y * (1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps))
    if PARTIAL:
        tl.store(y_ptr + ps * N + n, y, mask=mn)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=mn)
        if CONV:                    # conv1d_step on the stored (rounded) outputs, same order of operations
            xq = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            cacc += c_last * xq
            cacc = cacc * (1.0 / (1.0 + tl.exp(-cacc)))
            tl.store(cout_ptr + c, tl.where(ml, cacc, 0.0).to(cout_ptr.dtype.element_ty), mask=mc)
            for j in tl.static_range(KC - 2):                    # roll the window (this program's columns only)
                nxt = tl.load(cbase + (j + 1) * s_bank_k, mask=ml, other=0.0)
                tl.store(cbase + j * s_bank_k, nxt, mask=ml)
            if KC > 1:
                tl.store(cbase + (KC - 2) * s_bank_k, xq.to(cbank_ptr.dtype.element_ty), mask=ml)


@triton.jit
def _x_tile(x_ptr, x2_ptr, nw_ptr, hout_ptr, y_ptr, kk, K, mask, store_h, mult, MODE: tl.constexpr,
            HAS_MULT: tl.constexpr):
    """(the x values that multiply W at columns kk, their contribution to Σ x² (norm modes; else 0)), fp32."""
    if MODE == PLAIN:
        xv = tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)
        return xv, xv * 0.0
    if MODE == SILU or MODE == RELU2:           # act_mul's rounding points: act, then the product
        g = tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + kk, mask=mask, other=0.0).to(tl.float32)
        if MODE == RELU2:
            a = tl.maximum(g, 0.0)
            a = a * a
        else:
            a = g * sigmoid(g)
        a = a.to(x_ptr.dtype.element_ty).to(tl.float32)
        xv = (a * u).to(x_ptr.dtype.element_ty).to(tl.float32)
        return xv, xv * 0.0
    nw = tl.load(nw_ptr + kk, mask=mask, other=0.0).to(tl.float32)
    if MODE == GATED_NORM:                      # rms_norm_gated: g = y · silu(z) in fp32
        g = tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(x2_ptr + kk, mask=mask, other=0.0).to(tl.float32)
        g = g * (z * sigmoid(z))
        return g * nw, g * g
    h = tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)
    if MODE == ADD_NORM:                        # add_rms_norm: h + d·m rounded to the stream dtype, stored
        d = tl.load(x2_ptr + kk, mask=mask, other=0.0).to(tl.float32)
        if HAS_MULT:
            d = (d * mult).to(x2_ptr.dtype.element_ty).to(tl.float32)
        hs = (h + d).to(hout_ptr.dtype.element_ty)
        tl.store(hout_ptr + kk, hs, mask=tl.where(store_h, mask, False))
        h = hs.to(tl.float32)
    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)     # the normalised row's dtype (add_rms_norm's out)
    return h * nw, h * h


@triton.jit
def _w_tile(wrow, kk, k_hi, mn, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns kk (zeros past k_hi unless EVEN_K says there are none)."""
    if EVEN_K:
        return tl.load(wrow + kk[None, :], mask=mn[:, None], other=0.0)
    return tl.load(wrow + kk[None, :], mask=mn[:, None] & (kk < k_hi)[None, :], other=0.0)


def gemv_launch_rule(N: int, K: int) -> dict:
    """Keyed on (N, K) only; picked on an H200 (2026-11-30): tools/bench_gemm.py (CUDA graphs, cold weights) chose
    4 rows per program, 1024-wide K tiles and 8 warps for long K rows; whole bs1 decode steps of anchor-3b
    (docs/performance.md, session 3) then chose 2 rows and 2 warps for K < 4096 (-44 µs/step against 4 rows and
    4 warps). A K split never won (so SPLIT stays 1; benches may set it)."""
    if K >= 4096:
        return dict(BLOCK_N=4, BLOCK_K=1024, SPLIT=1, num_warps=8, num_stages=3)
    return dict(BLOCK_N=2, BLOCK_K=min(512, next_pow2(K, 16)), SPLIT=1, num_warps=2, num_stages=1)


def _mode(x: Tensor, K: int, act: str | None, norm: RowNorm | None) -> tuple[int, Tensor, Tensor, Tensor]:
    """Validate act/norm against x [1, K]; (MODE, x2, norm weight, h_out) kernel arguments (x where unused)."""
    if act not in ACTS:
        raise KernelInputError(f"{OP}: `act` is {act!r}, expected one of {list(ACTS)}")
    if norm is None:
        return ACTS[act], x, x, x
    if act is not None:
        raise KernelInputError(f"{OP}: `act` and `norm` cannot be combined")
    dev = x.device
    check(OP, "norm.weight", norm.weight, (K,), FLOAT_DTYPES, dev)
    check(OP, "norm.delta", norm.delta, (1, K), FLOAT_DTYPES, dev, optional=True)
    check(OP, "norm.gate", norm.gate, (1, K), FLOAT_DTYPES, dev, optional=True)
    for name, t in (("norm.weight", norm.weight), ("norm.delta", norm.delta), ("norm.gate", norm.gate)):
        if t is not None and t.stride(-1) != 1:
            raise KernelInputError(f"{OP}: `{name}` must be contiguous")
    if norm.gate is not None:
        if norm.delta is not None:
            raise KernelInputError(f"{OP}: `norm.gate` and `norm.delta` cannot be combined")
        return GATED_NORM.value, norm.gate, norm.weight, x
    if norm.delta is None:
        return NORM.value, x, norm.weight, x
    check(OP, "norm.h_out", norm.h_out, (1, K), (x.dtype,), dev)
    if norm.h_out.stride(-1) != 1:
        raise KernelInputError(f"{OP}: `norm.h_out` must be contiguous")
    return ADD_NORM.value, norm.delta, norm.weight, norm.h_out


def _conv_args(conv: ConvStep | None, N: int, weight: Tensor) -> tuple[tuple, dict]:
    """Validate the conv epilogue; (its kernel arguments, its constexprs; unused pointers get `weight`)."""
    dev = weight.device
    if conv is None:
        return (weight,) * 5 + (0,) * 7, dict(CONV=False, KC=1, HAS_CBIAS=False)
    check(OP, "conv.weight", conv.weight, (None, None), FLOAT_DTYPES, dev)
    Dc, KC = conv.weight.shape
    if KC < 1 or not 0 <= conv.first <= N - Dc:
        raise KernelInputError(f"{OP}: conv channels [{conv.first}, {conv.first + Dc}) are not output columns "
                               f"of this GEMV (N={N}), or the kernel width is {KC}")
    check(OP, "conv.bias", conv.bias, (Dc,), FLOAT_DTYPES, dev, optional=True)
    check(OP, "conv.bank", conv.bank, (None, Dc, KC - 1), FLOAT_DTYPES, dev)
    check(OP, "conv.slot", conv.slot, (1,), (torch.int32, torch.int64), dev)
    check(OP, "conv.out", conv.out, (1, Dc), FLOAT_DTYPES, dev)
    if conv.out.stride(1) != 1:
        raise KernelInputError(f"{OP}: `conv.out` must be contiguous")
    b = conv.bias if conv.bias is not None else conv.weight
    return ((conv.weight, b, conv.bank, conv.slot, conv.out, conv.first, Dc, *conv.weight.stride(),
             *conv.bank.stride()), dict(CONV=True, KC=KC, HAS_CBIAS=conv.bias is not None))


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
         rule: dict | None = None, act: str | None = None, norm: RowNorm | None = None,
         conv: ConvStep | None = None) -> Tensor:
    """x [1, K] · weight[N, K]ᵀ (+ bias [N]) -> [1, N] in weight's dtype (rule: override the launch rule, benches).
    act: x is a gate_up row [1, 2K] and the product is act(gate)·up · weightᵀ; norm: the product is
    rmsnorm(x …)·weightᵀ (module docstring); conv: the decode conv step of some output columns (ConvStep)."""
    check(OP, "x", x, (1, None), FLOAT_DTYPES)
    K = x.shape[1]
    if act is not None and act in ACTS:
        if K % 2:
            raise KernelInputError(f"{OP}: with act, `x` is [gate | up]; its last dim ({K}) must be even")
        K //= 2
    dev = x.device
    check(OP, "weight", weight, (None, K), FLOAT_DTYPES, dev)
    N = weight.shape[0]
    check(OP, "bias", bias, (N,), FLOAT_DTYPES, dev, optional=True)
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise KernelInputError(f"{OP}: the last dims of `x`, `weight` and `bias` must be contiguous")
    mode, x2, nw, h_out = _mode(x, K, act, norm)
    if out is None:
        out = torch.empty(1, N, dtype=weight.dtype, device=dev)
    check(OP, "out", out, (1, N), FLOAT_DTYPES, dev)
    if out.stride(1) != 1:
        raise KernelInputError(f"{OP}: `out` must be contiguous")
    if N == 0:
        return out
    r = {**gemv_launch_rule(N, K), **(rule or {})}
    bk = r["BLOCK_K"]
    cargs, cmeta = _conv_args(conv, N, weight)
    split = 1 if (mode >= NORM.value or conv is not None) else r["SPLIT"]   # whole rows: norm and conv need them
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_split)
    b_arg = bias if bias is not None else weight
    mult = 1.0 if norm is None else float(norm.multiplier)
    eps = 0.0 if norm is None else float(norm.eps)
    meta = dict(BLOCK_N=r["BLOCK_N"], BLOCK_K=bk, EVEN_K=K % bk == 0, MODE=mode, HAS_MULT=mult != 1.0, **cmeta,
                num_warps=r["num_warps"], num_stages=r["num_stages"], **pdl_meta(dev))
    grid = (triton.cdiv(N, r["BLOCK_N"]), split)
    args = (x, x2, nw, h_out, weight, b_arg)
    if split == 1:
        gemv_kernel[grid](*args, out, N, K, k_split, weight.stride(0), eps, mult, *cargs,
                          HAS_BIAS=bias is not None, PARTIAL=False, **meta)
    else:                                   # fixed split of K, partials summed in order (deterministic)
        part = torch.empty(split, N, dtype=torch.float32, device=dev)
        gemv_kernel[grid](*args, part, N, K, k_split, weight.stride(0), eps, mult, *cargs, HAS_BIAS=False,
                          PARTIAL=True, **meta)
        split_sum_kernel[(triton.cdiv(N, 1024),)](part, b_arg, out, N, N, SPLIT=split, HAS_BIAS=bias is not None,
                                                  BLOCK=1024)
    return out
