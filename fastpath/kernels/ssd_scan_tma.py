"""SSD stage 4 through tensor descriptors: ssd_chunk_scan_rec_kernel's sub-chunk recurrence, the same sums in the
same order, with x, B and C read and y written as [BLOCK_S, ·] boxes of 2-D descriptors (on Hopper: TMA copies
into shared memory, no per-element address or mask arithmetic) instead of pointer tensors.

Whole sub-chunks run without row masks (B stays a shared-memory tile for both of its dots). The chunk's partial last
sub-chunk, whose box runs past the chunk into the next one, zeroes those rows of x and B before use (a NaN in another
sequence must not reach this one), lets rows of C there feed only y rows that are never written, and stores y with a
row mask instead of a box. The sums and their order are those of the masked step either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelInputError, reg_cap
from .ssd_chunk_scan import add_intra, advance_state, inter_y, sub_chunk_decay


@triton.jit
def ssd_scan_tma_kernel(
    x_desc, B_desc, C_desc, y_desc, y_ptr, dt_ptr, dacs_ptr, prev_ptr, D_ptr,
    chunk_start_ptr, chunk_len_ptr,
    H, P, N, heads_per_group,
    stride_dt_h,
    stride_prev_c, stride_prev_h, stride_prev_p,
    stride_y_t, stride_y_h,
    HAS_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """1-D grid over (chunk, head, P-tile), chunk slowest; x and y are [T, H·P] descriptors, B and C [T, G·N]."""
    n_pb = tl.cdiv(P, BLOCK_P)
    pid = tl.program_id(0)
    c = pid // (H * n_pb)
    h = (pid // n_pb) % H
    pb = pid % n_pb
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c)
    length = tl.load(chunk_len_ptr + c)
    offs_s = tl.arange(0, BLOCK_S)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    col_x = (h * P + pb * BLOCK_P).to(tl.int32)
    col_bc = (g * N).to(tl.int32)
    h64 = h.to(tl.int64)
    state = tl.load(prev_ptr + c.to(tl.int64) * stride_prev_c + h64 * stride_prev_h
                    + offs_p[:, None] * stride_prev_p + offs_n[None, :],
                    mask=mp[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)   # [BLOCK_P, BLOCK_N]
    d = 0.0
    if HAS_D:
        d = tl.load(D_ptr + h).to(tl.float32)
    cs_before = 0.0
    n_full = length - length % BLOCK_S
    for s0 in range(0, n_full, BLOCK_S):           # whole sub-chunks: no row masks, B stays a shared-memory tile
        state, cs_before = _step(x_desc, B_desc, C_desc, y_desc, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, start,
                                 length, s0, h64, col_x, col_bc, offs_s, offs_p, mp, stride_dt_h, stride_y_t,
                                 stride_y_h, HAS_D, BLOCK_S, DOT_PREC, True)
    if n_full < length:                            # the chunk's partial last sub-chunk
        state, cs_before = _step(x_desc, B_desc, C_desc, y_desc, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, start,
                                 length, n_full, h64, col_x, col_bc, offs_s, offs_p, mp, stride_dt_h, stride_y_t,
                                 stride_y_h, HAS_D, BLOCK_S, DOT_PREC, False)


@triton.jit
def _step(x_desc, B_desc, C_desc, y_desc, y_ptr, dt_ptr, dacs_ptr, state, cs_before, d, start, length, s0, h64, col_x,
          col_bc, offs_s, offs_p, mp, stride_dt_h, stride_y_t, stride_y_h, HAS_D: tl.constexpr,
          BLOCK_S: tl.constexpr, DOT_PREC: tl.constexpr, FULL: tl.constexpr):
    """One sub-chunk from `state` (fp32, entering it): stores its y rows and returns (state, cs) at its last token.
    FULL: every row of the box is in the chunk (no masks); else rows past the chunk's end are zeroed in x and B and
    left unstored in y."""
    row = (start + s0).to(tl.int32)                 # descriptor coordinates are rows and columns (int32)
    tok = row.to(tl.int64) + offs_s
    ms = (s0 + offs_s) < length
    if FULL:
        cs_end = tl.load(dacs_ptr + h64 * stride_dt_h + start + s0 + BLOCK_S - 1)
        cs = tl.load(dacs_ptr + h64 * stride_dt_h + tok)
        dt = tl.load(dt_ptr + h64 * stride_dt_h + tok)
        Bs = B_desc.load([row, col_bc])
        xs = x_desc.load([row, col_x])
    else:
        cs_end = tl.load(dacs_ptr + h64 * stride_dt_h + start + length - 1)
        cs = tl.load(dacs_ptr + h64 * stride_dt_h + tok, mask=ms, other=0.0)
        dt = tl.load(dt_ptr + h64 * stride_dt_h + tok, mask=ms, other=0.0)
        Bs = tl.where(ms[:, None], B_desc.load([row, col_bc]), 0.0)
        xs = tl.where(ms[:, None], x_desc.load([row, col_x]), 0.0)
    cs_in, causal = sub_chunk_decay(cs, cs_before, ms, offs_s, not FULL)
    Cs = C_desc.load([row, col_bc])
    acc = inter_y(Cs, state, cs_in, DOT_PREC)
    cb = tl.dot(Cs, tl.trans(Bs), input_precision=DOT_PREC)
    acc = add_intra(acc, cb, cs, causal, dt, xs, d, HAS_D, DOT_PREC)
    if FULL:
        y_desc.store([row, col_x], acc.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + tok[:, None] * stride_y_t + h64 * stride_y_h + offs_p[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=ms[:, None] & mp[None, :])
    if FULL:
        ws = tl.exp(cs_end - cs) * dt
    else:
        ws = tl.where(ms, tl.exp(cs_end - cs) * dt, 0.0)
    return advance_state(state, xs, Bs, ws, cs_end, cs_before, DOT_PREC), cs_end


def rows_2d(t: torch.Tensor, name: str, what: str = "scan kind 'rec_tma'") -> torch.Tensor:
    """[T, A, B] with a unit last stride and A's stride = B: the [T, A·B] view a descriptor reads (16-byte aligned
    row stride and base, as TMA needs); a clear error naming `name` otherwise."""
    T, A, Bd = t.shape
    es = t.element_size()
    if t.stride(2) != 1 or t.stride(1) != Bd or (t.stride(0) * es) % 16 or t.data_ptr() % 16:
        raise KernelInputError(f"ssd_varlen: {what} needs {name} rows of [{A}·{Bd}] contiguous with 16-byte "
                               f"aligned rows and base (strides {tuple(t.stride())})")
    return t.as_strided((T, A * Bd), (t.stride(0), 1))


def launch_ssd_scan_tma(x, B, C, dt_p, dacs, prev, D, A, out, table, cfg: dict, dot_prec: str):
    """Launch ssd_scan_tma_kernel over a validated batch (ssd.ssd_varlen dispatches here for scan kind "rec_tma").
    cfg: the launch rule's scan entry (BLOCK_S, BLOCK_P, BLOCK_N, num_warps, num_stages, optional maxnreg)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    bs, bp, bn = cfg["BLOCK_S"], cfg["BLOCK_P"], cfg["BLOCK_N"]
    if bn != N or P % bp:
        raise KernelInputError(f"ssd_varlen: scan kind 'rec_tma' needs BLOCK_N == N ({bn} vs {N}) and BLOCK_P "
                               f"dividing P ({bp} vs {P})")
    x2, y2 = rows_2d(x, "x"), rows_2d(out, "y")
    b2, c2 = rows_2d(B, "B"), rows_2d(C, "C")
    descs = (TensorDescriptor.from_tensor(x2, [bs, bp]), TensorDescriptor.from_tensor(b2, [bs, bn]),
             TensorDescriptor.from_tensor(c2, [bs, bn]), TensorDescriptor.from_tensor(y2, [bs, bp]))
    n_pb = P // bp
    return ssd_scan_tma_kernel[(table.n_chunks * H * n_pb,)](
        *descs, out, dt_p, dacs, prev, D if D is not None else A,
        table.chunk_start, table.chunk_len, H, P, N, H // G, dt_p.stride(0),
        prev.stride(0), prev.stride(1), prev.stride(2), out.stride(0), out.stride(1),
        HAS_D=D is not None, BLOCK_S=bs, BLOCK_P=bp, BLOCK_N=bn, DOT_PREC=dot_prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **reg_cap(cfg))
