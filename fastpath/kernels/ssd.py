"""Varlen SSD prefill over the state bank (mirrors oracle/ssd.py: ssd_chunked).

Packed tokens of several sequences (cu_seqlens). Sequence s starts at absolute position start_pos[s],
reads its initial state from ssm_bank[slot[s]] when has_initial_state[s] (zeros otherwise) and writes its
final state back to ssm_bank[slot[s]] (slot -1: no bank read or write; its outputs are still computed, from a
zero state). Chunks are cut at absolute multiples of chunk_size, so a continuation piece starting mid-chunk
first finishes that chunk. dt processing (softplus(dt + dt_bias), clamp to dt_limit) happens inside; the z
gate is *not* applied here (the gated norm does it). fp32 accumulation, fp32 states.

Two paths. Unfused (one stage per file): ssd_chunk_cumsum → [ssd_bmm] → ssd_chunk_state (chunk states +
passing, fused) → ssd_chunk_scan (by default a sub-chunk recurrence inside each chunk; or row × column blocks).
Fused (ssd_fused.py): one launch doing dt processing, chunk states, their passing and the scan, the carried
states never stored per chunk. `ssd_varlen(fused=...)` picks one; by default the launch rule's choice.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import (FLOAT_DTYPES, INDEX_DTYPES, KernelInputError, check, check_slots, dot_precision,
                      dt_limits, host_ints, next_pow2, reg_cap)
from .ssd_bmm import ssd_bmm_kernel
from .ssd_chunk_cumsum import ssd_chunk_cumsum_kernel
from .ssd_chunk_scan import ssd_chunk_scan_kernel, ssd_chunk_scan_rec_kernel
from .ssd_chunk_state import (ssd_chunk_local_state_kernel, ssd_chunk_state_flat_kernel, ssd_chunk_state_kernel,
                              ssd_state_passing_kernel)
from .ssd_fused import launch_ssd_fused
from .ssd_scan_blk_mh import launch_ssd_scan_blk_mh
from .ssd_scan_mh import launch_ssd_scan_mh
from .ssd_scan_tma import launch_ssd_scan_tma
from .ssd_state_tma import launch_ssd_state_tma

OP = "ssd_varlen"
_FUSED_LAUNCH: list = [None]    # the last fused launch's kernel handle (registers / spills / shared memory, benches)
_SCAN_LAUNCH: list = [None]     # the last staged scan launch's kernel handle (benches)
SCAN_KINDS = ("rec", "blocked", "walk", "rec_mh", "blocked_mh", "rec_tma")
STATE_MODES = ("fused", "flat", "parallel", "tma")


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
    chunk_seq: Tensor | None = None  # [n_chunks] int64 sequence of each chunk (fused path; else derived on device)
    pad_index: Tensor | None = None  # [n_seqs] int64 scratch row of each slot -1 piece (-1: banked; fused path)
    n_pad: int = -1                  # slot -1 pieces among the slots the builder saw (-1: slots not seen)


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
    chunk_seq = [s for s in range(len(sp)) for _ in range(ptr[s + 1] - ptr[s])]
    pads = _pad_index(host_slots) if host_slots is not None else []
    host = torch.tensor(starts + lens + ptr + ckpt + chunk_seq + pads, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()            # one asynchronous host->device copy: the table costs no host sync
    dev, n = host.to(device, non_blocking=True), len(starts)
    m = 3 * n + 1 + len(sp)
    q = 2 * n + len(sp) + 1 + len(ckpt)     # chunk_seq, then pad_index
    return SSDChunkTable(dev[:n], dev[n:2 * n].to(torch.int32), dev[2 * n:2 * n + len(sp) + 1],
                         n, cu[-1], chunk_size, slot is not None, dev[2 * n + len(sp) + 1:m].to(torch.int32)
                         if ckpt else None, dev[q:q + n], dev[q + n:q + n + len(sp)] if slot is not None else None,
                         sum(p >= 0 for p in pads) if slot is not None else -1)


def _pad_index(slots: list[int]) -> list[int]:
    """Per sequence: its row in the fused path's carry scratch if its slot is -1 (rows 0, 1, ...), else -1."""
    out, k = [], 0
    for s in slots:
        out.append(k if s < 0 else -1)
        k += s < 0
    return out


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


def ssd_launch_rule(H: int, G: int, P: int, N: int, chunk_size: int, dtype: torch.dtype) -> dict:
    """Tile shapes and warps for the SSD pipeline; keyed on the model shape only (never on token count)."""
    bq = next_pow2(chunk_size, 16)
    bn_full = next_pow2(N, 16)
    return dict(
        BLOCK_Q=bq,
        cumsum=dict(BLOCK_H=min(next_pow2(H), max(1, 8192 // bq)), num_warps=4),
        bmm=dict(BLOCK_M=min(bq, 64), num_warps=4),
        # mode "fused": one program walks a sequence's chunks (ssd_chunk_state_kernel; "flat": the same as one
        # loop over all sub-blocks); "parallel": every chunk's own state at once (fp32 scratch, nc·H·P·N·4
        # bytes), then a streaming element-wise passing kernel (PASS_BLOCK elements a program). H200, L65536:
        # fused 4.00 ms total, parallel 4.13, flat 4.54 (bitwise equal y) — fused, which needs no scratch.
        # "tma" (ssd_state_tma.py, a bench option): the fused walk reading x and B through tensor descriptors.
        # segment_chunks (a bench key, 0: off): a single sequence's walk cut into segments of this many chunks on a
        # side stream, the scan of each segment starting as soon as its walk segment ends (CUDA: overlapped; the
        # interpreter: in turn); the same bits as one walk (the carry between segments is the fp32 state).
        # Tiles: one walker per head and 64-row P-tile with N whole up to 128 (x read once a chunk, not once per
        # N-tile), 8 warps, 4 stages: H100, L65536 state 1.19-1.26 ms vs 1.32-1.34 for 64-wide N-tiles at 4 warps,
        # 3 stages (the rule before); narrower N-tiles (more walkers) were slower (docs/performance.md). 32-bit
        # inputs take 2 stages: 4 would need 165 KB of shared memory (sm_90 compile), over the 99 KB of sm_86/89.
        state=dict(mode="fused", PASS_BLOCK=1024, PASS_WARPS=4, segment_chunks=0,
                   BLOCK_K=min(bq, 64), BLOCK_P=min(next_pow2(P, 16), 64), BLOCK_N=min(bn_full, 128),
                   num_warps=8, num_stages=2 if dtype is not None and dtype.itemsize >= 4 else 4),
        # kind "rec": sub-chunk recurrence inside the chunk (ssd_chunk_scan_rec_kernel, BLOCK_S tokens a
        # step); kind "blocked": row × column blocks of the full chunk (ssd_chunk_scan_kernel, BLOCK_M/K).
        # H200, L65536 (docs/performance.md): rec S64 4 warps 2 stages is best (scan ≈ 2.5 ms vs 5.6 blocked);
        # S32 +0.8 ms, S128 +4.3, 8 warps +2.6, 3 stages +2.4, P-tile 32 +2.3, 2 warps 84 ms.
        scan=dict(kind="rec", BLOCK_S=min(bq, 64), BLOCK_M=min(bq, 64), BLOCK_K=min(bq, 64),
                  BLOCK_P=min(next_pow2(P, 16), 64), BLOCK_N=bn_full, num_warps=4, num_stages=2),
        # kind "walk": blocked's arithmetic with one program per (chunk, head, P-tile) walking the row
        # blocks and the entering state loaded once; with use_cb it reads a group's C·Bᵀ instead of recomputing it
        # per head, and carries no state. sm_90 at BLOCK_M 64, BLOCK_K 32, 1 stage: no spill (`hybridqual bench
        # sass`). For benches: slower than rec on an H100 (64k: scan 3.09 ms vs 2.51, docs/performance.md).
        # kinds "rec_mh" / "blocked_mh" (ssd_scan_mh.py / ssd_scan_blk_mh.py): the same two scans with HEADS heads
        # of a group per program sharing C, B and C·Bᵀ (key HEADS); any scan or state entry may also set maxnreg
        # (a register cap per thread); kind "rec_tma" (ssd_scan_tma.py): rec with x, B, C and y moved as
        # tensor-descriptor boxes. Options for benches, not the default: every one was slower than rec
        # (docs/kernels.md, "Scan options timed and removed" and the descriptor kernels).
        # (blocked scan only) C·B computed in the scan, not precomputed per group: measured faster on the
        # H200 at H/G = 128 (6.43 vs 7.34 ms, bitwise equal outputs; docs/performance.md).
        use_cb=False,
        cb_fp32=True,
        # the fused path (ssd_fused.py): one program per (chunk, head), P and N whole, BLOCK_S-token sub-chunks.
        # `default`: taken when ssd_varlen(fused=None) runs on CUDA; the interpreter (CPU tier) keeps the unfused
        # path unless asked (its tests and mutants pin those kernels; the fused tests ask for this one).
        # H200, 2026-12-03 (tools/bench/ssd_fused.py): fused 4.103 ms vs staged 3.980 at L65536, 0.556 vs 0.535
        # at L8192; faster only on 512 pieces of < 64 tokens (3.77 vs 4.09). So default=False: the staged path
        # stays the default (a dispatch by batch content would make a sequence's bits depend on its batch).
        # pre_dt (dt from ssd_chunk_cumsum_kernel) beat in-kernel dt processing (4.10 vs 4.92 ms at L65536).
        fused=dict(default=False, BLOCK_S=min(bq, 64), BLOCK_P=next_pow2(P, 16), BLOCK_N=bn_full, num_warps=4,
                   num_stages=2, use_cb=False, ticket=True, pre_dt=True),
    )


def ssd_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
               dt_bias: Tensor | None, ssm_bank: Tensor, cu_seqlens: Tensor | list[int],
               slot: Tensor, start_pos: Tensor | list[int], has_initial_state: Tensor, chunk_size: int,
               dt_limit: tuple[float, float] = (0.0, math.inf), out: Tensor | None = None,
               table: SSDChunkTable | None = None, use_cb: bool | None = None, _mark=None,
               _rule: dict | None = None, fused: bool | None = None) -> Tensor:
    """Chunked SSD over packed sequences: x [T,H,P], dt raw [T,H], A [H], B/C [T,G,N], D [H] -> y [T,H,P].

    `table` (from ssd_chunk_table) can be built once per step and shared by all layers; built with the slots,
    it makes this call free of host syncs (the slots must be the ones it checked); `use_cb` overrides the
    launch rule's choice of a precomputed C·B (True runs the blocked scan); `fused` picks the one-launch path
    (ssd_fused.py: True) or the staged one (False); None: the rule's `fused.default` on CUDA, staged in the
    interpreter. Both read initial states from and write final states (and checkpoints) to the same bank slots.
    `_mark(stage)` is called after the host's set-up ("host") and after each stage, and `_rule` replaces the launch
    rule (benchmark hooks)."""
    mark = _mark if _mark is not None else (lambda stage: None)
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
    host_slots = None
    if table is None or not table.slots_checked:
        host_slots = host_ints(OP, "slot", slot)
        check_slots(OP, host_slots, ssm_bank.shape[0])
    if n_seq > 65535:
        raise KernelInputError(f"{OP}: {n_seq} sequences in one call; at most 65535 (grid z limit)")
    if out is None:
        out = torch.empty_like(x)
    check(OP, "out", out, (T, H, P), (x.dtype,), dev)
    if table is None:
        table = ssd_chunk_table(cu_seqlens, start_pos, chunk_size, dev)
    if table.n_tokens != T or table.chunk_size != chunk_size or table.seq_chunk_ptr.numel() != n_seq + 1:
        raise KernelInputError(f"{OP}: `table` was built for another batch (tokens {table.n_tokens} vs {T}, "
                               f"chunk {table.chunk_size} vs {chunk_size}, seqs {table.seq_chunk_ptr.numel() - 1})")
    if T == 0 and n_seq == 0:
        return out
    rule = _rule if _rule is not None else ssd_launch_rule(H, G, P, N, chunk_size, x.dtype)
    use_cb = rule["use_cb"] if use_cb is None else use_cb
    kind, mode = rule["scan"].get("kind", "blocked"), rule["state"].get("mode", "fused")
    if kind not in SCAN_KINDS:
        raise KernelInputError(f"{OP}: scan kind {kind!r} is not one of {SCAN_KINDS}")
    if mode not in STATE_MODES:
        raise KernelInputError(f"{OP}: state mode {mode!r} is not one of {STATE_MODES}")
    prec = dot_precision(x.dtype)
    lo, hi = dt_limits(dt_limit)
    BQ = rule["BLOCK_Q"]
    nc = table.n_chunks
    has_init = has_initial_state.to(torch.int32)
    fr = rule.get("fused", {})
    if fused is None:
        fused = bool(fr.get("default", False)) and dev.type == "cuda"
    mark("host")                            # the host's checks and set-up end here; the launches follow
    if fused:
        if host_slots is not None:
            pads = _pad_index(host_slots)
            pad_index, n_pad = torch.tensor(pads, dtype=torch.int64).to(dev), sum(p >= 0 for p in pads)
        elif table.pad_index is not None and table.n_pad >= 0:
            pad_index, n_pad = table.pad_index, table.n_pad
        else:                               # slots checked elsewhere, not seen here: a scratch row per piece
            pad_index, n_pad = torch.arange(n_seq, device=dev), n_seq
        cb = None
        if fr.get("use_cb", False) and nc > 0:
            r = rule["bmm"]
            cb = torch.empty(nc, G, BQ, BQ, dtype=torch.float32, device=dev)
            nb = BQ // fr["BLOCK_S"]
            ssd_bmm_kernel[(nc, G, nb * nb)](
                B, C, cb, table.chunk_start, table.chunk_len, N,
                *B.stride(), *C.stride(), cb.stride(0), cb.stride(1), cb.stride(2),
                BLOCK_Q=BQ, BLOCK_M=fr["BLOCK_S"], BLOCK_N=next_pow2(N, 16), DOT_PREC=prec,
                num_warps=r["num_warps"])
        dt_pre = None
        if fr.get("pre_dt", False) and nc > 0:      # dt processing by the staged path's cumsum kernel
            dt_pre = (torch.empty(H, T, dtype=torch.float32, device=dev),
                      torch.empty(H, T, dtype=torch.float32, device=dev))
            r = rule["cumsum"]
            ssd_chunk_cumsum_kernel[(nc, triton_cdiv(H, r["BLOCK_H"]))](
                dt, dt_bias if dt_bias is not None else A, A, dt_pre[0], dt_pre[1], table.chunk_start,
                table.chunk_len, H, lo, hi, dt.stride(0), dt.stride(1), dt_pre[0].stride(0),
                HAS_BIAS=dt_bias is not None, BLOCK_Q=BQ, BLOCK_H=r["BLOCK_H"], num_warps=r["num_warps"])
        _FUSED_LAUNCH[0] = launch_ssd_fused(x, dt, A, B, C, D, dt_bias, ssm_bank, out, table, slot, has_init,
                                            pad_index, n_pad, lo, hi, fr, prec, cb=cb, dt_pre=dt_pre)
        mark("fused")
        return out

    dt_p = torch.empty(H, T, dtype=torch.float32, device=dev)
    dacs = torch.empty(H, T, dtype=torch.float32, device=dev)
    if nc > 0:
        r = rule["cumsum"]
        ssd_chunk_cumsum_kernel[(nc, triton_cdiv(H, r["BLOCK_H"]))](
            dt, dt_bias if dt_bias is not None else A, A, dt_p, dacs, table.chunk_start, table.chunk_len,
            H, lo, hi, dt.stride(0), dt.stride(1), dt_p.stride(0),
            HAS_BIAS=dt_bias is not None, BLOCK_Q=BQ, BLOCK_H=r["BLOCK_H"], num_warps=r["num_warps"])
    mark("cumsum")
    rec = kind == "rec" and not use_cb    # a precomputed C·B: blocked / walk
    cb = None
    if use_cb and nc > 0:
        cb = torch.empty(nc, G, BQ, BQ, dtype=torch.float32 if rule.get("cb_fp32", True) else x.dtype, device=dev)
        r = rule["bmm"]
        nb = BQ // r["BLOCK_M"]
        ssd_bmm_kernel[(nc, G, nb * nb)](
            B, C, cb, table.chunk_start, table.chunk_len, N,
            *B.stride(), *C.stride(), cb.stride(0), cb.stride(1), cb.stride(2),
            BLOCK_Q=BQ, BLOCK_M=r["BLOCK_M"], BLOCK_N=next_pow2(N, 16), DOT_PREC=prec, num_warps=r["num_warps"])
    mark("bmm")
    # states entering each chunk, for the scan only (it multiplies them in the inputs' dtype); the state
    # carried from chunk to chunk and written to the bank stays fp32 inside the chunk-state kernel.
    prev = torch.empty(max(nc, 1), H, P, N, dtype=x.dtype, device=dev)
    # the chunk-state walk cut into segments (bench key segment_chunks): one sequence of more chunks than a segment,
    # the fused walk and the rec scan
    seg = int(rule["state"].get("segment_chunks", 0) or 0)
    segmented = seg > 0 and n_seq == 1 and nc > seg and mode == "fused" and rec
    if n_seq > 0:
        r = rule["state"]
        if table.ckpt_slot is not None and mode not in ("fused", "tma"):
            raise KernelInputError(f"{OP}: checkpoint states need the fused chunk-state kernel (mode {mode!r})")
        grid = (triton_cdiv(P, r["BLOCK_P"]) * triton_cdiv(N, r["BLOCK_N"]), H, n_seq)
        def walk_args(seq_chunk_ptr: Tensor) -> tuple:  # the walkers' arguments over seq_chunk_ptr's chunks
            return (x, B, dt_p, dacs, ssm_bank, prev, seq_chunk_ptr, table.chunk_start, table.chunk_len, slot,
                    has_init, P, N, H // G, *x.stride(), *B.stride(), dt_p.stride(0), *ssm_bank.stride(),
                    prev.stride(0), prev.stride(1), prev.stride(2))
        args = walk_args(table.seq_chunk_ptr)
        tiles = dict(BLOCK_K=r["BLOCK_K"], BLOCK_P=r["BLOCK_P"], BLOCK_N=r["BLOCK_N"], DOT_PREC=prec,
                     num_warps=r["num_warps"], num_stages=r["num_stages"])
        if mode == "parallel" and nc > 0:
            local = torch.empty(nc, H, P, N, dtype=torch.float32, device=dev)
            ssd_chunk_local_state_kernel[(grid[0] * H * nc,)](
                x, B, dt_p, dacs, local, table.chunk_start, table.chunk_len, H, P, N, H // G,
                *x.stride(), *B.stride(), dt_p.stride(0), local.stride(0), local.stride(1), local.stride(2),
                **tiles, **reg_cap(r))
            ssd_state_passing_kernel[(triton_cdiv(P * N, r["PASS_BLOCK"]), H, n_seq)](
                local, dacs, ssm_bank, prev, table.seq_chunk_ptr, table.chunk_start, table.chunk_len, slot,
                has_init, P, N, local.stride(0), local.stride(1), local.stride(2), dt_p.stride(0),
                *ssm_bank.stride(), prev.stride(0), prev.stride(1), prev.stride(2),
                BLOCK=r["PASS_BLOCK"], num_warps=r["PASS_WARPS"])
        elif mode == "flat":
            ssd_chunk_state_flat_kernel[grid](*args, BLOCK_Q=BQ, **tiles)
        elif mode == "tma":
            launch_ssd_state_tma(x, B, dt_p, dacs, ssm_bank, prev, table, slot, has_init, H // G, r, prec)
        else:
            ck = table.ckpt_slot

            def walk(seq_chunk_ptr: Tensor, **carry) -> None:    # the fused walk over seq_chunk_ptr's chunks
                ssd_chunk_state_kernel[grid](*walk_args(seq_chunk_ptr), ck if ck is not None else slot,
                                             HAS_CKPT=ck is not None, **carry, **tiles, **reg_cap(r))

            if segmented:
                def scan(lo: int, hi: int):                      # the rec scan of chunks lo..hi-1
                    return _rec_scan(x, B, C, dt_p, dacs, prev[lo:hi], D, A, out, H, P, N, G, rule["scan"], BQ,
                                     prec, table.chunk_start[lo:hi], table.chunk_len[lo:hi], hi - lo)
                _SCAN_LAUNCH[0] = _segmented_walk_and_scan(walk, scan, nc, seg, (H, P, N), dev)
            else:
                walk(table.seq_chunk_ptr)
    mark("state")
    if segmented:
        pass                                # each segment's scan was launched after its walk segment
    elif nc > 0 and kind == "rec_mh" and not use_cb:
        _SCAN_LAUNCH[0] = launch_ssd_scan_mh(x, B, C, dt_p, dacs, prev, D, A, out, table, rule["scan"], prec)
    elif nc > 0 and kind == "rec_tma" and not use_cb:
        _SCAN_LAUNCH[0] = launch_ssd_scan_tma(x, B, C, dt_p, dacs, prev, D, A, out, table, rule["scan"], prec)
    elif nc > 0 and kind == "blocked_mh" and not use_cb:
        _SCAN_LAUNCH[0] = launch_ssd_scan_blk_mh(x, B, C, dt_p, dacs, prev, D, A, out, table, rule["scan"], BQ, prec)
    elif nc > 0 and rec:
        _SCAN_LAUNCH[0] = _rec_scan(x, B, C, dt_p, dacs, prev, D, A, out, H, P, N, G, rule["scan"], BQ, prec,
                                    table.chunk_start, table.chunk_len, nc)
    elif nc > 0:
        r = rule["scan"]
        walk = kind == "walk"                  # one program walks its chunk's row blocks
        grid = (nc * H * (1 if walk else BQ // r["BLOCK_M"]) * triton_cdiv(P, r["BLOCK_P"]),)
        cbt = cb if cb is not None else prev
        _SCAN_LAUNCH[0] = ssd_chunk_scan_kernel[grid](
            x, B, C, cbt, dt_p, dacs, prev, D if D is not None else A, out,
            table.chunk_start, table.chunk_len, H, P, N, H // G,
            *x.stride(), *B.stride(), *C.stride(),
            cbt.stride(0), cbt.stride(1), cbt.stride(2), dt_p.stride(0),
            prev.stride(0), prev.stride(1), prev.stride(2), *out.stride(),
            USE_CB=cb is not None, HAS_D=D is not None, BLOCK_Q=BQ, BLOCK_M=r["BLOCK_M"], BLOCK_K=r["BLOCK_K"],
            BLOCK_P=r["BLOCK_P"], BLOCK_N=r["BLOCK_N"], DOT_PREC=prec, WALK=walk,
            num_warps=r["num_warps"], num_stages=r["num_stages"],
            **reg_cap(r))
    mark("scan")
    return out


def _rec_scan(x, B, C, dt_p, dacs, prev, D, A, out, H, P, N, G, r, BQ, prec, chunk_start, chunk_len, nc):
    """Launch the rec scan over nc chunks (chunk_start, chunk_len and prev may be a segment's slices)."""
    _check_in_chunk_offsets(BQ + r["BLOCK_S"], x=x, B=B, C=C, y=out)
    return ssd_chunk_scan_rec_kernel[(nc * H * triton_cdiv(P, r["BLOCK_P"]),)](
        x, B, C, dt_p, dacs, prev, D if D is not None else A, out,
        chunk_start, chunk_len, H, P, N, H // G,
        *x.stride(), *B.stride(), *C.stride(), dt_p.stride(0),
        prev.stride(0), prev.stride(1), prev.stride(2), *out.stride(),
        HAS_D=D is not None, BLOCK_S=r["BLOCK_S"], BLOCK_P=r["BLOCK_P"], BLOCK_N=r["BLOCK_N"], DOT_PREC=prec,
        MASK_PN=r["BLOCK_N"] != N or P % r["BLOCK_P"] != 0,
        num_warps=r["num_warps"], num_stages=r["num_stages"], **reg_cap(r))


_SIDE_STREAMS: dict = {}


def _segmented_walk_and_scan(walk, scan, nc: int, seg: int, state_shape: tuple[int, int, int],
                             dev: torch.device):
    """One sequence's chunk-state walk (`walk(seq_chunk_ptr, **carry)`) in segments of `seg` chunks, each segment's
    scan (`scan(lo, hi)`) launched once its walk segment has written the entering states it reads; the state
    passes between segments through an fp32 carry. On CUDA the walk runs on a side stream (forked from and joined
    to the current one, so CUDA graphs capture it), overlapping the scan of earlier segments. Returns the last
    scan launch."""
    bounds = [min(i, nc) for i in range(0, nc + seg, seg)]
    seg_ptr = torch.arange(0, nc + seg, seg, dtype=torch.int64, device=dev).clamp_(max=nc)   # no host copy: capturable
    carry = torch.empty(*state_shape, dtype=torch.float32, device=dev)
    cut = len(bounds) - 1
    side = None
    if dev.type == "cuda":
        side = _SIDE_STREAMS.get(dev)
        if side is None:                    # one side stream a device, made once
            side = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
    events = []
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for i in range(cut):
            walk(seg_ptr[i:i + 2], carry_ptr=carry, CARRY_IN=i > 0, CARRY_OUT=i < cut - 1)
            if side is not None:
                events.append(torch.cuda.Event())
                events[-1].record(side)
    launch = None
    for i in range(cut):
        if side is not None:
            torch.cuda.current_stream(dev).wait_event(events[i])
        launch = scan(bounds[i], bounds[i + 1])
    return launch        # the current stream has waited for the last walk segment: carry and seg_ptr may be freed


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
