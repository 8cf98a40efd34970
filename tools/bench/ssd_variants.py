"""SSD prefill variants on one GPU: the staged path with its scan (and chunk-state) stage swapped for the
multi-head scans (fastpath/kernels/ssd_scan_mh.py, ssd_scan_blk_mh.py), the scan and chunk state through tensor
descriptors (ssd_scan_tma.py, ssd_state_tma.py) and launch options, beside the default
staged path, the fused path, mamba_ssm (when importable from .peer) and the byte floor, in one run.

    PYTHONPATH=.:.peer python3 tools/bench/ssd_variants.py [--out v.json] [--lengths 65536,8192] [--budget-s 300]
        [--only NAME,NAME] [--fused-grid L]

Shape: H128 P64 G1 N128, chunk 256, bf16 x/B/C, fp32 dt and state (tools/bench/ssd_fused.py's inputs). Per
length and variant: end-to-end median (do_bench), per-stage medians (CUDA events around each stage; "host": from
an event recorded before the call, on an idle GPU, to the first launch, i.e. the host's checks and set-up), the
scan kernel's registers / spills, ‖Δ‖/‖ref‖ of y and of the final state vs the default staged path, and whether
two runs are bitwise equal. Variants run longest length first, in the order of VARIANTS, until the time budget
is spent; then the best scan and the best state variant at the first length are timed together. The table
printed last is the summary.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time

import torch

from fastpath.kernels import ssd as _ssd
from fastpath.kernels.ssd import ssd_chunk_table, ssd_launch_rule, ssd_varlen

try:
    from .ssd_fused import DEV, G, H, N, P, Q, bench, copy_tbps, inputs, peer, rel
except ImportError:                      # run as a script: tools/bench is on sys.path
    from ssd_fused import DEV, G, H, N, P, Q, bench, copy_tbps, inputs, peer, rel

STAGES = ("host", "cumsum", "bmm", "state", "scan", "fused")
REL_OK = 5e-3            # ‖Δy‖/‖y‖ vs the staged path under which a variant counts as right
# name -> (scan entry updates, state entry updates[, fused entry updates: the fused path]), updates to the launch rule
# of the day (the state_* entries written before e3f7e9b were timed against 64-wide N-tiles, 4 warps, 3 stages)
VARIANTS: dict[str, tuple] = {
    "staged": ({}, {}),
    # the fused path (one launch) at shapes with less spill at sm_90 (triton 3.6: 616 B a thread at its rule,
    # 16 at 8 warps, none at 8 warps with 32-token sub-chunks; `hybridqual bench sass --kernels ssd_fused`)
    # (H100, triton 3.6, 2026-12-05: every one slower than staged; fused_w8_s32 and fused_s32 gave wrong, unrepeatable
    # y, their pipelined loop computing C·Bᵀ in 2 stages, before ssd_fused.scan_stages unpipelined that loop)
    "fused_w8": ({}, {}, dict(num_warps=8)),
    "fused_w8_s32": ({}, {}, dict(num_warps=8, BLOCK_S=32)),
    "fused_w8_s32_cb": ({}, {}, dict(num_warps=8, BLOCK_S=32, use_cb=True)),
    "fused_w8_s32_st1": ({}, {}, dict(num_warps=8, BLOCK_S=32, num_stages=1)),
    "fused_s32": ({}, {}, dict(BLOCK_S=32)),
    # spill-free at sm_90 with triton 3.6 (`hybridqual bench sass`, docs/performance.md "Kernels, compiled")
    "walk_cb_k32_w8": (dict(kind="walk", use_cb=True, BLOCK_M=64, BLOCK_K=32, num_warps=8, num_stages=1), {}),
    "rec_s32_w8": (dict(BLOCK_S=32, num_warps=8, num_stages=1), {}),
    "walk_cb_m32_k32": (dict(kind="walk", use_cb=True, BLOCK_M=32, BLOCK_K=32, num_stages=1), {}),
    # 208 B of spill (4 warps), C·Bᵀ per head (no precomputed matrix)
    "walk_cb_k32_s1": (dict(kind="walk", use_cb=True, BLOCK_M=64, BLOCK_K=32, num_stages=1), {}),
    "walk_k32_s1": (dict(kind="walk", BLOCK_M=64, BLOCK_K=32, num_stages=1), {}),
    "rec_r128": (dict(maxnreg=128), {}),
    "rec_r168": (dict(maxnreg=168), {}),
    "rmh2_w4": (dict(kind="rec_mh", HEADS=2), {}),
    "rmh2_w8": (dict(kind="rec_mh", HEADS=2, num_warps=8), {}),
    "rmh2_w4_s1": (dict(kind="rec_mh", HEADS=2, num_stages=1), {}),
    "rmh4_w8": (dict(kind="rec_mh", HEADS=4, num_warps=8), {}),
    "rmh4_w8_s1": (dict(kind="rec_mh", HEADS=4, num_warps=8, num_stages=1), {}),
    "rmh2_p32": (dict(kind="rec_mh", HEADS=2, BLOCK_P=32), {}),
    "rmh4_p32_w8": (dict(kind="rec_mh", HEADS=4, BLOCK_P=32, num_warps=8), {}),
    "rmh2_s32": (dict(kind="rec_mh", HEADS=2, BLOCK_S=32), {}),
    "bmh2_w4": (dict(kind="blocked_mh", HEADS=2), {}),
    "bmh4_w4": (dict(kind="blocked_mh", HEADS=4), {}),
    "bmh4_w8": (dict(kind="blocked_mh", HEADS=4, num_warps=8), {}),
    "bmh4_k32_s3": (dict(kind="blocked_mh", HEADS=4, BLOCK_K=32, num_stages=3), {}),
    "bmh4_m128_w8": (dict(kind="blocked_mh", HEADS=4, BLOCK_M=128, num_warps=8), {}),
    "bmh2_r128": (dict(kind="blocked_mh", HEADS=2, maxnreg=128), {}),
    "bmh1_w4": (dict(kind="blocked_mh", HEADS=1), {}),
    "state_k32_w8": ({}, dict(BLOCK_K=32, num_warps=8)),          # spill-free (3.6), the default's 256 walkers
    "state_p32_n32_k32_w8": ({}, dict(BLOCK_P=32, BLOCK_N=32, BLOCK_K=32, num_warps=8)),   # 1024 walkers, 120 regs
    "state_p32": ({}, dict(BLOCK_P=32)),
    "state_p32_n32": ({}, dict(BLOCK_P=32, BLOCK_N=32)),
    "state_par": ({}, dict(mode="parallel")),
    # more walkers at the 64-row P-tile (the warp-group MMA kept: its M is P), narrower N-tiles of the state
    "state_n32": ({}, dict(BLOCK_N=32)),
    "state_n32_s4": ({}, dict(BLOCK_N=32, num_stages=4)),
    "state_n32_w8": ({}, dict(BLOCK_N=32, num_warps=8)),
    "state_n16": ({}, dict(BLOCK_N=16)),
    "state_n16_s4": ({}, dict(BLOCK_N=16, num_stages=4)),
    "state_k128": ({}, dict(BLOCK_K=128)),
    # the chunk-state tiles of the rule before e3f7e9b (64-wide N-tiles, 4 warps, 3 stages)
    "state_n64_w4_s3": ({}, dict(BLOCK_N=64, num_warps=4, num_stages=3)),
    "state_s5": ({}, dict(num_stages=5)),
    "state_s6": ({}, dict(num_stages=6)),
    "state_k32_s6": ({}, dict(BLOCK_K=32, num_stages=6)),
    # fewer walkers: one per head (x read once, not once per N-tile)
    "state_n128": ({}, dict(BLOCK_N=128)),
    "state_n128_w8": ({}, dict(BLOCK_N=128, num_warps=8)),
    "state_n128_k32_w8": ({}, dict(BLOCK_N=128, BLOCK_K=32, num_warps=8)),
    "state_n128_w8_s2": ({}, dict(BLOCK_N=128, num_warps=8, num_stages=2)),
    "state_n128_w8_s4": ({}, dict(BLOCK_N=128, num_warps=8, num_stages=4)),
    "state_n128_k128_w8": ({}, dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2)),
    "rec_s1": (dict(num_stages=1), {}),
    # 32-row P-tiles at 4 warps: half the state a program, two programs an SM in the walk (256 walkers) and up to
    # four in the scan under a register cap, at the price of B (and C·Bᵀ in the scan) once per P-tile
    "state_p32_w4": ({}, dict(BLOCK_P=32, num_warps=4)),
    "state_p32_w4_s3": ({}, dict(BLOCK_P=32, num_warps=4, num_stages=3)),
    "state_p32_w4_r128": ({}, dict(BLOCK_P=32, num_warps=4, maxnreg=128)),
    "rec_p32": (dict(BLOCK_P=32), {}),
    "rec_p32_r128": (dict(BLOCK_P=32, maxnreg=128), {}),
    "rec_p32_r168": (dict(BLOCK_P=32, maxnreg=168), {}),
    # the scan shape of vLLM's fused SSD kernel (ssd_fused5.py: C·Bᵀ once per group, 64-row × 32-column blocks,
    # 1 stage, 128 registers; it reads the entering state again per row block), per chunk (walk) or per row block
    "walk_cb_k32_s1_r128": (dict(kind="walk", use_cb=True, BLOCK_M=64, BLOCK_K=32, num_stages=1, maxnreg=128), {}),
    "blk_cb_k32_s1_r128": (dict(kind="blocked", use_cb=True, BLOCK_M=64, BLOCK_K=32, num_stages=1, maxnreg=128), {}),
    "blk_cb_k32_s1": (dict(kind="blocked", use_cb=True, BLOCK_M=64, BLOCK_K=32, num_stages=1), {}),
    "state_par_k32_r128": ({}, dict(mode="parallel", BLOCK_K=32, BLOCK_N=128, num_stages=1, maxnreg=128)),
    # C·Bᵀ stored in bf16 (half the L2 bytes each head reads; it is rounded to bf16 for the dot with x anyway)
    "walk_cb16_k32_s1": (dict(kind="walk", use_cb=True, cb_fp32=False, BLOCK_M=64, BLOCK_K=32, num_stages=1), {}),
    "blk_cb16_k32_s1": (dict(kind="blocked", use_cb=True, cb_fp32=False, BLOCK_M=64, BLOCK_K=32, num_stages=1), {}),
    "blk_cb16_k64_s2": (dict(kind="blocked", use_cb=True, cb_fp32=False, BLOCK_M=64, BLOCK_K=64, num_stages=2), {}),
    # rec through tensor descriptors (ssd_scan_tma.py): H200 2026-12-06, scan 3.195 ms vs rec 2.578 at 64k
    "rec_tma": (dict(kind="rec_tma"), {}),
    "rec_tma_s1": (dict(kind="rec_tma", num_stages=1), {}),
    "rec_tma_w8_s1": (dict(kind="rec_tma", num_warps=8, num_stages=1), {}),
    # the chunk-state walk through tensor descriptors (ssd_state_tma.py): H200 2026-12-06, 1.398 ms vs 1.359
    "state_tma": ({}, dict(mode="tma")),
    "state_tma_s2": ({}, dict(mode="tma", num_stages=2)),
    "tma_both": (dict(kind="rec_tma"), dict(mode="tma")),
    # the walk cut into segments of this many chunks on a side stream, each segment's scan overlapping the next
    # segments' walk (state key segment_chunks; one sequence only)
    "overlap_c8": ({}, dict(segment_chunks=8)),
    "overlap_c16": ({}, dict(segment_chunks=16)),
    "overlap_c32": ({}, dict(segment_chunks=32)),
    "overlap_c64": ({}, dict(segment_chunks=64)),
}
CHUNK = Q                # --chunk: the SSD chunk of every variant and of mamba_ssm in this run


def rule_for(scan: dict, state: dict, fused: dict | None = None) -> dict:
    """The launch rule with a variant's scan, state (and fused) entries (a scan entry's `use_cb` and `cb_fp32` are
    the rule's own keys); a variant with a fused entry runs the fused path."""
    r = copy.deepcopy(ssd_launch_rule(H, G, P, N, CHUNK, torch.bfloat16))
    r["fused"].update(fused or {})
    r["fused"]["default"] = fused is not None
    scan = dict(scan)
    r["use_cb"] = scan.pop("use_cb", r["use_cb"])
    r["cb_fp32"] = scan.pop("cb_fp32", r["cb_fp32"])
    r["scan"].update(scan)
    r["state"].update(state)
    return r


def kinfo(k) -> str:
    md = getattr(k, "metadata", None)
    return f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} smem {getattr(md, 'shared', '?')}"


def stage_ms(fn, reps: int = 20) -> dict:
    """Median per-stage times (ms) over `reps` runs, from CUDA events recorded at each stage mark."""
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    for _ in range(reps):
        evs = [("start", torch.cuda.Event(enable_timing=True))]
        evs[0][1].record()

        def mark(stage, evs=evs):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            evs.append((stage, e))
        fn(mark)
        torch.cuda.synchronize()
        for (_, a), (s, b) in zip(evs, evs[1:]):
            if s in times:
                times[s].append(a.elapsed_time(b))
    return {s: sorted(v)[len(v) // 2] for s, v in times.items() if v}


class Case:
    """One packed batch of one sequence of L tokens (initial state from its bank slot), reused by every variant."""

    def __init__(self, L: int):
        self.L = L
        self.inp = inputs([L])
        self.cu = [0, L]
        self.bank0 = torch.randn(2, H, P, N, device=DEV) * 0.1
        self.bank = self.bank0.clone()
        self.slot, self.init = torch.tensor([1], device=DEV), torch.tensor([True], device=DEV)
        self.table = ssd_chunk_table(self.cu, [0], CHUNK, DEV, slot=[1], n_slots=2)
        self.out = torch.empty_like(self.inp["x"])

    def run(self, rule=None, fused=None, mark=None):
        """`fused` None: the rule's `fused.default` (set by rule_for for a fused variant)."""
        i = self.inp
        if fused is None:
            fused = bool(rule and rule["fused"].get("default"))
        return ssd_varlen(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dtb"], self.bank, self.cu, self.slot,
                          [0], self.init, CHUNK, out=self.out, table=self.table, fused=fused, _rule=rule, _mark=mark)

    def result(self, rule=None, fused=None):
        self.bank.copy_(self.bank0)
        self.run(rule, fused)
        return self.out.clone(), self.bank[1].clone()


def time_variant(case: Case, name: str, rule: dict, ref) -> dict:
    row = dict(variant=name, L=case.L)
    try:
        y, h = case.result(rule)
        y2, h2 = case.result(rule)
        row.update(rel_y=rel(y, ref[0]), rel_h=rel(h, ref[1]),
                   bitwise=bool(torch.equal(y, y2) and torch.equal(h, h2)))
        row["scan_kernel"] = kinfo(_ssd._FUSED_LAUNCH[0] if rule["fused"]["default"] else _ssd._SCAN_LAUNCH[0])
        row["ms"] = bench(lambda: case.run(rule))
        row["stages"] = stage_ms(lambda m: case.run(rule, mark=m))
    except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
    return row


def fused_grid(L: int) -> list[dict]:
    """Correctness of the fused path over (BLOCK_S, num_stages, num_warps, precomputed C·Bᵀ), no timing: rel y and
    rel h vs the staged path and whether two runs are bitwise equal (the shapes where the compiled loop is right)."""
    case = Case(L)
    ref = case.result(rule_for({}, {}))
    rows = []
    for S, st, w, cb in itertools.product((16, 32, 64), (1, 2, 3), (4, 8), (False, True)):
        row = dict(L=L, BLOCK_S=S, num_stages=st, num_warps=w, use_cb=cb)
        rule = rule_for({}, {}, dict(BLOCK_S=S, num_stages=st, num_warps=w, use_cb=cb))
        try:
            (y, h), (y2, h2) = case.result(rule), case.result(rule)
            row.update(rel_y=rel(y, ref[0]), rel_h=rel(h, ref[1]), repeatable=bool(torch.equal(y, y2)))
        except Exception as e:  # noqa: BLE001 - a shape that does not compile is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        print(" ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fused-grid", type=int, default=0, metavar="L",
                    help="only check the fused path's shapes for correctness at L tokens (no timing)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", default="65536,8192")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting variants after this many seconds")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--chunk", type=int, default=Q, help=f"SSD chunk size of the run (default {Q}, the model's)")
    ap.add_argument("--peer-chunk", type=int, default=0,
                    help="mamba_ssm's chunk size (default: the run's --chunk; the model's is %d)" % Q)
    ap.add_argument("--once", type=int, default=0, metavar="L",
                    help="run each --only variant (default staged) twice at L tokens and stop (for a profiler)")
    a = ap.parse_args()
    global CHUNK
    CHUNK = a.chunk
    peer_chunk = a.peer_chunk or a.chunk
    if a.once:
        case = Case(a.once)
        for vn in [v for v in a.only.split(",") if v] or ["staged"]:
            for _ in range(2):
                case.run(rule_for(*VARIANTS[vn]))
            torch.cuda.synchronize()
            print(f"[ssd_variants] {vn} at L{a.once}: ran twice", flush=True)
        return
    if a.fused_grid:
        rows = fused_grid(a.fused_grid)
        bad = [r for r in rows if "error" in r or r["rel_y"] > REL_OK or not r["repeatable"]]
        print(f"fused grid at L{a.fused_grid}: {len(rows) - len(bad)}/{len(rows)} shapes right and repeatable")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    t0 = time.time()
    import triton
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, chunk=CHUNK,
               peer_chunk=peer_chunk, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=[], base=[])
    res["copy_TBps"] = copy_tbps()
    print(f"[ssd_variants] copy {res['copy_TBps']:.2f} TB/s", flush=True)
    mamba = peer()
    names = [v for v in (a.only.split(",") if a.only else VARIANTS) if v]
    lengths = [int(v) for v in a.lengths.split(",") if v]
    for li, L in enumerate(lengths):
        case = Case(L)
        ref = case.result(rule_for({}, {}))
        T = L
        base = dict(L=L, floor_ms=(2 * T * H * P * 2 + 2 * T * G * N * 2 + T * H * 4 + H * P * N * 4)
                    / (res["copy_TBps"] * 1e12) * 1e3)
        base["fused_ms"] = bench(lambda: case.run(fused=True))
        yf, hf = case.result(fused=True)
        base["rel_y_fused"] = rel(yf, ref[0])
        if mamba is not None:
            i = case.inp
            f = lambda: mamba(i["x"][None], i["dt"][None], i["A"], i["B"][None], i["C"][None], peer_chunk, D=i["D"],  # noqa: E731
                              dt_bias=i["dtb"], dt_softplus=True, initial_states=case.bank0[1:2],
                              return_final_states=True)
            ym, hm = f()
            base["rel_y_mamba"], base["rel_h_mamba"] = rel(ym[0], ref[0]), rel(hm[0], ref[1])
            base["mamba_ms"] = bench(f)
        res["base"].append(base)
        print(json.dumps(base), flush=True)
        for vn in names:
            if time.time() - t0 > a.budget_s:
                print(f"[ssd_variants] budget spent: {vn} at L{L} skipped", flush=True)
                continue
            res["rows"].append(time_variant(case, vn, rule_for(*VARIANTS[vn]), ref))
        if li == 0 and time.time() - t0 < a.budget_s:
            ok = [r for r in res["rows"] if r["L"] == L and "ms" in r and r["rel_y"] < REL_OK and r["bitwise"]
              and len(VARIANTS[r["variant"]]) == 2]
            best = lambda pick: min((r for r in ok if pick(VARIANTS[r["variant"]])), key=lambda r: r["ms"],  # noqa: E731
                                    default=None)
            bs, bt = best(lambda v: not v[1]), best(lambda v: not v[0])
            if bs and bt and bs["variant"] != "staged" and bt["variant"] != "staged":
                combo = (bs["variant"], bt["variant"])
                VARIANTS["+".join(combo)] = (VARIANTS[combo[0]][0], VARIANTS[combo[1]][1])
                names.append("+".join(combo))
                res["rows"].append(time_variant(case, "+".join(combo), rule_for(*VARIANTS["+".join(combo)]), ref))
        del case
        torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    summary(res)


def summary(res: dict) -> None:
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}, chunk {res.get('chunk', Q)}, "
          f"{res['date']}, copy {res['copy_TBps']:.2f} TB/s, wall {res['wall_s']:.0f} s")
    for b in res["base"]:
        m = b.get("mamba_ms")
        print(f"L{b['L']}: floor {b['floor_ms']:.3f} ms, fused {b['fused_ms']:.3f} ms "
              f"(rel y {b['rel_y_fused']:.1e}), "
              f"mamba_ssm {'%.3f ms' % m if m else '-'} (chunk {res.get('peer_chunk', res.get('chunk', Q))})"
              + (f" (rel y/h vs staged {b['rel_y_mamba']:.1e}/{b['rel_h_mamba']:.1e})" if m else ""))
    print("| L | variant | ms | x mamba | host | cumsum | state | scan | rel y | rel h | bitwise | scan kernel |")
    print("|" + "---|" * 12)
    mam = {b["L"]: b.get("mamba_ms") for b in res["base"]}
    for r in sorted(res["rows"], key=lambda r: (-r["L"], r.get("ms", 1e9))):
        if "error" in r:
            print(f"| {r['L']} | {r['variant']} | failed: {r['error'][:80]} |")
            continue
        st, m = r["stages"], mam.get(r["L"])
        print(f"| {r['L']} | {r['variant']} | {r['ms']:.3f} | {'%.2f' % (m / r['ms']) if m else '-'} | "
              f"{st.get('host', 0):.3f} | {st.get('cumsum', 0):.3f} | {st.get('state', 0):.3f} | "
              + (f"{st['scan']:.3f}" if "scan" in st else f"fused {st.get('fused', 0):.3f}") + f" | {r['rel_y']:.1e} | "
              f"{r['rel_h']:.1e} | {r['bitwise']} | {r['scan_kernel']} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
