"""What a dependent kernel chain costs on this GPU: why bs1 decode sits at ~75% of the copy roofline.

    python3 -m hybridqual.bench.chain

Prints, each timed as a CUDA graph (median of 5):
1. streaming rate: copy bandwidth, a read-only reduction and the shipped GEMV on one 5.4 GB weight (TB/s);
2. the 128 dependent GEMVs of anchor-3b's layers (32 × in_proj, out_proj, gate_up, down; x of each = y of the one
   before) against their bytes at the copy and at the measured read rate: the excess per boundary;
3. an empty PDL kernel chain at several CTA counts (µs per launch) and an in-kernel grid barrier (atomic counter,
   sense reversal) at several grid sizes (µs per barrier) — the two ways to order dependent stages.
Figures and their reading: docs/journal/performance.md, History (the run at 4dd0878).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from fastpath.kernels._common import pdl_enter, pdl_meta
from fastpath.kernels.gemv import gemv
from hybridqual.bench.engine import copy_bandwidth

DEV = torch.device("cuda")
SHAPES = [(10576, 2560), (2560, 5120), (12288, 2560), (2560, 6144)]     # anchor-3b: in, out, gate_up, down


@triton.jit
def read_kernel(w_ptr, out_ptr, n_el, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum of a contiguous slice per program: the read-only streaming rate."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        o = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + o, mask=o < n_el, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def empty_kernel(y_ptr, PDL: tl.constexpr):
    pdl_enter(PDL)
    if tl.program_id(0) == 0:
        tl.store(y_ptr, 1.0)


@triton.jit
def barrier_kernel(cnt_ptr, gen_ptr, G, NB, PDL: tl.constexpr):
    """NB grid-wide barriers (all G programs must be resident): arrive on a counter, the last arrival resets it and
    bumps a generation the others spin on."""
    pdl_enter(PDL)
    for _ in range(NB):
        tl.debug_barrier()
        gen = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
        old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if old == G - 1:
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(gen_ptr, 1, sem="release", scope="gpu")
        else:
            cur = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
            while cur == gen:
                cur = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


def time_graph(fn, reps: int = 30, warm: int = 3) -> float:
    """µs per replay of a CUDA graph of fn (fn run twice on a side stream first; `warm` replays; median of 5
    timings of `reps` replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warm):
        g.replay()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / reps)
    return sorted(ts)[2]


def streaming(bw: float) -> tuple[float, list[str]]:
    """(read-only rate, lines): a reduction and the shipped GEMV over one 5.4 GB weight."""
    w = torch.randn(1 << 20, 2560, dtype=torch.bfloat16, device=DEV) * 0.02
    x = torch.randn(1, 2560, dtype=torch.bfloat16, device=DEV)
    y = torch.empty(1, 1 << 20, dtype=torch.bfloat16, device=DEV)
    nb = w.numel() * 2
    flat, out = w.view(-1), torch.empty(triton.cdiv(w.numel(), 4096 * 8), device=DEV)
    t_rd = time_graph(lambda: read_kernel[(out.numel(),)](flat, out, flat.numel(), BLOCK=4096, ITERS=8,
                                                          num_warps=8), reps=5)
    t_gv = time_graph(lambda: gemv(x, w, out=y), reps=5)
    rd = nb / t_rd * 1e6
    return rd, [f"read-only reduction over {nb / 1e9:.2f} GB: {rd / 1e12:.3f} TB/s ({rd / bw:.3f} of copy)",
                f"shipped gemv, one {w.shape[0]}x{w.shape[1]} weight: {nb / t_gv / 1e6:.3f} TB/s "
                f"({nb / t_gv * 1e6 / bw:.3f} of copy)"]


def gemv_chain(bw: float, rd: float) -> str:
    """The 128 dependent GEMVs of anchor-3b's layers against their bytes at the copy and the read rate."""
    offs, n_el = [], 0
    for _ in range(32):
        for N, K in SHAPES:
            offs.append((n_el, N, K))
            n_el += N * K
    wc = torch.empty(n_el, dtype=torch.bfloat16, device=DEV)
    for o, N, K in offs:
        wc[o:o + N * K].normal_(0, 1.0 / K ** 0.5)
    buf = torch.zeros(2, 12288, dtype=torch.bfloat16, device=DEV)
    buf[0].normal_()

    def chain():
        for p, (o, N, K) in enumerate(offs):
            gemv(buf[p % 2, :K].view(1, K), wc[o:o + N * K].view(N, K), out=buf[(p + 1) % 2, :N].view(1, N))
    t_ch = time_graph(chain)
    r_copy, r_read = n_el * 2 / bw * 1e6, n_el * 2 / rd * 1e6
    return (f"128 dependent GEMVs ({n_el * 2 / 1e9:.2f} GB): {t_ch:.1f} us = {r_copy / t_ch:.3f} of the copy "
            f"roofline ({r_copy:.1f} us), {r_read / t_ch:.3f} of the read rate ({r_read:.1f} us): "
            f"{(t_ch - r_read) / 128:.2f} us per GEMV above streaming")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)     # no options: --help, refusals
    pm = pdl_meta(DEV)
    bw = copy_bandwidth()
    rd, lines = streaming(bw)
    lines = [f"{torch.cuda.get_device_name()} | copy {bw / 1e12:.3f} TB/s"] + lines + [gemv_chain(bw, rd)]
    yb = torch.zeros(1, device=DEV)
    for G in (132, 1056, 5288):
        def empties(G=G):
            for _ in range(128):
                empty_kernel[(G,)](yb, num_warps=2, **pm)
        lines.append(f"empty PDL kernel chain, {G} CTAs: {time_graph(empties, reps=20) / 128:.2f} us per launch")
    cnt = torch.zeros(2, dtype=torch.int32, device=DEV)
    for G in (132, 264, 528):
        t1 = time_graph(lambda: barrier_kernel[(G,)](cnt, cnt[1:], G, 128, num_warps=4, **pm), reps=20)
        t0 = time_graph(lambda: barrier_kernel[(G,)](cnt, cnt[1:], G, 0, num_warps=4, **pm), reps=20)
        lines.append(f"grid barrier, {G} CTAs: {(t1 - t0) / 128:.2f} us per barrier")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
