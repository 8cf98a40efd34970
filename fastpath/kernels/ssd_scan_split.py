"""SSD stage 4 with fewer instructions a step: ssd_chunk_scan_rec_kernel's sub-chunk recurrence, the same sums in the
same order, with the address arithmetic and masks cut down. Each program offsets its pointers once (64-bit) to its
chunk, head and P-tile; a step then adds 32-bit in-chunk offsets. Whole sub-chunks run without any mask (BLOCK_N
covers N and BLOCK_P divides P, so no column mask either); only the chunk's partial last sub-chunk is row-masked.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import KernelInputError, reg_cap
from .ssd_chunk_scan import advance_state

_INT32_MAX = 2 ** 31 - 1


@triton.jit
def ssd_scan_split_kernel(
    x_ptr, B_ptr, C_ptr, dt_ptr, dacs_ptr, prev_ptr, D_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    H, heads_per_group,
    stride_x_t, stride_x_h, stride_b_t, stride_b_g, stride_c_t, stride_c_g, stride_dt_h,
    stride_prev_c, stride_prev_h, stride_prev_p, stride_y_t, stride_y_h,
    N_PB: tl.constexpr, HAS_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """1-D grid over (chunk, head, P-tile), chunk slowest; the last dims of x, B, C, y are unit-stride."""
    pid = tl.program_id(0)
    c = pid // (H * N_PB)
    h = ((pid // N_PB) % H).to(tl.int64)
    pb = pid % N_PB
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_s = tl.arange(0, BLOCK_S)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    x_ptr += start * stride_x_t + h * stride_x_h + pb * BLOCK_P       # the program's corner, once, in 64 bits
    y_ptr += start * stride_y_t + h * stride_y_h + pb * BLOCK_P
    B_ptr += start * stride_b_t + g * stride_b_g
    C_ptr += start * stride_c_t + g * stride_c_g
    dt_ptr += h * stride_dt_h + start
    dacs_ptr += h * stride_dt_h + start
    state = tl.load(prev_ptr + c.to(tl.int64) * stride_prev_c + h * stride_prev_h
                    + (pb * BLOCK_P + offs_p)[:, None] * stride_prev_p + offs_n[None, :]).to(tl.float32)
    d = 0.0
    if HAS_D:
        d = tl.load(D_ptr + h).to(tl.float32)
    cs_before = 0.0
    n_full = length - length % BLOCK_S
    for s0 in range(0, n_full, BLOCK_S):            # whole sub-chunks: no masks at all
        state, cs_before = _sub(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, length, s0,
                                offs_s, offs_p, offs_n, stride_x_t, stride_b_t, stride_c_t, stride_y_t,
                                HAS_D, BLOCK_S, DOT_PREC, True)
    if n_full < length:                             # the chunk's partial last sub-chunk
        state, cs_before = _sub(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, length, n_full,
                                offs_s, offs_p, offs_n, stride_x_t, stride_b_t, stride_c_t, stride_y_t,
                                HAS_D, BLOCK_S, DOT_PREC, False)


@triton.jit
def _sub(x_ptr, B_ptr, C_ptr, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, length, s0, offs_s, offs_p, offs_n,
         stride_x_t, stride_b_t, stride_c_t, stride_y_t, HAS_D: tl.constexpr, BLOCK_S: tl.constexpr,
         DOT_PREC: tl.constexpr, FULL: tl.constexpr):
    """One sub-chunk from `state` (fp32, entering it): stores its y rows and returns (state, cs) at its last token.
    Offsets are 32-bit and relative to the program's corner; FULL: every row is in the chunk (no masks)."""
    rows = s0 + offs_s
    if FULL:
        cs_end = tl.load(dacs_ptr + s0 + BLOCK_S - 1)
        cs = tl.load(dacs_ptr + rows)
        dt = tl.load(dt_ptr + rows)
        Cs = tl.load(C_ptr + rows[:, None] * stride_c_t + offs_n[None, :])
        Bs = tl.load(B_ptr + rows[:, None] * stride_b_t + offs_n[None, :])
        xs = tl.load(x_ptr + rows[:, None] * stride_x_t + offs_p[None, :])
        cs_in = cs - cs_before
        causal = offs_s[:, None] >= offs_s[None, :]
    else:
        ms = rows < length
        cs_end = tl.load(dacs_ptr + length - 1)
        cs = tl.load(dacs_ptr + rows, mask=ms, other=0.0)
        dt = tl.load(dt_ptr + rows, mask=ms, other=0.0)
        Cs = tl.load(C_ptr + rows[:, None] * stride_c_t + offs_n[None, :], mask=ms[:, None], other=0.0)
        Bs = tl.load(B_ptr + rows[:, None] * stride_b_t + offs_n[None, :], mask=ms[:, None], other=0.0)
        xs = tl.load(x_ptr + rows[:, None] * stride_x_t + offs_p[None, :], mask=ms[:, None], other=0.0)
        cs_in = tl.where(ms, cs - cs_before, 0.0)                        # ≤ 0 on real rows
        causal = (offs_s[:, None] >= offs_s[None, :]) & ms[None, :]
    acc = tl.dot(Cs, tl.trans(state.to(Cs.dtype)), input_precision=DOT_PREC) * tl.exp(cs_in)[:, None]
    cb = tl.dot(Cs, tl.trans(Bs), input_precision=DOT_PREC)
    decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], float("-inf")))
    w = cb * decay * dt[None, :]
    acc += tl.dot(w.to(xs.dtype), xs, input_precision=DOT_PREC)
    if HAS_D:
        acc += d * xs.to(tl.float32)
    y_rows = y_ptr + rows[:, None] * stride_y_t + offs_p[None, :]
    if FULL:
        tl.store(y_rows, acc.to(y_ptr.dtype.element_ty))
        ws = tl.exp(cs_end - cs) * dt
    else:
        tl.store(y_rows, acc.to(y_ptr.dtype.element_ty), mask=ms[:, None])
        ws = tl.where(ms, tl.exp(cs_end - cs) * dt, 0.0)
    return advance_state(state, xs, Bs, ws, cs_end, cs_before, DOT_PREC), cs_end


def launch_ssd_scan_split(x, B, C, dt_p, dacs, prev, D, A, out, table, cfg: dict, chunk_size: int, dot_prec: str):
    """Launch ssd_scan_split_kernel over a validated batch (ssd.ssd_varlen dispatches here for scan kind
    "rec_split"). cfg: the launch rule's scan entry (BLOCK_S, BLOCK_P, BLOCK_N, num_warps, num_stages, maxnreg)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    bs, bp, bn = cfg["BLOCK_S"], cfg["BLOCK_P"], cfg["BLOCK_N"]
    if bn != N or P % bp:
        raise KernelInputError(f"ssd_varlen: scan kind 'rec_split' needs BLOCK_N == N ({bn} vs {N}) and BLOCK_P "
                               f"dividing P ({bp} vs {P})")
    for name, t in (("x", x), ("B", B), ("C", C), ("y", out)):
        if t.stride(2) != 1:
            raise KernelInputError(f"ssd_varlen: scan kind 'rec_split' needs {name}'s last dim unit-stride "
                                   f"(strides {tuple(t.stride())})")
        if (chunk_size + bs) * t.stride(0) + t.shape[2] > _INT32_MAX:
            raise KernelInputError(f"ssd_varlen: scan kind 'rec_split': {name}'s in-chunk offsets overflow 32 bits "
                                   f"(row stride {t.stride(0)})")
    return ssd_scan_split_kernel[(table.n_chunks * H * (P // bp),)](
        x, B, C, dt_p, dacs, prev, D if D is not None else A, out,
        table.chunk_start, table.chunk_len, H, H // G,
        x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1), dt_p.stride(0),
        prev.stride(0), prev.stride(1), prev.stride(2), out.stride(0), out.stride(1),
        N_PB=P // bp, HAS_D=D is not None, BLOCK_S=bs, BLOCK_P=bp, BLOCK_N=bn, DOT_PREC=dot_prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **reg_cap(cfg))
