"""SSD stage 4, two heads stacked: the sub-chunk recurrence of ssd_chunk_scan_rec_kernel for two heads of one group
in one program, their states stacked into one [2·BLOCK_P, N] tile (rows: head, then p). C and B are loaded once for
both heads, and each dot is one matrix product over the stack: C·hᵀ and the state update (M = 2·BLOCK_P), and the
intra term against x laid out block-diagonally over (head, token) × (head, p), whose off-diagonal block is zero
(or, SPLIT_INTRA, one product a head on x split off the stack). Every element's sum has rec's terms; the zero block
adds exact zeros.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import KernelInputError, reg_cap
from .ssd_chunk_scan import _store_tile, _tile


@triton.jit
def _by_head(hsel, a0, a1):
    """a0 where the (broadcast) head index `hsel` is 0, else a1."""
    return tl.where(hsel == 0, a0, a1)


@triton.jit
def _pair_step(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cb0, cb1, d_col, length, s0, offs_s, offs_n, hc,
               pc, mc, hk, jk, mn, stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_n, stride_c_t,
               stride_c_n, stride_y_t, stride_y_h, stride_y_p, stride_dt_h, HAS_D: tl.constexpr,
               DOT_PREC: tl.constexpr, MASK_ROWS: tl.constexpr, MASK_PN: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_P: tl.constexpr, SPLIT_INTRA: tl.constexpr):
    """One sub-chunk of both heads from the stacked `state` (fp32): stores y, returns (state, cs of each head).
    SPLIT_INTRA: the intra term as one [S, S] · [S, P] product a head (x split off the stack, the results joined
    back) instead of one product against the block-diagonal x."""
    rows = s0 + offs_s
    ms = rows < length
    krows = s0 + jk                                   # the intra product's K rows: (head, token)
    mk = krows < length
    if MASK_ROWS:
        last = length - 1
    else:
        last = s0 + BLOCK_S - 1
    ce0 = tl.load(dacs_ptr + last)
    ce1 = tl.load(dacs_ptr + stride_dt_h + last)
    cs0 = tl.load(dacs_ptr + rows, mask=ms, other=0.0)
    cs1 = tl.load(dacs_ptr + stride_dt_h + rows, mask=ms, other=0.0)
    dt0 = tl.load(dt_ptr + rows, mask=ms, other=0.0)
    dt1 = tl.load(dt_ptr + stride_dt_h + rows, mask=ms, other=0.0)
    Cs = _tile(C_ptr + rows[:, None] * stride_c_t + offs_n[None, :] * stride_c_n, ms, mn, MASK_ROWS, MASK_PN)
    Bs = _tile(B_ptr + rows[:, None] * stride_b_t + offs_n[None, :] * stride_b_n, ms, mn, MASK_ROWS, MASK_PN)
    col = hc * stride_x_h + pc * stride_x_p
    xs = _tile(x_ptr + rows[:, None] * stride_x_t + col[None, :], ms, mc, MASK_ROWS, MASK_PN)   # [S, 2P]
    # inter: exp(cs_i − cs_s) C_i·h per head's columns
    cs_in0 = cs0 - cb0
    cs_in1 = cs1 - cb1
    if MASK_ROWS:
        cs_in0 = tl.where(ms, cs_in0, 0.0)
        cs_in1 = tl.where(ms, cs_in1, 0.0)
    acc = tl.dot(Cs, tl.trans(state.to(Cs.dtype)), input_precision=DOT_PREC) * \
        tl.exp(_by_head(hc[None, :], cs_in0[:, None], cs_in1[:, None]))
    # intra: Σ_{j ≤ i} (C_i·B_j) exp(cs_i − cs_j) dt_j x_j, each head's columns over its own tokens
    if SPLIT_INTRA:
        cb = tl.dot(Cs, tl.trans(Bs), input_precision=DOT_PREC)                                # [S, S]
        causal = offs_s[:, None] >= offs_s[None, :]
        if MASK_ROWS:
            causal = causal & ms[None, :]
        w0 = cb * tl.exp(tl.where(causal, cs0[:, None] - cs0[None, :], float("-inf"))) * dt0[None, :]
        w1 = cb * tl.exp(tl.where(causal, cs1[:, None] - cs1[None, :], float("-inf"))) * dt1[None, :]
        x0, x1 = tl.split(tl.permute(tl.reshape(xs, (BLOCK_S, 2, BLOCK_P)), (0, 2, 1)))
        i0 = tl.dot(w0.to(xs.dtype), x0, input_precision=DOT_PREC)
        i1 = tl.dot(w1.to(xs.dtype), x1, input_precision=DOT_PREC)
        acc += tl.reshape(tl.permute(tl.join(i0, i1), (0, 2, 1)), (BLOCK_S, 2 * BLOCK_P))
    else:               # over the (head, token) stack against x's block diagonal: the other head's block adds zeros
        csk = tl.load(dacs_ptr + hk * stride_dt_h + krows, mask=mk, other=0.0)                 # [2S]
        dtk = tl.load(dt_ptr + hk * stride_dt_h + krows, mask=mk, other=0.0)
        B2 = _tile(B_ptr + krows[:, None] * stride_b_t + offs_n[None, :] * stride_b_n, mk, mn, MASK_ROWS, MASK_PN)
        xbd = tl.load(x_ptr + krows[:, None] * stride_x_t + col[None, :],                       # [2S, 2P]
                      mask=(hk[:, None] == hc[None, :]) & mk[:, None] & mc[None, :], other=0.0)
        cb2 = tl.dot(Cs, tl.trans(B2), input_precision=DOT_PREC)                               # [S, 2S]
        causal = offs_s[:, None] >= jk[None, :]
        if MASK_ROWS:
            causal = causal & mk[None, :]
        cs_i = _by_head(hk[None, :], cs0[:, None], cs1[:, None])
        w = cb2 * tl.exp(tl.where(causal, cs_i - csk[None, :], float("-inf"))) * dtk[None, :]
        acc += tl.dot(w.to(xs.dtype), xbd, input_precision=DOT_PREC)
    if HAS_D:
        acc += d_col[None, :] * xs.to(tl.float32)
    _store_tile(y_ptr + rows[:, None] * stride_y_t + (hc * stride_y_h + pc * stride_y_p)[None, :],
                acc.to(y_ptr.dtype.element_ty), ms, mc, MASK_ROWS, MASK_PN)
    # the state after the sub-chunk: h ← exp(cs_e − cs_s) h + Σ_j exp(cs_e − cs_j) dt_j x_j ⊗ B_j, per head's rows
    ws0 = tl.exp(ce0 - cs0) * dt0
    ws1 = tl.exp(ce1 - cs1) * dt1
    if MASK_ROWS:
        ws0 = tl.where(ms, ws0, 0.0)
        ws1 = tl.where(ms, ws1, 0.0)
    xw = (xs.to(tl.float32) * _by_head(hc[None, :], ws0[:, None], ws1[:, None])).to(Bs.dtype)
    decay = _by_head(hc, tl.exp(ce0 - cb0), tl.exp(ce1 - cb1))
    state = decay[:, None] * state + tl.dot(tl.trans(xw), Bs, input_precision=DOT_PREC)
    return state, ce0, ce1


@triton.jit
def ssd_scan_pair_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dacs_ptr, prev_ptr, D_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    H, P, N, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_b_t, stride_b_g, stride_b_n,
    stride_c_t, stride_c_g, stride_c_n,
    stride_dt_h,
    stride_prev_c, stride_prev_h, stride_prev_p,
    stride_y_t, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, MASK_PN: tl.constexpr, SPLIT_INTRA: tl.constexpr = False,
):
    """1-D grid over (chunk, head pair, P-tile), chunk slowest; heads_per_group even. Stacked columns (rows of the
    state) are (head of the pair, p of the P-tile); BLOCK_N covers all of N."""
    n_pb = tl.cdiv(P, BLOCK_P)
    pid = tl.program_id(0)
    c = pid // ((H // 2) * n_pb)
    h0 = ((pid // n_pb) % (H // 2)).to(tl.int64) * 2
    pb = pid % n_pb
    g = h0 // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, 2 * BLOCK_P)
    offs_k = tl.arange(0, 2 * BLOCK_S)
    offs_n = tl.arange(0, BLOCK_N)
    hc = offs_c // BLOCK_P                          # the head (0, 1) of a stacked column
    pc = pb * BLOCK_P + offs_c % BLOCK_P
    mc = pc < P
    hk = offs_k // BLOCK_S                          # the head of a stacked K row
    jk = offs_k % BLOCK_S
    mn = offs_n < N
    x_ptr += start * stride_x_t + h0 * stride_x_h
    y_ptr += start * stride_y_t + h0 * stride_y_h
    B_ptr += start * stride_b_t + g * stride_b_g
    C_ptr += start * stride_c_t + g * stride_c_g
    dt_ptr += h0 * stride_dt_h + start
    dacs_ptr += h0 * stride_dt_h + start
    state = tl.load(prev_ptr + c.to(tl.int64) * stride_prev_c + (h0 + hc)[:, None] * stride_prev_h
                    + pc[:, None] * stride_prev_p + offs_n[None, :],
                    mask=mc[:, None] & mn[None, :], other=0.0).to(tl.float32)     # [2·BLOCK_P, BLOCK_N]
    d_col = tl.zeros([2 * BLOCK_P], dtype=tl.float32)
    if HAS_D:
        d_col = tl.load(D_ptr + h0 + hc).to(tl.float32)
    cb0 = 0.0
    cb1 = 0.0
    n_full = length - length % BLOCK_S
    for s0 in range(0, n_full, BLOCK_S):            # whole sub-chunks: no row masks
        state, cb0, cb1 = _pair_step(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cb0, cb1, d_col, length,
                                     s0, offs_s, offs_n, hc, pc, mc, hk, jk, mn, stride_x_t, stride_x_h, stride_x_p,
                                     stride_b_t, stride_b_n, stride_c_t, stride_c_n, stride_y_t, stride_y_h,
                                     stride_y_p, stride_dt_h, HAS_D, DOT_PREC, False, MASK_PN, BLOCK_S,
                                     BLOCK_P, SPLIT_INTRA)
    if n_full < length:                             # the chunk's partial last sub-chunk
        state, cb0, cb1 = _pair_step(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cb0, cb1, d_col, length,
                                     n_full, offs_s, offs_n, hc, pc, mc, hk, jk, mn, stride_x_t, stride_x_h,
                                     stride_x_p, stride_b_t, stride_b_n, stride_c_t, stride_c_n, stride_y_t,
                                     stride_y_h, stride_y_p, stride_dt_h, HAS_D, DOT_PREC, True, MASK_PN, BLOCK_S,
                                     BLOCK_P, SPLIT_INTRA)


def launch_ssd_scan_pair(x, B, C, dt_p, dacs, prev, D, A, out, table, cfg: dict, dot_prec: str):
    """Launch ssd_scan_pair_kernel over a validated batch (ssd.ssd_varlen dispatches here for scan kind
    "rec_pair"). cfg: the launch rule's scan entry (BLOCK_S, BLOCK_P, BLOCK_N, num_warps, num_stages, optional
    maxnreg, split_intra). Returns the launched kernel handle (registers, spills: benches)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if (H // G) % 2:
        raise KernelInputError(f"ssd_varlen: scan kind 'rec_pair' needs an even number of heads a group ({H // G})")
    if cfg["BLOCK_N"] < N:
        raise KernelInputError(f"ssd_varlen: scan BLOCK_N={cfg['BLOCK_N']} must cover N={N}")
    n_pb = -(-P // cfg["BLOCK_P"])
    return ssd_scan_pair_kernel[(table.n_chunks * (H // 2) * n_pb,)](
        x, B, C, dt_p, dacs, prev, D if D is not None else A, out,
        table.chunk_start, table.chunk_len, H, P, N, H // G,
        *x.stride(), *B.stride(), *C.stride(), dt_p.stride(0),
        prev.stride(0), prev.stride(1), prev.stride(2), *out.stride(),
        HAS_D=D is not None, BLOCK_S=cfg["BLOCK_S"], BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"],
        DOT_PREC=dot_prec, MASK_PN=cfg["BLOCK_N"] != N or P % cfg["BLOCK_P"] != 0,
        SPLIT_INTRA=bool(cfg.get("split_intra", False)), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **reg_cap(cfg))
