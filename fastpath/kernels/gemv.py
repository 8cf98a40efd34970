"""One-row projection y = x · Wᵀ (+ b) for bs1 decode: a weight-streaming GEMV, fp32 accumulation.

x [1, K], W [N, K] (row-major, K contiguous), y [1, N]. Each program owns BLOCK_N output rows and walks K in
BLOCK_K tiles, so W is read exactly once with long contiguous loads; the tile shape is keyed on (N, K) only
(never on the call), so every call of a given projection has the same bits.

The x row may be computed in the load, and a small per-column step done in the epilogue, so that the small kernel
that would have produced or consumed it is gone (bs1 decode is a chain of ~300 dependent kernels, each ~2 µs of
latency; docs/performance.md):

    act="silu"|"relu2"   x = act(gate) · up of a gate_up row [1, 2K], rounded exactly as act_mul rounds it.
    conv=ConvStep(...)   the Mamba decode conv step of a range of output columns (in_proj's xBC), as conv1d_step.
    rms_eps=eps          the RMSNorm of x (its gain folded into W at load: FastModel.fold_gains): every program
                         sums x² over the whole row beside x·w and scales its dot products by 1/sqrt(mean + eps).
    residual=ResidualAdd the residual add that follows: stream[n] += y[n] and the rounded copy the next
                         projection (with rms_eps) reads, written by the program that owns column n.

act and conv keep the unfused rounding points (same bits as the separate kernels); rms_eps and residual replace
add_rms_norm / rms_norm_gated with the same statistics but other rounding points (normalised x is never rounded).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, KernelInputError, check, next_pow2, pdl_enter, pdl_meta, sigmoid
from .conv1d import conv_roll, conv_window
from .matmul import split_sum_kernel

OP = "gemv"
ACTS = {None: 0, "silu": 1, "relu2": 2}        # the ACT constexpr of the x load


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


@dataclass
class ResidualAdd:
    """The residual add after a projection, in its epilogue, with add_rms_norm's rounding points:
    stream[n] = stream[n] + (y[n]·multiplier rounded to y's dtype), and x[n] = stream[n] rounded to x's dtype (the
    next projection's input; it normalises x itself with `rms_eps`). Column n is read and written only by the
    program that computes y[n]."""
    stream: Tensor                 # [1, N] the residual stream (fp32 or the compute dtype), updated in place
    x: Tensor                      # [1, N] the stream rounded to the compute dtype, written
    multiplier: float = 1.0


@triton.jit
def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, K_SPLIT, stride_w_n,
                cw_ptr, cb_ptr, cbank_ptr, cslot_ptr, cout_ptr, c0, Dc, s_cw_d, s_cw_k, s_bank_s, s_bank_d, s_bank_k,
                eps, rs_ptr, rx_ptr, mult,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, ACT: tl.constexpr, CONV: tl.constexpr, KC: tl.constexpr, KW: tl.constexpr,
                HAS_CBIAS: tl.constexpr, RMS: tl.constexpr, RES: tl.constexpr, HAS_MULT: tl.constexpr,
                PDL: tl.constexpr, XB: tl.constexpr = False):
    """Grid (cdiv(N, BLOCK_N), SPLIT); program s reduces K in [s·K_SPLIT, (s+1)·K_SPLIT) (PARTIAL: fp32 at y[s]).
    Before the PDL wait (nothing read from x or written yet): the first weight tile and the conv window part.
    RMS (SPLIT 1): Σx² over the row, in every program in the same order, so all programs scale by the same bits.
    XB (a launch-rule key, benches): x loaded already broadcast over the columns in the weight tile's layout
    (gemv_rows' load: no per-tile layout conversion); the same products and sums (the same bits where K is a multiple
    of 16; otherwise the compiler may lay fp32 tiles out differently, changing the final sum's order), Σx² reduced
    per column."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ps = tl.program_id(1)
    mn = n < N
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if XB:
        ss = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
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
        cacc, c_last = conv_window(cw_ptr, cb_ptr, cbase, c, mc, ml, s_cw_d, s_cw_k, s_bank_k, KC, HAS_CBIAS)
    pdl_enter(PDL)
    for k in range(k_lo, k_hi - BLOCK_K, BLOCK_K):          # every tile but the last: a next tile exists
        kk = k + k0
        xv = _x_load(x_ptr, kk, K, k_hi, n, ACT, XB)
        wn = _w_tile(wrow, kk + BLOCK_K, k_hi, mn, EVEN_K)
        acc += _w_times_x(wv, xv, XB)
        if RMS:
            ss += xv * xv
        wv = wn
    kk = k_lo + ((k_hi - k_lo - 1) // BLOCK_K) * BLOCK_K + k0   # the last tile (wv holds it)
    xv = _x_load(x_ptr, kk, K, k_hi, n, ACT, XB)
    acc += _w_times_x(wv, xv, XB)
    if RMS:
        ss += xv * xv
        if XB:
            ssum = tl.sum(ss, axis=1)           # [BLOCK_N], every column the row's Σx²
        else:
            ssum = tl.sum(ss, axis=0)
        y = tl.sum(acc, axis=1) * (1.0 / tl.sqrt(ssum / K + eps))
    else:
        y = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(y_ptr + ps * N + n, y, mask=mn)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=mn, other=0.0).to(tl.float32)
        if RES:                     # add_rms_norm's residual add of the rounded output; y itself is not stored
            d = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            if HAS_MULT:
                d = (d * mult).to(y_ptr.dtype.element_ty).to(tl.float32)
            # loaded here, in the epilogue: earlier loads were slower (docs/kernels.md, "Launch rules")
            hs = tl.load(rs_ptr + n, mask=mn, other=0.0).to(tl.float32)
            hs = (hs + d).to(rs_ptr.dtype.element_ty)
            tl.store(rs_ptr + n, hs, mask=mn)
            tl.store(rx_ptr + n, hs.to(rx_ptr.dtype.element_ty), mask=mn)
        else:
            tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=mn)
        if CONV:                    # conv1d_step on the stored (rounded) outputs, same order of operations
            xq = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            cacc += c_last * xq
            cacc = cacc * (1.0 / (1.0 + tl.exp(-cacc)))
            tl.store(cout_ptr + c, tl.where(ml, cacc, 0.0).to(cout_ptr.dtype.element_ty), mask=mc)
            conv_roll(cbase, xq, ml, s_bank_k, KC, KW, cbase, s_bank_k, False)   # this program's columns only


@triton.jit
def _x_load(x_ptr, kk, K, k_hi, n, ACT: tl.constexpr, XB: tl.constexpr):
    """x[kk] in fp32 (act applied): [BLOCK_K], or with XB a [BLOCK_N, BLOCK_K] tile, every column the same row."""
    if XB:
        k2 = (n * 0)[:, None] + kk[None, :]
        xv = _x_tile(x_ptr, k2, K, k2 < k_hi, ACT)
    else:
        xv = _x_tile(x_ptr, kk, K, kk < k_hi, ACT)
    return xv


@triton.jit
def _w_times_x(wv, xv, XB: tl.constexpr):
    """The tile's products w[n, k] · x[k] in fp32."""
    if XB:
        p = wv.to(tl.float32) * xv
    else:
        p = wv.to(tl.float32) * xv[None, :]
    return p


@triton.jit
def _x_tile(x_ptr, kk, K, mask, ACT: tl.constexpr):
    """x[kk] in fp32; ACT 1 (silu) / 2 (relu2): act(x[kk]) · x[K + kk] with act_mul's rounding points."""
    if ACT == 0:
        return tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + K + kk, mask=mask, other=0.0).to(tl.float32)
    if ACT == 2:
        a = tl.maximum(g, 0.0)
        a = a * a
    else:
        a = g * sigmoid(g)
    a = a.to(x_ptr.dtype.element_ty).to(tl.float32)
    return (a * u).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _w_tile(wrow, kk, k_hi, mn, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns kk (zeros past k_hi unless EVEN_K says there are none)."""
    if EVEN_K:
        return tl.load(wrow + kk[None, :], mask=mn[:, None], other=0.0)
    return tl.load(wrow + kk[None, :], mask=mn[:, None] & (kk < k_hi)[None, :], other=0.0)


def gemv_launch_rule(N: int, K: int) -> dict:
    """Keyed on (N, K) only, so every call of a projection has the same bits: 4 rows per program, 1024-wide K
    tiles and 8 warps for K >= 4096; 2 rows, up to 512-wide tiles and 2 warps below. No K split (it never won;
    benches may set SPLIT). Chosen by timing: docs/kernels.md, "Launch rules"."""
    if K >= 4096:
        return dict(BLOCK_N=4, BLOCK_K=1024, SPLIT=1, num_warps=8, num_stages=3)
    return dict(BLOCK_N=2, BLOCK_K=min(512, next_pow2(K, 16)), SPLIT=1, num_warps=2, num_stages=1)


def interpreter_tile(N: int) -> dict:
    """CPU (the Triton interpreter): up to 256 rows per program. An interpreted program costs the same Python
    whatever its tile, and a row's sum does not depend on how many rows its program owns (each row accumulates its
    own BLOCK_K lanes, then sums them), so the bits are those of the GPU tile with 10-100x fewer programs."""
    return dict(BLOCK_N=min(256, next_pow2(N, 2)))


def _conv_args(conv: ConvStep | None, N: int, weight: Tensor) -> tuple[tuple, dict]:
    """Validate the conv epilogue; (its kernel arguments, its constexprs; unused pointers get `weight`)."""
    dev = weight.device
    if conv is None:
        return (weight,) * 5 + (0,) * 7, dict(CONV=False, KC=1, KW=1, HAS_CBIAS=False)
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
             *conv.bank.stride()), dict(CONV=True, KC=KC, KW=next_pow2(KC - 1), HAS_CBIAS=conv.bias is not None))


def _residual_args(res: ResidualAdd | None, N: int, weight: Tensor, split: int) -> tuple[tuple, dict]:
    """Validate the residual epilogue; (its kernel arguments, its constexprs)."""
    if res is None:
        return (weight, weight, 1.0), dict(RES=False, HAS_MULT=False)
    dev = weight.device
    check(OP, "residual.stream", res.stream, (1, N), FLOAT_DTYPES, dev)
    check(OP, "residual.x", res.x, (1, N), FLOAT_DTYPES, dev)
    if res.stream.stride(1) != 1 or res.x.stride(1) != 1:
        raise KernelInputError(f"{OP}: `residual.stream` and `residual.x` must be contiguous")
    if res.stream.data_ptr() == res.x.data_ptr():
        raise KernelInputError(f"{OP}: `residual.stream` and `residual.x` must be distinct buffers")
    if split != 1:
        raise KernelInputError(f"{OP}: the residual epilogue needs whole rows (SPLIT 1), got SPLIT={split}")
    m = float(res.multiplier)
    return (res.stream, res.x, m), dict(RES=True, HAS_MULT=m != 1.0)


def check_projection(op: str, x: Tensor, weight: Tensor, bias: Tensor | None, K: int) -> int:
    """Validate a projection's weight [N, K] and bias [N] against x (on x's device, last dims contiguous); N."""
    check(op, "weight", weight, (None, K), FLOAT_DTYPES, x.device)
    N = weight.shape[0]
    check(op, "bias", bias, (N,), FLOAT_DTYPES, x.device, optional=True)
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise KernelInputError(f"{op}: the last dims of `x`, `weight` and `bias` must be contiguous")
    return N


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
         rule: dict | None = None, act: str | None = None, conv: ConvStep | None = None,
         rms_eps: float | None = None, residual: ResidualAdd | None = None) -> Tensor:
    """x [1, K] · weight[N, K]ᵀ (+ bias [N]) -> [1, N] in x's dtype (rule: override the launch rule, benches).
    act: x is a gate_up row [1, 2K] and the product is act(gate)·up · weightᵀ; conv: the decode conv step of some
    output columns, in the epilogue (ConvStep); rms_eps: x is RMS-normalised first (gain folded into weight);
    residual: y is added to residual.stream and not stored, and residual.x is returned (ResidualAdd)."""
    if act not in ACTS:
        raise KernelInputError(f"{OP}: `act` is {act!r}, expected one of {list(ACTS)}")
    check(OP, "x", x, (1, None), FLOAT_DTYPES)
    K = x.shape[1]
    if act is not None:
        if K % 2:
            raise KernelInputError(f"{OP}: with act, `x` is [gate | up]; its last dim ({K}) must be even")
        K //= 2
    dev = x.device
    N = check_projection(OP, x, weight, bias, K)
    if out is None:          # with a residual, y is not stored: `out` only names its dtype (y is rounded to it)
        out = (residual.x if residual is not None and isinstance(residual.x, Tensor) and residual.x.dtype == x.dtype
               and tuple(residual.x.shape) == (1, N) else torch.empty(1, N, dtype=x.dtype, device=dev))
    check(OP, "out", out, (1, N), (x.dtype,), dev)
    if out.stride(1) != 1:
        raise KernelInputError(f"{OP}: `out` must be contiguous")
    if N == 0:
        return residual.x if residual is not None else out
    r = {**gemv_launch_rule(N, K), **(interpreter_tile(N) if dev.type == "cpu" else {}), **(rule or {})}
    bk = r["BLOCK_K"]
    cargs, cmeta = _conv_args(conv, N, weight)
    whole = conv is not None or rms_eps is not None or residual is not None   # epilogues that need whole rows
    split = 1 if whole else r["SPLIT"]
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_split)
    rargs, rmeta = _residual_args(residual, N, weight, split)
    if rms_eps is not None and not float(rms_eps) >= 0.0:
        raise KernelInputError(f"{OP}: `rms_eps` must be a number >= 0, got {rms_eps!r}")
    b_arg = bias if bias is not None else weight
    meta = dict(BLOCK_N=r["BLOCK_N"], BLOCK_K=bk, EVEN_K=K % bk == 0, ACT=ACTS[act], **cmeta, **rmeta,
                XB=bool(r.get("XB", False)), RMS=rms_eps is not None, num_warps=r["num_warps"],
                num_stages=r["num_stages"], **pdl_meta(dev))
    grid = (triton.cdiv(N, r["BLOCK_N"]), split)
    head = (x, weight, b_arg)
    tail = (N, K, k_split, weight.stride(0), *cargs, float(rms_eps or 0.0), *rargs)
    if split == 1:
        gemv_kernel[grid](*head, out, *tail, HAS_BIAS=bias is not None, PARTIAL=False, **meta)
    else:                                   # fixed split of K, partials summed in order (deterministic)
        part = torch.empty(split, N, dtype=torch.float32, device=dev)
        gemv_kernel[grid](*head, part, *tail, HAS_BIAS=False, PARTIAL=True, **meta)
        split_sum_kernel[(triton.cdiv(N, 1024),)](part, b_arg, out, N, N, SPLIT=split, HAS_BIAS=bias is not None,
                                                  BLOCK=1024)
    return residual.x if residual is not None else out
