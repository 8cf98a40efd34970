"""SSD stage 4, blocked and multi-head: the row × column block scan of ssd_chunk_scan_kernel with HEADS heads of
one group per program. Per (row block, column block) the C·Bᵀ tile is head-independent inside a group, so it is
computed once and weighted by each head's decay and dt; no state is carried inside the chunk (the entering state
comes from the chunk-state stage), so a program holds only its heads' [BLOCK_M, P] accumulators.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import reg_cap
from .ssd_scan_mh import heads_per_program


@triton.jit
def _blk_init(Cm, prev_ptr, dacs_ptr, c, hh, tok_m, mm, offs_p, offs_n, mp, mn, stride_dt_h, stride_prev_c,
              stride_prev_h, stride_prev_p, DOT_PREC: tl.constexpr):
    """A head's inter-chunk term exp(cs_i) C_i · h_prev for the row block, and its log-decays cs_i."""
    cs_m = tl.load(dacs_ptr + hh * stride_dt_h + tok_m, mask=mm, other=0.0)
    prev = tl.load(prev_ptr + c * stride_prev_c + hh * stride_prev_h + offs_p[None, :] * stride_prev_p
                   + offs_n[:, None], mask=mn[:, None] & mp[None, :], other=0.0)          # [BLOCK_N, BLOCK_P]
    acc = tl.dot(Cm, prev.to(Cm.dtype), input_precision=DOT_PREC) * tl.exp(cs_m)[:, None]
    return acc, cs_m


@triton.jit
def _blk_step(acc, cs_m, cb, causal, hh, tok_k, mk, x_ptr, dt_ptr, dacs_ptr, offs_p, mp, stride_x_t, stride_x_h,
              stride_x_p, stride_dt_h, DOT_PREC: tl.constexpr):
    """acc += (C·Bᵀ ∘ exp(cs_i − cs_j) ∘ dt_j, causal) x_j over one column block, for one head."""
    cs_k = tl.load(dacs_ptr + hh * stride_dt_h + tok_k, mask=mk, other=0.0)
    dt_k = tl.load(dt_ptr + hh * stride_dt_h + tok_k, mask=mk, other=0.0)
    decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
    w = cb * decay * dt_k[None, :]
    xk = tl.load(x_ptr + tok_k[:, None] * stride_x_t + hh * stride_x_h + offs_p[None, :] * stride_x_p,
                 mask=mk[:, None] & mp[None, :], other=0.0)
    return acc + tl.dot(w.to(xk.dtype), xk, input_precision=DOT_PREC)


@triton.jit
def _blk_store(acc, hh, tok_m, mm, x_ptr, D_ptr, y_ptr, offs_p, mp, stride_x_t, stride_x_h, stride_x_p,
               stride_y_t, stride_y_h, stride_y_p, HAS_D: tl.constexpr):
    """y rows of one head: acc + D x."""
    if HAS_D:
        xm = tl.load(x_ptr + tok_m[:, None] * stride_x_t + hh * stride_x_h + offs_p[None, :] * stride_x_p,
                     mask=mm[:, None] & mp[None, :], other=0.0)
        acc += tl.load(D_ptr + hh).to(tl.float32) * xm.to(tl.float32)
    tl.store(y_ptr + tok_m[:, None] * stride_y_t + hh * stride_y_h + offs_p[None, :] * stride_y_p,
             acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mp[None, :])


@triton.jit
def ssd_chunk_scan_blk_mh_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dacs_ptr, prev_ptr, D_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    H, P, N, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_b_t, stride_b_g, stride_b_n,
    stride_c_t, stride_c_g, stride_c_n,
    stride_dt_h,
    stride_prev_c, stride_prev_h, stride_prev_p,
    stride_y_t, stride_y_h, stride_y_p,
    HEADS: tl.constexpr, HAS_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """1-D grid over (chunk, head block of HEADS, row block, P-tile), chunk slowest, row blocks of a head block
    side by side (they share its x in L2). HEADS is 1, 2 or 4 and divides heads_per_group; BLOCK_N covers N."""
    n_pb = tl.cdiv(P, BLOCK_P)
    n_mb = BLOCK_Q // BLOCK_M
    n_hb = H // HEADS
    pid = tl.program_id(0)
    c = (pid // (n_hb * n_mb * n_pb)).to(tl.int64)
    h0 = ((pid // (n_mb * n_pb)) % n_hb).to(tl.int64) * HEADS
    mb = (pid // n_pb) % n_mb
    pb = pid % n_pb
    g = h0 // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mm = offs_m < length
    mp = offs_p < P
    mn = offs_n < N
    tok_m = start + offs_m
    Cm = tl.load(C_ptr + tok_m[:, None] * stride_c_t + g * stride_c_g + offs_n[None, :] * stride_c_n,
                 mask=mm[:, None] & mn[None, :], other=0.0)
    a0, cs0 = _blk_init(Cm, prev_ptr, dacs_ptr, c, h0, tok_m, mm, offs_p, offs_n, mp, mn, stride_dt_h,
                        stride_prev_c, stride_prev_h, stride_prev_p, DOT_PREC)
    if HEADS >= 2:
        a1, cs1 = _blk_init(Cm, prev_ptr, dacs_ptr, c, h0 + 1, tok_m, mm, offs_p, offs_n, mp, mn, stride_dt_h,
                            stride_prev_c, stride_prev_h, stride_prev_p, DOT_PREC)
    if HEADS >= 4:
        a2, cs2 = _blk_init(Cm, prev_ptr, dacs_ptr, c, h0 + 2, tok_m, mm, offs_p, offs_n, mp, mn, stride_dt_h,
                            stride_prev_c, stride_prev_h, stride_prev_p, DOT_PREC)
        a3, cs3 = _blk_init(Cm, prev_ptr, dacs_ptr, c, h0 + 3, tok_m, mm, offs_p, offs_n, mp, mn, stride_dt_h,
                            stride_prev_c, stride_prev_h, stride_prev_p, DOT_PREC)
    hi = tl.where(mb * BLOCK_M < length, tl.minimum(length, (mb + 1) * BLOCK_M), 0)   # rows past the piece: none
    for k0 in range(0, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < hi
        tok_k = start + offs_k
        Bk = tl.load(B_ptr + tok_k[:, None] * stride_b_t + g * stride_b_g + offs_n[None, :] * stride_b_n,
                     mask=mk[:, None] & mn[None, :], other=0.0)
        cb = tl.dot(Cm, tl.trans(Bk), input_precision=DOT_PREC)         # once for all HEADS heads
        causal = (offs_m[:, None] >= offs_k[None, :]) & mk[None, :]
        a0 = _blk_step(a0, cs0, cb, causal, h0, tok_k, mk, x_ptr, dt_ptr, dacs_ptr, offs_p, mp, stride_x_t,
                       stride_x_h, stride_x_p, stride_dt_h, DOT_PREC)
        if HEADS >= 2:
            a1 = _blk_step(a1, cs1, cb, causal, h0 + 1, tok_k, mk, x_ptr, dt_ptr, dacs_ptr, offs_p, mp, stride_x_t,
                           stride_x_h, stride_x_p, stride_dt_h, DOT_PREC)
        if HEADS >= 4:
            a2 = _blk_step(a2, cs2, cb, causal, h0 + 2, tok_k, mk, x_ptr, dt_ptr, dacs_ptr, offs_p, mp, stride_x_t,
                           stride_x_h, stride_x_p, stride_dt_h, DOT_PREC)
            a3 = _blk_step(a3, cs3, cb, causal, h0 + 3, tok_k, mk, x_ptr, dt_ptr, dacs_ptr, offs_p, mp, stride_x_t,
                           stride_x_h, stride_x_p, stride_dt_h, DOT_PREC)
    _blk_store(a0, h0, tok_m, mm, x_ptr, D_ptr, y_ptr, offs_p, mp, stride_x_t, stride_x_h, stride_x_p,
               stride_y_t, stride_y_h, stride_y_p, HAS_D)
    if HEADS >= 2:
        _blk_store(a1, h0 + 1, tok_m, mm, x_ptr, D_ptr, y_ptr, offs_p, mp, stride_x_t, stride_x_h, stride_x_p,
                   stride_y_t, stride_y_h, stride_y_p, HAS_D)
    if HEADS >= 4:
        _blk_store(a2, h0 + 2, tok_m, mm, x_ptr, D_ptr, y_ptr, offs_p, mp, stride_x_t, stride_x_h, stride_x_p,
                   stride_y_t, stride_y_h, stride_y_p, HAS_D)
        _blk_store(a3, h0 + 3, tok_m, mm, x_ptr, D_ptr, y_ptr, offs_p, mp, stride_x_t, stride_x_h, stride_x_p,
                   stride_y_t, stride_y_h, stride_y_p, HAS_D)


def launch_ssd_scan_blk_mh(x, B, C, dt_p, dacs, prev, D, A, out, table, cfg: dict, block_q: int, dot_prec: str):
    """Launch ssd_chunk_scan_blk_mh_kernel over a validated batch (ssd.ssd_varlen dispatches here). cfg: the launch
    rule's scan entry (HEADS, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N, num_warps, num_stages, optional maxnreg); block_q:
    the chunk rounded up to a power of two (a multiple of BLOCK_M). Returns the launched kernel handle."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    heads = heads_per_program(int(cfg.get("HEADS", 1)), H // G)
    n_tiles = (block_q // cfg["BLOCK_M"]) * -(-P // cfg["BLOCK_P"])
    return ssd_chunk_scan_blk_mh_kernel[(table.n_chunks * (H // heads) * n_tiles,)](
        x, B, C, dt_p, dacs, prev, D if D is not None else A, out,
        table.chunk_start, table.chunk_len, H, P, N, H // G,
        *x.stride(), *B.stride(), *C.stride(), dt_p.stride(0),
        prev.stride(0), prev.stride(1), prev.stride(2), *out.stride(),
        HEADS=heads, HAS_D=D is not None, BLOCK_Q=block_q, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"], DOT_PREC=dot_prec, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **reg_cap(cfg))
