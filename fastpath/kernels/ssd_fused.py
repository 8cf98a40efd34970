"""Fused SSD prefill: dt processing, chunk state, state passing and chunk scan in one launch.

One program per (chunk, head) work item, taken in ticket order (an atomic counter, chunk-major: every head of
chunk c before any head of chunk c + 1), so a program only ever waits on an item that was handed out before
it, to a program that is already running (no deadlock whatever order the hardware starts programs in). The
program for chunk c of sequence s, head h:

1. processes its dt (softplus(dt + dt_bias), clamp) and the within-chunk log-decay cumsum, BLOCK_S tokens at
   a time (no [H, T] intermediates), or, PRE_DT (the launch rule's choice: faster on the H200), reads both from
   ssd_chunk_cumsum_kernel's outputs;
2. sums the chunk's own state from zero, S = Σ_j exp(cs_last − cs_j) dt_j x_j ⊗ B_j, as a recurrence over the
   BLOCK_S-token sub-chunks (fp32, P × N whole);
3. waits until the state entering chunk c is ready (a per-(sequence, head) counter reaches c − c0), reads it
   (fp32), writes exp(cs_last) · h_in + S as the state entering chunk c + 1 and bumps the counter. The state
   is carried in the sequence's own bank slot (it starts there when has_initial_state and must end there), or,
   for a slot −1 piece, in a scratch row: the carried states never go to a per-chunk array;
4. scans the chunk from h_in (fp32 in registers): per sub-chunk y = exp(cs_i − cs_s) C_i · h + the causal
   C·Bᵀ-weighted sum over the sub-chunk + D x, then h advances by the sub-chunk (as ssd_chunk_scan_rec_kernel,
   except that the entering state is not rounded to the inputs' dtype first).

The chain of step 3 is the only serial part (one hop per chunk); everything else runs in parallel over
chunks and heads. Sums are taken in one fixed order, so the result is bitwise the same on every run and does
not depend on the other sequences of the batch. Extra work items past the last chunk zero the bank slot of a
zero-length piece without an initial state (the unfused path writes its zero final state).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import softplus
from .ssd_chunk_scan import add_intra, advance_state, inter_y


@triton.jit
def _sub_dt(dt_ptr, dtp_ptr, dacs_ptr, h, start, s0, tok, ms, offs_s, length, dtb, a, cs_before, dt_lo, dt_hi,
            stride_dt_t, stride_dt_h, stride_dtp_h, HAS_BIAS: tl.constexpr, PRE_DT: tl.constexpr,
            BLOCK_S: tl.constexpr):
    """Processed dt of one sub-chunk (0 on masked rows), its log-decay cumsum within the chunk and that cumsum at
    the sub-chunk's last token: computed here from the raw dt (continued from cs_before), or, PRE_DT, read from
    ssd_chunk_cumsum_kernel's [H, T] outputs (the staged path's values)."""
    e = tl.minimum(length - s0, BLOCK_S) - 1
    if PRE_DT:
        dt = tl.load(dtp_ptr + h * stride_dtp_h + tok, mask=ms, other=0.0)
        cs = tl.load(dacs_ptr + h * stride_dtp_h + tok, mask=ms, other=0.0)
        cs_end = tl.load(dacs_ptr + h * stride_dtp_h + start + s0 + e)
    else:
        v = tl.load(dt_ptr + tok * stride_dt_t + h * stride_dt_h, mask=ms, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += dtb
        dt = softplus(v)
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        dt = tl.where(ms, dt, 0.0)
        cs = cs_before + tl.cumsum(dt * a, axis=0)
        cs_end = tl.sum(tl.where(offs_s == e, cs, 0.0), axis=0)
    return dt, cs, cs_end


@triton.jit
def ssd_fused_kernel(
    x_ptr, dt_ptr, dtp_ptr, dacs_ptr, dtb_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, bank_ptr, carry_ptr, sync_ptr, cb_ptr,
    seq_chunk_ptr, chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, slot_ptr, has_init_ptr, pad_idx_ptr, ckpt_ptr,
    n_chunks, H, P, N, heads_per_group, dt_lo, dt_hi,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h, stride_dtp_h,
    stride_b_t, stride_b_g, stride_b_n,
    stride_c_t, stride_c_g, stride_c_n,
    stride_y_t, stride_y_h, stride_y_p,
    stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n,
    stride_carry_s, stride_carry_h, stride_carry_p,
    stride_cb_c, stride_cb_g, stride_cb_i,
    HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_CKPT: tl.constexpr, USE_CB: tl.constexpr,
    USE_TICKET: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    PRE_DT: tl.constexpr = False, SKIP: tl.constexpr = 0, SCAN_STAGES: tl.constexpr = None,
):
    """1-D grid of n_chunks · H + n_seqs work items (see the module docstring); P and N are whole tiles.
    SKIP (timing only, wrong results): 1 no wait for the entering state, 2 no chunk-state sum, 3 no scan.
    SCAN_STAGES: the scan loop's pipeline depth (None: the launch's num_stages); see launch_ssd_fused."""
    if USE_TICKET:
        t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    else:
        t = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    mpn = mp[:, None] & mn[None, :]
    n_items = n_chunks * H
    if t >= n_items:
        # a zero-length piece without an initial state still leaves a zero final state in its slot
        s = t - n_items
        slot = tl.load(slot_ptr + s).to(tl.int64)
        init = tl.load(has_init_ptr + s)
        empty = tl.load(seq_chunk_ptr + s) == tl.load(seq_chunk_ptr + s + 1)
        if empty & (slot >= 0) & (init == 0):
            for hh in range(0, H):
                tl.store(bank_ptr + slot * stride_bank_s + hh * stride_bank_h + offs_p[:, None] * stride_bank_p
                         + offs_n[None, :] * stride_bank_n, tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32),
                         mask=mpn)
        return
    c = (t // H).to(tl.int64)
    h = (t % H).to(tl.int64)
    g = h // heads_per_group
    s = tl.load(chunk_seq_ptr + c).to(tl.int64)
    c0 = tl.load(seq_chunk_ptr + s)
    c1 = tl.load(seq_chunk_ptr + s + 1)
    j = c - c0
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    a = tl.load(A_ptr + h).to(tl.float32)
    dtb = 0.0
    if HAS_BIAS:
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
    offs_s = tl.arange(0, BLOCK_S)

    # (2) the chunk's own state from zero, sub-chunk by sub-chunk
    local = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    cs_before = 0.0
    for s0 in range(0, length if SKIP != 2 else 0, BLOCK_S):
        ms = (s0 + offs_s) < length
        tok = start + s0 + offs_s
        dt, cs, cs_end = _sub_dt(dt_ptr, dtp_ptr, dacs_ptr, h, start, s0, tok, ms, offs_s, length, dtb, a, cs_before,
                                 dt_lo, dt_hi, stride_dt_t, stride_dt_h, stride_dtp_h, HAS_BIAS, PRE_DT, BLOCK_S)
        xs = tl.load(x_ptr + tok[:, None] * stride_x_t + h * stride_x_h + offs_p[None, :] * stride_x_p,
                     mask=ms[:, None] & mp[None, :], other=0.0)
        Bs = tl.load(B_ptr + tok[:, None] * stride_b_t + g * stride_b_g + offs_n[None, :] * stride_b_n,
                     mask=ms[:, None] & mn[None, :], other=0.0)
        local = advance_state(local, xs, Bs, tl.where(ms, tl.exp(cs_end - cs) * dt, 0.0), cs_end, cs_before, DOT_PREC)
        cs_before = cs_end
    cs_last = cs_before
    if PRE_DT:
        cs_last = tl.load(dacs_ptr + h * stride_dtp_h + start + length - 1)

    # (3) state passing: h_in from the carrier (bank slot, or a scratch row for a slot -1 piece)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    has_init = tl.load(has_init_ptr + s) != 0
    # one scalar base and one int32 offset tile for the carrier (bank slot or scratch row): a second 64-bit
    # pointer tile alive across the wait spilled registers (H200: 255 registers, 50 spills before)
    pad_row = tl.load(pad_idx_ptr + s).to(tl.int64)
    banked = slot >= 0
    car = tl.where(banked, bank_ptr + slot * stride_bank_s + h * stride_bank_h,
                   carry_ptr + pad_row * stride_carry_s + h * stride_carry_h)
    car_off = offs_p[:, None] * tl.where(banked, stride_bank_p, stride_carry_p) \
        + offs_n[None, :] * tl.where(banked, stride_bank_n, 1)
    cnt_ptr = sync_ptr + 1 + s * H + h
    if (j > 0) & (SKIP != 1):
        cnt = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        while cnt < j:
            cnt = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    use_in = (j > 0) | (banked & has_init)
    h_in = tl.load(car + car_off, mask=tl.where(use_in, mpn, False), other=0.0, cache_modifier=".cg")
    if HAS_CKPT:
        ck = tl.load(ckpt_ptr + c).to(tl.int64)
        tl.store(bank_ptr + ck * stride_bank_s + h * stride_bank_h + offs_p[:, None] * stride_bank_p
                 + offs_n[None, :] * stride_bank_n, h_in, mask=tl.where(ck >= 0, mpn, False))
    h_out = tl.exp(cs_last) * h_in + local
    tl.store(car + car_off, h_out, mask=tl.where(banked | (c < c1 - 1), mpn, False))
    if c < c1 - 1:
        tl.debug_barrier()          # every thread's part of h_out is written before the counter moves
        tl.atomic_add(cnt_ptr, 1, sem="release")

    # (4) the chunk scan from h_in, in fp32 across sub-chunks
    state = h_in
    if HAS_D:
        d = tl.load(D_ptr + h).to(tl.float32)
    cs_before = 0.0
    for s0 in tl.range(0, length if SKIP != 3 else 0, BLOCK_S, num_stages=SCAN_STAGES):
        ms = (s0 + offs_s) < length
        tok = start + s0 + offs_s
        dt, cs, cs_end = _sub_dt(dt_ptr, dtp_ptr, dacs_ptr, h, start, s0, tok, ms, offs_s, length, dtb, a, cs_before,
                                 dt_lo, dt_hi, stride_dt_t, stride_dt_h, stride_dtp_h, HAS_BIAS, PRE_DT, BLOCK_S)
        Cs = tl.load(C_ptr + tok[:, None] * stride_c_t + g * stride_c_g + offs_n[None, :] * stride_c_n,
                     mask=ms[:, None] & mn[None, :], other=0.0)
        Bs = tl.load(B_ptr + tok[:, None] * stride_b_t + g * stride_b_g + offs_n[None, :] * stride_b_n,
                     mask=ms[:, None] & mn[None, :], other=0.0)
        xs = tl.load(x_ptr + tok[:, None] * stride_x_t + h * stride_x_h + offs_p[None, :] * stride_x_p,
                     mask=ms[:, None] & mp[None, :], other=0.0)
        cs_in = tl.where(ms, cs - cs_before, 0.0)                        # <= 0 on real rows
        acc = inter_y(Cs, state, cs_in, DOT_PREC)
        if USE_CB:
            cb = tl.load(cb_ptr + c * stride_cb_c + g * stride_cb_g + (s0 + offs_s)[:, None] * stride_cb_i
                         + (s0 + offs_s)[None, :], mask=ms[:, None] & ms[None, :], other=0.0)
        else:
            cb = tl.dot(Cs, tl.trans(Bs), input_precision=DOT_PREC)
        causal = (offs_s[:, None] >= offs_s[None, :]) & ms[None, :]
        acc = add_intra(acc, cb, cs, causal, dt, xs, d, HAS_D, DOT_PREC)
        tl.store(y_ptr + tok[:, None] * stride_y_t + h * stride_y_h + offs_p[None, :] * stride_y_p,
                 acc.to(y_ptr.dtype.element_ty), mask=ms[:, None] & mp[None, :])
        if s0 + BLOCK_S < length:        # the state after the last sub-chunk is h_out, already passed on
            ws = tl.where(ms, tl.exp(cs_end - cs) * dt, 0.0)
            state = advance_state(state, xs, Bs, ws, cs_end, cs_before, DOT_PREC)
        cs_before = cs_end


def scan_stages(block_s: int, use_cb: bool) -> int | None:
    """The scan loop's pipeline depth: 1 below 64-token sub-chunks with C·Bᵀ computed in the loop, else the launch's.
    There, with 2 stages, the loop gave wrong, unrepeatable y on an H100 (triton 3.6: rel 0.33 at 32-token
    sub-chunks, 4 or 8 warps) and was right with 1 (docs/kernels.md); 64-token sub-chunks compile the loop's dots
    differently (all warp-group MMAs) and were right pipelined."""
    return 1 if block_s < 64 and not use_cb else None


def launch_ssd_fused(x, dt, A, B, C, D, dt_bias, ssm_bank, out, table, slot, has_init, pad_index, n_pad,
                     dt_lo: float, dt_hi: float, cfg: dict, dot_prec: str, cb=None, dt_pre=None):
    """Launch ssd_fused_kernel over a validated batch (ssd.ssd_varlen validates and dispatches here).

    `table`: the batch's SSDChunkTable; `pad_index` [n_seqs] int: scratch row of each slot −1 piece; `n_pad`:
    scratch rows to allocate (≥ the number of slot −1 pieces); `cb`: per-chunk C·Bᵀ [nc, G, Q, Q] fp32 when
    cfg["use_cb"] (its BLOCK_S-diagonal blocks are read); `dt_pre`: (dt, dacs) [H, T] fp32 from
    ssd_chunk_cumsum_kernel when cfg["pre_dt"]. Returns the launched kernel handle (registers, spills: benches)."""
    import torch
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    n_seq = slot.shape[0]
    nc = table.n_chunks
    dev = x.device
    chunk_seq = table.chunk_seq
    if chunk_seq is None:
        chunk_seq = torch.searchsorted(table.seq_chunk_ptr[1:], torch.arange(nc, device=dev), right=True)
    carry = torch.empty(max(n_pad, 1), H, P, N, dtype=torch.float32, device=dev)
    sync = torch.zeros(1 + n_seq * H, dtype=torch.int32, device=dev)
    ck = table.ckpt_slot
    use_cb = cb is not None
    cbt = cb if use_cb else carry
    grid = (nc * H + n_seq,)
    if grid[0] == 0:
        return None
    dtp, dacs = dt_pre if dt_pre is not None else (dt, dt)
    return ssd_fused_kernel[grid](
        x, dt, dtp, dacs, dt_bias if dt_bias is not None else A, A, B, C, D if D is not None else A, out, ssm_bank, carry,
        sync, cbt, table.seq_chunk_ptr, table.chunk_start, table.chunk_len, chunk_seq, slot, has_init, pad_index,
        ck if ck is not None else slot,
        nc, H, P, N, H // G, dt_lo, dt_hi,
        *x.stride(), *dt.stride(), dtp.stride(0), *B.stride(), *C.stride(), *out.stride(), *ssm_bank.stride(),
        carry.stride(0), carry.stride(1), carry.stride(2),
        cbt.stride(0), cbt.stride(1), cbt.stride(2),
        HAS_BIAS=dt_bias is not None, HAS_D=D is not None, HAS_CKPT=ck is not None, USE_CB=use_cb,
        USE_TICKET=cfg.get("ticket", True), PRE_DT=dt_pre is not None, SKIP=cfg.get("skip", 0),
        SCAN_STAGES=scan_stages(cfg["BLOCK_S"], use_cb),
        BLOCK_S=cfg["BLOCK_S"], BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"], DOT_PREC=dot_prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
