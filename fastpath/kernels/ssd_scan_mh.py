"""SSD stage 4, multi-head: the sub-chunk recurrence of ssd_chunk_scan_rec_kernel with HEADS heads of one group
per program. C, B and the diagonal C·Bᵀ block of every sub-chunk are head-independent inside a group (only the
decay mask and dt differ), so the program loads and multiplies them once for all its heads; each head keeps its
own fp32 state and runs the same sums, in the same order, as the one-head kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import KernelInputError, reg_cap
from .ssd_chunk_scan import add_intra, advance_state, inter_y


@triton.jit
def _head_sub(state, cs_before, Cs, Bs, cb, causal, ms, tok, last, hh, x_ptr, dt_ptr, dacs_ptr, y_ptr, d,
              offs_p, mp, stride_x_t, stride_x_h, stride_x_p, stride_dt_h, stride_y_t, stride_y_h, stride_y_p,
              HAS_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """One head's sub-chunk: stores its y rows (inter + causal intra + D x), returns (state, cs) at its last token."""
    cs_end = tl.load(dacs_ptr + hh * stride_dt_h + last)
    cs = tl.load(dacs_ptr + hh * stride_dt_h + tok, mask=ms, other=0.0)
    dt = tl.load(dt_ptr + hh * stride_dt_h + tok, mask=ms, other=0.0)
    xs = tl.load(x_ptr + tok[:, None] * stride_x_t + hh * stride_x_h + offs_p[None, :] * stride_x_p,
                 mask=ms[:, None] & mp[None, :], other=0.0)
    cs_in = tl.where(ms, cs - cs_before, 0.0)                            # ≤ 0 on real rows
    acc = add_intra(inter_y(Cs, state, cs_in, DOT_PREC), cb, cs, causal, dt, xs, d, HAS_D, DOT_PREC)
    tl.store(y_ptr + tok[:, None] * stride_y_t + hh * stride_y_h + offs_p[None, :] * stride_y_p,
             acc.to(y_ptr.dtype.element_ty), mask=ms[:, None] & mp[None, :])
    ws = tl.where(ms, tl.exp(cs_end - cs) * dt, 0.0)
    return advance_state(state, xs, Bs, ws, cs_end, cs_before, DOT_PREC), cs_end


@triton.jit
def _head_init(prev_ptr, D_ptr, c, hh, offs_p, offs_n, mp, mn, stride_prev_c, stride_prev_h, stride_prev_p,
               HAS_D: tl.constexpr):
    """A head's state entering the chunk (fp32) and its D (0 without D)."""
    state = tl.load(prev_ptr + c * stride_prev_c + hh * stride_prev_h + offs_p[:, None] * stride_prev_p
                    + offs_n[None, :], mask=mp[:, None] & mn[None, :], other=0.0).to(tl.float32)
    d = 0.0
    if HAS_D:
        d = tl.load(D_ptr + hh).to(tl.float32)
    return state, d


@triton.jit
def ssd_chunk_scan_mh_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dacs_ptr, prev_ptr, D_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    H, P, N, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_b_t, stride_b_g, stride_b_n,
    stride_c_t, stride_c_g, stride_c_n,
    stride_dt_h,
    stride_prev_c, stride_prev_h, stride_prev_p,
    stride_y_t, stride_y_h, stride_y_p,
    HEADS: tl.constexpr, HAS_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """1-D grid over (chunk, head block of HEADS, P-tile), chunk slowest. HEADS is 1, 2 or 4 and divides
    heads_per_group; per head the recurrence of ssd_chunk_scan_rec_kernel (BLOCK_N covers all of N)."""
    n_pb = tl.cdiv(P, BLOCK_P)
    n_hb = H // HEADS
    pid = tl.program_id(0)
    c = (pid // (n_hb * n_pb)).to(tl.int64)
    h0 = ((pid // n_pb) % n_hb).to(tl.int64) * HEADS
    pb = pid % n_pb
    g = h0 // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_s = tl.arange(0, BLOCK_S)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    st0, d0 = _head_init(prev_ptr, D_ptr, c, h0, offs_p, offs_n, mp, mn, stride_prev_c, stride_prev_h,
                         stride_prev_p, HAS_D)
    cb0 = 0.0
    if HEADS >= 2:
        st1, d1 = _head_init(prev_ptr, D_ptr, c, h0 + 1, offs_p, offs_n, mp, mn, stride_prev_c, stride_prev_h,
                             stride_prev_p, HAS_D)
        cb1 = 0.0
    if HEADS >= 4:
        st2, d2 = _head_init(prev_ptr, D_ptr, c, h0 + 2, offs_p, offs_n, mp, mn, stride_prev_c, stride_prev_h,
                             stride_prev_p, HAS_D)
        st3, d3 = _head_init(prev_ptr, D_ptr, c, h0 + 3, offs_p, offs_n, mp, mn, stride_prev_c, stride_prev_h,
                             stride_prev_p, HAS_D)
        cb2 = 0.0
        cb3 = 0.0
    for s0 in range(0, length, BLOCK_S):
        ms = (s0 + offs_s) < length
        tok = start + s0 + offs_s
        last = start + tl.minimum(length, s0 + BLOCK_S) - 1
        Cs = tl.load(C_ptr + tok[:, None] * stride_c_t + g * stride_c_g + offs_n[None, :] * stride_c_n,
                     mask=ms[:, None] & mn[None, :], other=0.0)
        Bs = tl.load(B_ptr + tok[:, None] * stride_b_t + g * stride_b_g + offs_n[None, :] * stride_b_n,
                     mask=ms[:, None] & mn[None, :], other=0.0)
        cb = tl.dot(Cs, tl.trans(Bs), input_precision=DOT_PREC)          # once for all HEADS heads
        causal = (offs_s[:, None] >= offs_s[None, :]) & ms[None, :]
        st0, cb0 = _head_sub(st0, cb0, Cs, Bs, cb, causal, ms, tok, last, h0, x_ptr, dt_ptr, dacs_ptr, y_ptr, d0,
                             offs_p, mp, stride_x_t, stride_x_h, stride_x_p, stride_dt_h, stride_y_t, stride_y_h,
                             stride_y_p, HAS_D, DOT_PREC)
        if HEADS >= 2:
            st1, cb1 = _head_sub(st1, cb1, Cs, Bs, cb, causal, ms, tok, last, h0 + 1, x_ptr, dt_ptr, dacs_ptr,
                                 y_ptr, d1, offs_p, mp, stride_x_t, stride_x_h, stride_x_p, stride_dt_h, stride_y_t,
                                 stride_y_h, stride_y_p, HAS_D, DOT_PREC)
        if HEADS >= 4:
            st2, cb2 = _head_sub(st2, cb2, Cs, Bs, cb, causal, ms, tok, last, h0 + 2, x_ptr, dt_ptr, dacs_ptr,
                                 y_ptr, d2, offs_p, mp, stride_x_t, stride_x_h, stride_x_p, stride_dt_h, stride_y_t,
                                 stride_y_h, stride_y_p, HAS_D, DOT_PREC)
            st3, cb3 = _head_sub(st3, cb3, Cs, Bs, cb, causal, ms, tok, last, h0 + 3, x_ptr, dt_ptr, dacs_ptr,
                                 y_ptr, d3, offs_p, mp, stride_x_t, stride_x_h, stride_x_p, stride_dt_h, stride_y_t,
                                 stride_y_h, stride_y_p, HAS_D, DOT_PREC)


def heads_per_program(want: int, heads_per_group: int) -> int:
    """The largest of 4, 2, 1 that is ≤ `want` and divides the group's heads (a block never spans two groups)."""
    return next(k for k in (4, 2, 1) if k <= want and heads_per_group % k == 0)


def launch_ssd_scan_mh(x, B, C, dt_p, dacs, prev, D, A, out, table, cfg: dict, dot_prec: str):
    """Launch ssd_chunk_scan_mh_kernel over a validated batch (ssd.ssd_varlen dispatches here). cfg: the launch
    rule's scan entry (HEADS, BLOCK_S, BLOCK_P, BLOCK_N, num_warps, num_stages, optional maxnreg). Returns the
    launched kernel handle (registers, spills: benches)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    heads = heads_per_program(int(cfg.get("HEADS", 1)), H // G)
    if cfg["BLOCK_N"] < N or cfg["BLOCK_S"] < 1:
        raise KernelInputError(f"ssd_varlen: scan BLOCK_N={cfg['BLOCK_N']} must cover N={N}")
    nc = table.n_chunks
    n_pb = -(-P // cfg["BLOCK_P"])
    return ssd_chunk_scan_mh_kernel[(nc * (H // heads) * n_pb,)](
        x, B, C, dt_p, dacs, prev, D if D is not None else A, out,
        table.chunk_start, table.chunk_len, H, P, N, H // G,
        *x.stride(), *B.stride(), *C.stride(), dt_p.stride(0),
        prev.stride(0), prev.stride(1), prev.stride(2), *out.stride(),
        HEADS=heads, HAS_D=D is not None, BLOCK_S=cfg["BLOCK_S"], BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"],
        DOT_PREC=dot_prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **reg_cap(cfg))
