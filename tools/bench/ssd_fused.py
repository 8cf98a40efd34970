"""SSD prefill on one GPU: the fused one-launch kernel (fastpath/kernels/ssd_fused.py) beside the staged path
and mamba_ssm's Triton mamba_chunk_scan_combined (peer, when importable from .peer), with the byte floor from
the copy bandwidth measured in the same run.

    PYTHONPATH=.:.peer python3 tools/bench/ssd_fused.py [--out ssd_fused.json] [--lengths 8192,65536] [--quick]

Shape: H128 P64 G1 N128, chunk 256, bf16 x/B/C, fp32 dt and state (the SSD rows of docs/performance.md).
Bytes = x + y + B + C + dt + final state (inputs read once, outputs written once). Every time is the median
of triton.testing.do_bench (CUDA events); every call runs with a slot-checked chunk table (no host sync).
Checks in the same run: fused vs staged and vs mamba_ssm (‖Δ‖/‖ref‖), fused bitwise equal across repeats.
The table printed last is the summary.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from triton.testing import do_bench

from fastpath.kernels.ssd import ssd_chunk_table, ssd_launch_rule, ssd_varlen

DEV = torch.device("cuda")
H, P, G, N, Q = 128, 64, 1, 128, 256


def bench(fn, warmup=25, rep=150) -> float:
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def copy_tbps() -> float:
    x = torch.randn(2 ** 30, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x), 25, 200)
    del x, y
    return 2 * 2 ** 30 * 2 / (t * 1e-3) / 1e12


def peer():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 - no peer: rows without it
        print(f"[ssd_fused] mamba_ssm not importable ({type(e).__name__}: {e}); no peer column")
        return None


def kernel_info() -> str:
    """Registers / spills / shared memory of the last fused launch."""
    from fastpath.kernels import ssd as _ssd
    k = _ssd._FUSED_LAUNCH[0]
    md = getattr(k, "metadata", None)
    return (f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
            f"smem {getattr(md, 'shared', '?')}")


def rule_with(**fused):
    r = ssd_launch_rule(H, G, P, N, Q, torch.bfloat16)
    r["fused"].update(fused)
    return r


VARIANTS = {          # fused-kernel variants timed at the lengths given by --variants-at ("skip": timing only)
    "dt_inside": dict(pre_dt=False),
    "s32": dict(BLOCK_S=32),
    "st1": dict(num_stages=1),
    "noscan": dict(skip=3),
    "nolocal": dict(skip=2),
}


def inputs(lens, seed=0):
    T = sum(lens)
    g = torch.Generator(device=DEV).manual_seed(seed)
    d = dict(x=torch.randn(T, H, P, device=DEV, dtype=torch.bfloat16, generator=g),
             dt=torch.randn(T, H, device=DEV, generator=g) * 0.5 - 2,
             A=-torch.rand(H, device=DEV, generator=g) * 4 - 0.5,
             B=torch.randn(T, G, N, device=DEV, dtype=torch.bfloat16, generator=g))
    d["C"] = torch.randn_like(d["B"])
    d["D"] = torch.randn(H, device=DEV, generator=g)
    d["dtb"] = torch.randn(H, device=DEV, generator=g) * 0.1
    return d


def case(name, lens, start_pos, mamba, variants, results):
    """Time staged / fused (and variants) / mamba_ssm on one packed batch; append a result row."""
    n = len(lens)
    inp = inputs(lens)
    cu = [0]
    for v in lens:
        cu.append(cu[-1] + v)
    T = cu[-1]
    bank0 = torch.randn(n + 1, H, P, N, device=DEV) * 0.1
    slots = list(range(1, n + 1))
    init_l = [i % 2 == 1 for i in range(n)]
    slot, init = torch.tensor(slots, device=DEV), torch.tensor(init_l, device=DEV)
    table = ssd_chunk_table(cu, start_pos, Q, DEV, slot=slots, n_slots=n + 1)
    out = torch.empty_like(inp["x"])
    bank = bank0.clone()

    def run(fused, rule=None):
        return ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dtb"], bank, cu, slot,
                          start_pos, init, Q, out=out, table=table, fused=fused, _rule=rule)

    row = dict(case=name, tokens=T, pieces=n)
    nbytes = 2 * T * H * P * 2 + 2 * T * G * N * 2 + T * H * 4 + n * H * P * N * 4
    row["floor_ms"] = nbytes / (results["copy_TBps"] * 1e12) * 1e3
    # correctness in the same run: staged vs fused, fused repeats bitwise
    bank.copy_(bank0)
    run(False)
    y_s, h_s = out.clone(), bank.clone()
    bank.copy_(bank0)
    run(True)
    y_f, h_f = out.clone(), bank.clone()
    same = True
    for _ in range(3):
        bank.copy_(bank0)
        run(True)
        same &= torch.equal(out, y_f) and torch.equal(bank, h_f)
    row["rel_y_fused_vs_staged"] = rel(y_f, y_s)
    row["rel_h_fused_vs_staged"] = rel(h_f[1:], h_s[1:])
    row["fused_bitwise_repeat"] = bool(same)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(True)
        row["fused_sync_free"] = True
    except RuntimeError:
        row["fused_sync_free"] = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    row["fused_kernel"] = kernel_info()
    row["staged_ms"] = bench(lambda: run(False))
    row["fused_ms"] = bench(lambda: run(True))
    row["staged_ms_2"] = bench(lambda: run(False))       # the spread between two timings of one version
    row["fused_ms_2"] = bench(lambda: run(True))
    if variants:
        for vn, ch in VARIANTS.items():
            try:
                r = rule_with(**ch)
                bank.copy_(bank0)
                run(True, r)
                ok = rel(out, y_f)
                row[f"fused_{vn}_ms"] = bench(lambda: run(True, r))
                row[f"fused_{vn}_rel"] = ok
                row[f"fused_{vn}_kernel"] = kernel_info()
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                row[f"fused_{vn}_ms"] = None
                print(f"[ssd_fused] {name} variant {vn} failed: {type(e).__name__}: {str(e)[:300]}")
    if mamba is not None and n == 1 and start_pos[0] == 0:
        x4, dt4 = inp["x"][None], inp["dt"][None]
        B4, C4 = inp["B"][None], inp["C"][None]
        h0 = bank0[1:2] if init_l[0] else None
        f = lambda: mamba(x4, dt4, inp["A"], B4, C4, Q, D=inp["D"], dt_bias=inp["dtb"], dt_softplus=True,  # noqa: E731
                          initial_states=h0, return_final_states=True)
        y_m, h_m = f()
        row["rel_y_fused_vs_mamba"] = rel(y_f, y_m[0])
        row["rel_h_fused_vs_mamba"] = rel(h_f[1], h_m[0])
        row["mamba_ms"] = bench(f)
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
    del inp, out, bank, bank0
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", default="8192,16384,32768,65536")
    ap.add_argument("--variants-at", default="8192,65536")
    ap.add_argument("--quick", action="store_true", help="no variants, no varlen batches")
    a = ap.parse_args()
    t0 = time.time()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=[])
    import triton
    results["triton"] = triton.__version__
    results["copy_TBps"] = copy_tbps()
    print(f"[ssd_fused] copy {results['copy_TBps']:.2f} TB/s", flush=True)
    mamba = peer()
    vat = {int(v) for v in a.variants_at.split(",") if v}
    for L in [int(v) for v in a.lengths.split(",") if v]:
        case(f"L{L}", [L], [0], mamba, L in vat and not a.quick, results)
    if not a.quick:
        g = torch.Generator().manual_seed(5)
        lens = torch.randint(100, 1000, (64,), generator=g).tolist()
        starts = torch.randint(0, 2048, (64,), generator=g).tolist()
        case("varlen 64 pieces", lens, starts, None, True, results)
        lens = torch.randint(1, 64, (512,), generator=g).tolist()
        starts = torch.randint(0, 4096, (512,), generator=g).tolist()
        case("varlen 512 small", lens, starts, None, True, results)
    results["wall_s"] = time.time() - t0
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{results['device']}, torch {results['torch']}, triton {results['triton']}, {results['date']}, "
          f"copy {results['copy_TBps']:.2f} TB/s")
    hdr = "| case | tokens | staged ms | fused ms | mamba_ssm ms | floor ms | fused/mamba speedup | fused vs staged |"
    print(hdr)
    print("|" + "---|" * 8)
    for r in results["rows"]:
        m = r.get("mamba_ms")
        print(f"| {r['case']} | {r['tokens']} | {r['staged_ms']:.3f} ({r['staged_ms_2']:.3f}) | "
              f"{r['fused_ms']:.3f} ({r['fused_ms_2']:.3f}) | {'%.3f' % m if m else '-'} | {r['floor_ms']:.3f} | "
              f"{'%.2fx' % (m / r['fused_ms']) if m else '-'} | {r['staged_ms'] / r['fused_ms']:.2f}x |")
    for r in results["rows"]:
        vs = {k[6:-3]: v for k, v in r.items() if k.startswith("fused_") and k.endswith("_ms") and k != "fused_ms_2"
              and k != "fused_ms"}
        if vs:
            print(f"variants {r['case']}: " + ", ".join(f"{k} {v:.3f}" if v else f"{k} failed" for k, v in vs.items()))
            print(f"kernels {r['case']}: default {r['fused_kernel']}; " + "; ".join(
                f"{k} {r.get(f'fused_{k}_kernel', '')}" for k in vs))
        print(f"checks {r['case']}: rel y/h fused vs staged {r['rel_y_fused_vs_staged']:.1e}/"
              f"{r['rel_h_fused_vs_staged']:.1e}, vs mamba {r.get('rel_y_fused_vs_mamba', float('nan')):.1e}/"
              f"{r.get('rel_h_fused_vs_mamba', float('nan')):.1e}, bitwise repeat {r['fused_bitwise_repeat']}, "
              f"sync-free {r['fused_sync_free']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
