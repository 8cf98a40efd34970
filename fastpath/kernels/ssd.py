"""Varlen SSD prefill over the state bank (mirrors oracle/ssd.py: ssd_chunked).

Packed tokens of several sequences (cu_seqlens). Sequence s starts at absolute position start_pos[s],
reads its initial state from ssm_bank[slot[s]] when has_initial_state[s] (zeros otherwise) and writes its
final state back to ssm_bank[slot[s]] (slot -1: no bank read or write; its outputs are still computed, from a
zero state). Chunks are cut at absolute multiples of chunk_size, so a continuation piece starting mid-chunk
first finishes that chunk. dt processing (softplus(dt + dt_bias), clamp to dt_limit) happens inside; the z
gate is *not* applied here (the gated norm does it). fp32 accumulation, fp32 states.

One path, three kernels, one launch each (the numbered stages of `ssd_varlen`):
    1 cumsum       ssd_chunk_cumsum.py  dt processed and the within-chunk cumulative log-decay, [H, T] fp32
    2 chunk state  ssd_chunk_state.py   one walker per (sequence, head, P-tile, N-tile) carries the fp32 state
                                        through the sequence's chunks: the state entering each chunk (for the
                                        scan), checkpoints, the final state to the bank
    3 scan         ssd_chunk_scan.py    per (chunk, head, P-tile) a recurrence over sub-chunks of BLOCK_S tokens
The variants timed against this path and removed are listed in docs/kernels.md ("SSD: variants removed").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import (FLOAT_DTYPES, INDEX_DTYPES, KernelInputError, check, check_slots, dot_precision,
                      dt_limits, host_ints, next_pow2)
from .ssd_chunk_cumsum import ssd_chunk_cumsum_kernel
from .ssd_chunk_scan import ssd_chunk_scan_rec_kernel
from .ssd_chunk_state import ssd_chunk_state_kernel

OP = "ssd_varlen"
STAGES = ("cumsum_stage", "chunk_state_stage", "scan_stage")   # ssd_varlen's stage functions, in launch order


@dataclass(frozen=True)
class SSDChunkTable:
    """Chunks of a packed batch (device tensors) — build once per step, share across layers."""
    chunk_start: Tensor      # [n_chunks] int64 token offset of the chunk in the packed batch
    chunk_len: Tensor        # [n_chunks] int32
    seq_chunk_ptr: Tensor    # [n_seqs + 1] int64: chunks of sequence s are seq_chunk_ptr[s]:seq_chunk_ptr[s+1]
    n_chunks: int
    n_tokens: int
    chunk_size: int
    slots_checked: bool = False  # the builder saw the slots: ssd_varlen then skips its host-side slot check
    ckpt_slot: Tensor | None = None  # [n_chunks] int32 bank slot that receives the fp32 state entering the chunk
                                     # (-1: none); the prefix cache's checkpoints inside a piece (DESIGN §12)


def ssd_chunk_table(cu_seqlens: Tensor | list[int], start_pos: Tensor | list[int], chunk_size: int,
                    device: torch.device | str, slot: Tensor | list[int] | None = None,
                    n_slots: int | None = None,
                    checkpoints: list[tuple[int, int, int]] | None = None) -> SSDChunkTable:
    """Cut every sequence at absolute multiples of chunk_size (as oracle.ssd.chunk_bounds) into one table.

    Given `slot` and `n_slots` (the bank size) it also checks the slots once, so that every layer's
    ssd_varlen call with this table runs without a host sync; given host lists (as the engine does, once per
    step) building it needs none either: its arrays go to the device in one pinned, non-blocking copy.
    `checkpoints` (sequence s, absolute position p, bank slot b): the fp32 state of sequence s at p — a chunk
    start strictly inside the sequence — is also written to bank[b] (bitwise the state a piece ending at p
    leaves: the same carried sum), so a prefix cache can store a checkpoint in the middle of a piece."""
    if (slot is None) != (n_slots is None):
        raise KernelInputError(f"{OP}: give both `slot` and `n_slots` to the chunk table, or neither")
    host_slots = host_ints(OP, "slot", slot) if slot is not None else None
    if host_slots is not None:
        check_slots(OP, host_slots, n_slots)
    cu = host_ints(OP, "cu_seqlens", cu_seqlens)
    sp = host_ints(OP, "start_pos", start_pos)
    if chunk_size < 1:
        raise KernelInputError(f"{OP}: `chunk_size`={chunk_size} must be >= 1")
    if len(cu) < 1 or cu[0] != 0:
        raise KernelInputError(f"{OP}: `cu_seqlens` must start with 0, got {cu[:1]}")
    if len(sp) != len(cu) - 1:
        raise KernelInputError(f"{OP}: `start_pos` has {len(sp)} entries for {len(cu) - 1} sequences")
    starts, lens, ptr = [], [], [0]
    for s in range(len(sp)):
        lo, hi_seq = cu[s], cu[s + 1]
        if hi_seq < lo:
            raise KernelInputError(f"{OP}: `cu_seqlens` decreases at sequence {s}")
        if sp[s] < 0:
            raise KernelInputError(f"{OP}: `start_pos`[{s}]={sp[s]} is negative")
        pos = sp[s]
        while lo < hi_seq:
            hi = min(hi_seq, lo + chunk_size - pos % chunk_size)
            starts.append(lo)
            lens.append(hi - lo)
            pos += hi - lo
            lo = hi
        ptr.append(len(starts))
    ckpt = _checkpoint_chunks(checkpoints, cu, sp, starts, ptr, n_slots) if checkpoints else []
    host = torch.tensor(starts + lens + ptr + ckpt, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()            # one asynchronous host->device copy: the table costs no host sync
    dev, n = host.to(device, non_blocking=True), len(starts)
    m = 3 * n + 1 + len(sp)
    return SSDChunkTable(dev[:n], dev[n:2 * n].to(torch.int32), dev[2 * n:2 * n + len(sp) + 1],
                         n, cu[-1], chunk_size, slot is not None, dev[2 * n + len(sp) + 1:m].to(torch.int32)
                         if ckpt else None)


def _checkpoint_chunks(checkpoints: list[tuple[int, int, int]], cu: list[int], sp: list[int], starts: list[int],
                       ptr: list[int], n_slots: int | None) -> list[int]:
    """Per chunk the bank slot that receives the state entering it (-1: none), from (sequence, position, slot)."""
    ckpt = [-1] * len(starts)
    for i, (s, p, b) in enumerate(checkpoints):
        where = f"{OP}: `checkpoints`[{i}] = (sequence {s}, position {p}, slot {b})"
        if not 0 <= s < len(sp):
            raise KernelInputError(f"{where}: no such sequence ({len(sp)} sequences)")
        if n_slots is not None and not 0 <= b < n_slots:
            raise KernelInputError(f"{where}: slot outside 0..{n_slots - 1}")
        c = next((c for c in range(ptr[s], ptr[s + 1]) if sp[s] + starts[c] - cu[s] == p), None)
        if c is None or c == ptr[s]:
            raise KernelInputError(f"{where}: not a chunk start strictly inside the sequence "
                                   f"[{sp[s]}, {sp[s] + cu[s + 1] - cu[s]})")
        ckpt[c] = b
    return ckpt


@dataclass(frozen=True)
class SSDLaunchRule:
    """Tiles, warps and pipeline stages of the three SSD stages (docs/kernels.md, "SSD launch rule")."""
    block_q: int             # the chunk's token tile: chunk_size up to a power of two (cumsum)
    cumsum_block_h: int      # heads a cumsum program scans
    cumsum_warps: int
    state_block_k: int       # tokens a chunk-state step sums
    state_block_p: int       # the walker's P-tile
    state_block_n: int       # the walker's N-tile
    state_warps: int
    state_stages: int
    scan_block_s: int        # tokens a scan sub-chunk
    scan_block_p: int        # the scan program's P-tile
    scan_block_n: int        # all of N
    scan_warps: int
    scan_stages: int


def ssd_launch_rule(H: int, G: int, P: int, N: int, chunk_size: int, dtype: torch.dtype | None) -> SSDLaunchRule:
    """The SSD stages' tiles, keyed on the model shape only (never on token count: a sequence gets the same bits in
    any batch). The chunk state: one walker per head and 64-row P-tile with N whole up to 128, so x is read once a
    chunk; 4 stages, 2 for 32-bit inputs (4 would overflow the shared memory of sm_86/89, tests/test_kernel_static.py).
    The scan: 64-token sub-chunks, 4 warps, 2 stages. Why these and not others: docs/kernels.md, "SSD launch rule"."""
    bq = next_pow2(chunk_size, 16)
    bp = min(next_pow2(P, 16), 64)
    return SSDLaunchRule(
        block_q=bq, cumsum_block_h=min(next_pow2(H), max(1, 8192 // bq)), cumsum_warps=4,
        state_block_k=min(bq, 64), state_block_p=bp, state_block_n=min(next_pow2(N, 16), 128), state_warps=8,
        state_stages=2 if dtype is not None and dtype.itemsize >= 4 else 4,
        scan_block_s=min(bq, 64), scan_block_p=bp, scan_block_n=next_pow2(N, 16), scan_warps=4, scan_stages=2)


def ssd_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
               dt_bias: Tensor | None, ssm_bank: Tensor, cu_seqlens: Tensor | list[int],
               slot: Tensor, start_pos: Tensor | list[int], has_initial_state: Tensor, chunk_size: int,
               dt_limit: tuple[float, float] = (0.0, math.inf), out: Tensor | None = None,
               table: SSDChunkTable | None = None) -> Tensor:
    """Chunked SSD over packed sequences: x [T,H,P], dt raw [T,H], A [H], B/C [T,G,N], D [H] -> y [T,H,P].

    `table` (from ssd_chunk_table) can be built once per step and shared by all layers; built with the slots,
    it makes this call free of host syncs (the slots must be the ones it checked). Initial states are read from,
    final states (and the table's checkpoints) written to the bank slots."""
    # validate: shapes, dtypes, devices; the slots on the host unless the table checked them
    T, H, P, G, N = _validate(x, dt, A, B, C, D, dt_bias, ssm_bank, slot, has_initial_state,
                              table is None or not table.slots_checked)
    n_seq = slot.shape[0]
    if out is None:
        out = torch.empty_like(x)
    check(OP, "out", out, (T, H, P), (x.dtype,), x.device)
    # chunk table: every sequence cut at absolute multiples of chunk_size
    if table is None:
        table = ssd_chunk_table(cu_seqlens, start_pos, chunk_size, x.device)
    if table.n_tokens != T or table.chunk_size != chunk_size or table.seq_chunk_ptr.numel() != n_seq + 1:
        raise KernelInputError(f"{OP}: `table` was built for another batch (tokens {table.n_tokens} vs {T}, "
                               f"chunk {table.chunk_size} vs {chunk_size}, seqs {table.seq_chunk_ptr.numel() - 1})")
    if T == 0 and n_seq == 0:
        return out
    rule = ssd_launch_rule(H, G, P, N, chunk_size, x.dtype)
    prec = dot_precision(x.dtype)
    # 1 cumsum: dt processed and the within-chunk cumulative log-decay, [H, T] fp32 each
    dt_p, dacs = cumsum_stage(dt, dt_bias, A, table, dt_limit, rule)
    # 2 chunk state: the state entering each chunk, in the inputs' dtype (the scan multiplies it in that dtype);
    #   the fp32 state carried from chunk to chunk stays in the walkers and ends in the bank
    prev = chunk_state_stage(x, B, dt_p, dacs, ssm_bank, table, slot, has_initial_state, rule, prec)
    # 3 scan: y of every chunk from its entering state and its own tokens
    scan_stage(x, B, C, dt_p, dacs, prev, D, A, out, table, rule, prec)
    return out


def _validate(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
              ssm_bank: Tensor, slot: Tensor, has_initial_state: Tensor,
              check_slot_values: bool) -> tuple[int, int, int, int, int]:
    """(T, H, P, G, N) of ssd_varlen's inputs, or a KernelInputError naming the field."""
    check(OP, "x", x, (None, None, None), FLOAT_DTYPES)
    T, H, P = x.shape
    dev = x.device
    check(OP, "dt", dt, (T, H), FLOAT_DTYPES, dev)
    check(OP, "A", A, (H,), (torch.float32,), dev)
    check(OP, "B", B, (T, None, None), (x.dtype,), dev)
    G, N = B.shape[1], B.shape[2]
    check(OP, "C", C, (T, G, N), (x.dtype,), dev)
    check(OP, "D", D, (H,), FLOAT_DTYPES, dev, optional=True)
    check(OP, "dt_bias", dt_bias, (H,), FLOAT_DTYPES, dev, optional=True)
    check(OP, "ssm_bank", ssm_bank, (None, H, P, N), (torch.float32,), dev)
    if G < 1 or H % G != 0:
        raise KernelInputError(f"{OP}: n_heads={H} is not divisible by n_groups={G}")
    check(OP, "slot", slot, (None,), INDEX_DTYPES, dev)
    n_seq = slot.shape[0]
    check(OP, "has_initial_state", has_initial_state, (n_seq,), (torch.bool, torch.int32, torch.int8), dev)
    if check_slot_values:
        check_slots(OP, host_ints(OP, "slot", slot), ssm_bank.shape[0])
    if n_seq > 65535:
        raise KernelInputError(f"{OP}: {n_seq} sequences in one call; at most 65535 (grid z limit)")
    return T, H, P, G, N


def cumsum_stage(dt: Tensor, dt_bias: Tensor | None, A: Tensor, table: SSDChunkTable,
                 dt_limit: tuple[float, float], rule: SSDLaunchRule) -> tuple[Tensor, Tensor]:
    """Stage 1: (dt processed, the within-chunk cumsum of dt·A), both [H, T] fp32; one program a chunk and head
    block."""
    T, H = dt.shape
    lo, hi = dt_limits(dt_limit)
    dt_p = torch.empty(H, T, dtype=torch.float32, device=dt.device)
    dacs = torch.empty(H, T, dtype=torch.float32, device=dt.device)
    if table.n_chunks > 0:
        ssd_chunk_cumsum_kernel[(table.n_chunks, triton_cdiv(H, rule.cumsum_block_h))](
            dt, dt_bias if dt_bias is not None else A, A, dt_p, dacs, table.chunk_start, table.chunk_len,
            H, lo, hi, dt.stride(0), dt.stride(1), dt_p.stride(0),
            HAS_BIAS=dt_bias is not None, BLOCK_Q=rule.block_q, BLOCK_H=rule.cumsum_block_h,
            num_warps=rule.cumsum_warps)
    return dt_p, dacs


def chunk_state_stage(x: Tensor, B: Tensor, dt_p: Tensor, dacs: Tensor, ssm_bank: Tensor, table: SSDChunkTable,
                      slot: Tensor, has_initial_state: Tensor, rule: SSDLaunchRule, prec: str) -> Tensor:
    """Stage 2: the states entering the chunks, [max(n_chunks, 1), H, P, N] in x's dtype; the walkers also write
    each sequence's final fp32 state (and the table's checkpoints) to the bank."""
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    n_seq = slot.shape[0]
    prev = torch.empty(max(table.n_chunks, 1), H, P, N, dtype=x.dtype, device=x.device)
    if n_seq > 0:
        ck = table.ckpt_slot
        grid = (triton_cdiv(P, rule.state_block_p) * triton_cdiv(N, rule.state_block_n), H, n_seq)
        ssd_chunk_state_kernel[grid](
            x, B, dt_p, dacs, ssm_bank, prev, table.seq_chunk_ptr, table.chunk_start, table.chunk_len, slot,
            has_initial_state.to(torch.int32), P, N, H // G, *x.stride(), *B.stride(), dt_p.stride(0),
            *ssm_bank.stride(), prev.stride(0), prev.stride(1), prev.stride(2), ck if ck is not None else slot,
            BLOCK_K=rule.state_block_k, BLOCK_P=rule.state_block_p, BLOCK_N=rule.state_block_n, DOT_PREC=prec,
            HAS_CKPT=ck is not None, num_warps=rule.state_warps, num_stages=rule.state_stages)
    return prev


def scan_stage(x: Tensor, B: Tensor, C: Tensor, dt_p: Tensor, dacs: Tensor, prev: Tensor, D: Tensor | None,
               A: Tensor, out: Tensor, table: SSDChunkTable, rule: SSDLaunchRule, prec: str) -> None:
    """Stage 3: y into `out`, one program per (chunk, head, P-tile) stepping through BLOCK_S-token sub-chunks."""
    nc = table.n_chunks
    if nc == 0:
        return
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    _check_in_chunk_offsets(rule.block_q + rule.scan_block_s, x=x, B=B, C=C, y=out)
    ssd_chunk_scan_rec_kernel[(nc * H * triton_cdiv(P, rule.scan_block_p),)](
        x, B, C, dt_p, dacs, prev, D if D is not None else A, out,
        table.chunk_start, table.chunk_len, H, P, N, H // G,
        *x.stride(), *B.stride(), *C.stride(), dt_p.stride(0),
        prev.stride(0), prev.stride(1), prev.stride(2), *out.stride(),
        HAS_D=D is not None, BLOCK_S=rule.scan_block_s, BLOCK_P=rule.scan_block_p, BLOCK_N=rule.scan_block_n,
        DOT_PREC=prec, MASK_PN=rule.scan_block_n != N or P % rule.scan_block_p != 0,
        num_warps=rule.scan_warps, num_stages=rule.scan_stages)


def _check_in_chunk_offsets(rows: int, **tensors: Tensor) -> None:
    """The rec scan adds 32-bit offsets within a chunk (`rows` token rows at most) to 64-bit chunk corners: a clear
    error naming the tensor whose strides would overflow them."""
    for name, t in tensors.items():
        span = rows * abs(t.stride(0)) + sum(abs(st) * n for st, n in zip(t.stride()[2:], t.shape[2:]))
        if span >= 2 ** 31:
            raise KernelInputError(f"{OP}: {name}'s offsets within a chunk overflow 32 bits (strides "
                                   f"{tuple(t.stride())}, {rows} rows)")


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)
