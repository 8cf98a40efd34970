"""SSD stage 3: the chunk scan. Per chunk, head and P-tile:
    y_i = Σ_{j ≤ i in chunk} (C_i·B_j) exp(cs_i − cs_j) dt_j x_j  +  exp(cs_i) C_i · h_prev  +  D x_i
with h_prev the state entering the chunk (from the chunk-state stage), computed as a recurrence over sub-chunks
(ssd_chunk_scan_rec_kernel), C·B of each sub-chunk computed here."""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import mma


@triton.jit
def ssd_chunk_scan_rec_kernel(
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
    DOT_PREC: tl.constexpr, MASK_PN: tl.constexpr,
):
    """The chunk scan as a recurrence over sub-chunks of BLOCK_S tokens inside one program per (chunk, head,
    P-tile): the state h (fp32, starting at the chunk's entering state) gives each sub-chunk its inter term,
        y_i = exp(cs_i − cs_s) C_i · h  +  Σ_{s ≤ j ≤ i} (C_i·B_j) exp(cs_i − cs_j) dt_j x_j  +  D x_i,
    then advances, h ← exp(cs_e − cs_s) h + Σ_j exp(cs_e − cs_j) dt_j x_j ⊗ B_j (cs_s: log-decay before the
    sub-chunk, cs_e: at its last token). Every x, B, C row is read once per (chunk, head, P-tile) and the
    quadratic part shrinks to BLOCK_S × BLOCK_S blocks on the diagonal. BLOCK_N covers all of N.
    Few instructions a step: the pointers move to the program's corner once (64-bit), a step adds 32-bit in-chunk
    offsets (the launch checks they fit), whole sub-chunks load and store unmasked and only the chunk's partial
    last one masks rows; MASK_PN: columns past P or N are masked too (BLOCK_N > N or BLOCK_P not dividing P)."""
    n_pb = tl.cdiv(P, BLOCK_P)
    pid = tl.program_id(0)
    c = pid // (H * n_pb)
    h = ((pid // n_pb) % H).to(tl.int64)
    pb = pid % n_pb
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_s = tl.arange(0, BLOCK_S)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = pb * BLOCK_P + offs_p < P
    mn = offs_n < N
    x_ptr += start * stride_x_t + h * stride_x_h + pb * BLOCK_P * stride_x_p     # the program's corner, 64-bit
    y_ptr += start * stride_y_t + h * stride_y_h + pb * BLOCK_P * stride_y_p
    B_ptr += start * stride_b_t + g * stride_b_g
    C_ptr += start * stride_c_t + g * stride_c_g
    dt_ptr += h * stride_dt_h + start
    dacs_ptr += h * stride_dt_h + start
    state = tl.load(prev_ptr + c.to(tl.int64) * stride_prev_c + h * stride_prev_h
                    + (pb * BLOCK_P + offs_p)[:, None] * stride_prev_p + offs_n[None, :],
                    mask=mp[:, None] & mn[None, :], other=0.0).to(tl.float32)   # [BLOCK_P, BLOCK_N]
    d = 0.0
    if HAS_D:
        d = tl.load(D_ptr + h).to(tl.float32)
    cs_before = 0.0
    n_full = length - length % BLOCK_S
    for s0 in range(0, n_full, BLOCK_S):            # whole sub-chunks: no row masks
        state, cs_before = _rec_step(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, length, s0,
                                     offs_s, offs_p, offs_n, mp, mn, stride_x_t, stride_x_p, stride_b_t, stride_b_n,
                                     stride_c_t, stride_c_n, stride_y_t, stride_y_p, HAS_D, BLOCK_S, DOT_PREC,
                                     False, MASK_PN)
    if n_full < length:                             # the chunk's partial last sub-chunk
        state, cs_before = _rec_step(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, length,
                                     n_full, offs_s, offs_p, offs_n, mp, mn, stride_x_t, stride_x_p, stride_b_t,
                                     stride_b_n, stride_c_t, stride_c_n, stride_y_t, stride_y_p, HAS_D, BLOCK_S,
                                     DOT_PREC, True, MASK_PN)


@triton.jit
def _rec_step(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, length, s0, offs_s, offs_p, offs_n,
              mp, mn, stride_x_t, stride_x_p, stride_b_t, stride_b_n, stride_c_t, stride_c_n, stride_y_t, stride_y_p,
              HAS_D: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PREC: tl.constexpr, MASK_ROWS: tl.constexpr,
              MASK_PN: tl.constexpr):
    """One sub-chunk from `state` (fp32, entering it): stores its y rows and returns (state, cs) at its last token.
    Offsets are relative to the program's corner; MASK_ROWS: rows past the chunk's end read as 0, are not stored."""
    rows = s0 + offs_s
    ms = rows < length
    if MASK_ROWS:
        cs_end = tl.load(dacs_ptr + length - 1)
        cs = tl.load(dacs_ptr + rows, mask=ms, other=0.0)
        dt = tl.load(dt_ptr + rows, mask=ms, other=0.0)
    else:
        cs_end = tl.load(dacs_ptr + s0 + BLOCK_S - 1)
        cs = tl.load(dacs_ptr + rows)
        dt = tl.load(dt_ptr + rows)
    Cs = _tile(C_ptr + rows[:, None] * stride_c_t + offs_n[None, :] * stride_c_n, ms, mn, MASK_ROWS, MASK_PN)
    Bs = _tile(B_ptr + rows[:, None] * stride_b_t + offs_n[None, :] * stride_b_n, ms, mn, MASK_ROWS, MASK_PN)
    xs = _tile(x_ptr + rows[:, None] * stride_x_t + offs_p[None, :] * stride_x_p, ms, mp, MASK_ROWS, MASK_PN)
    cs_in, causal = sub_chunk_decay(cs, cs_before, ms, offs_s, MASK_ROWS)
    acc = inter_y(Cs, state, cs_in, DOT_PREC)
    cb = mma(Cs, tl.trans(Bs), DOT_PREC)
    acc = add_intra(acc, cb, cs, causal, dt, xs, d, HAS_D, DOT_PREC)
    _store_tile(y_ptr + rows[:, None] * stride_y_t + offs_p[None, :] * stride_y_p, acc.to(y_ptr.dtype.element_ty),
                ms, mp, MASK_ROWS, MASK_PN)
    if MASK_ROWS:
        ws = tl.where(ms, tl.exp(cs_end - cs) * dt, 0.0)
    else:
        ws = tl.exp(cs_end - cs) * dt
    return advance_state(state, xs, Bs, ws, cs_end, cs_before, DOT_PREC), cs_end


@triton.jit
def _tile(ptrs, ms, mc, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A [rows, cols] tile, masked (0 outside) only where asked: rows past the chunk's end, columns past P or N."""
    if MASK_ROWS and MASK_COLS:
        t = tl.load(ptrs, mask=ms[:, None] & mc[None, :], other=0.0)
    elif MASK_ROWS:
        t = tl.load(ptrs, mask=ms[:, None], other=0.0)
    elif MASK_COLS:
        t = tl.load(ptrs, mask=mc[None, :], other=0.0)
    else:
        t = tl.load(ptrs)
    return t


@triton.jit
def _store_tile(ptrs, val, ms, mc, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """_tile's store: only rows in the chunk (MASK_ROWS) and columns inside P or N (MASK_COLS) are written."""
    if MASK_ROWS and MASK_COLS:
        tl.store(ptrs, val, mask=ms[:, None] & mc[None, :])
    elif MASK_ROWS:
        tl.store(ptrs, val, mask=ms[:, None])
    elif MASK_COLS:
        tl.store(ptrs, val, mask=mc[None, :])
    else:
        tl.store(ptrs, val)


@triton.jit
def sub_chunk_decay(cs, cs_before, ms, offs_s, MASK_ROWS: tl.constexpr):
    """(cs − cs_s, the causal mask) of a sub-chunk; MASK_ROWS: rows past the chunk's end get 0 and no column."""
    if MASK_ROWS:
        cs_in = tl.where(ms, cs - cs_before, 0.0)                        # ≤ 0 on real rows
        causal = (offs_s[:, None] >= offs_s[None, :]) & ms[None, :]
    else:
        cs_in = cs - cs_before
        causal = offs_s[:, None] >= offs_s[None, :]
    return cs_in, causal


@triton.jit
def inter_y(Cs, state, cs_in, DOT_PREC: tl.constexpr):
    """A sub-chunk's inter term (fp32): exp(cs_i − cs_s) C_i·h from the entering state h, cs_in = cs − cs_s (0 on
    rows outside the chunk)."""
    return mma(Cs, tl.trans(state.to(Cs.dtype)), DOT_PREC) * tl.exp(cs_in)[:, None]


@triton.jit
def add_intra(acc, cb, cs, causal, dt, xs, d, HAS_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + Σ_{j ≤ i} (C_i·B_j) exp(cs_i − cs_j) dt_j x_j (+ D x_i): the causal intra-sub-chunk term from C·Bᵀ."""
    decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], float("-inf")))
    w = cb * decay * dt[None, :]
    acc += mma(w.to(xs.dtype), xs, DOT_PREC)
    if HAS_D:
        acc += d * xs.to(tl.float32)
    return acc


@triton.jit
def advance_state(state, xs, Bs, ws, cs_end, cs_before, DOT_PREC: tl.constexpr):
    """The state after a sub-chunk: h ← exp(cs_e − cs_s) h + Σ_j ws_j x_j ⊗ B_j, with ws_j = exp(cs_e − cs_j) dt_j
    (0 on rows outside the chunk); the x·ws product is rounded to B's dtype for the dot."""
    xw = (xs.to(tl.float32) * ws[:, None]).to(Bs.dtype)
    return tl.exp(cs_end - cs_before) * state + mma(tl.trans(xw), Bs, DOT_PREC)
