"""Projection GEMMs of anchor-3b on one GPU, timed inside CUDA graphs (as the engine replays them):
the launch rules of the bs1 GEMV and of the batch-invariant matmul, swept, beside cuBLAS in the same run.

    python3 -m hybridqual.bench.gemm [--out bench_gemm.json] [--quick] [--sections gemv,matmul,invariance,step]

1. M = 1: cuBLAS (F.linear) vs fastpath.kernels.gemv over a grid of launch rules (BLOCK_N, BLOCK_K, warps,
   stages, fixed K split); GB/s = weight bytes / time, beside the device copy bandwidth of this run.
2. M = 64 (and 1, 16 for the winners): cuBLAS vs fastpath.kernels.matmul over tile / stage / K-split rules.
3. cuBLAS with split-K denied (CUBLAS_WORKSPACE_CONFIG=:0:0, CUBLASLT_WORKSPACE_SIZE=0, in a subprocess: the
   variables must be set before CUDA starts): time at M = 64, and whether a row's bits depend on M (rows of
   x[:m] vs x[:64], m in 1..64) — the same invariance check for default cuBLAS and for our matmul.
4. step: whole decode steps with the code's launch rules: batch-64 default vs batch-invariant ms/step (same run),
   and bs1 async+graphs tok/s with cuBLAS vs the Triton GEMV.
Timing: one CUDA graph of `reps` calls cycling over enough weight copies (>= 256 MB) that L2 cannot serve
them; per-call time = replay time / reps, median of 5 replays.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from fastpath.engine.configs import named_config
from hybridqual.bench import arguments
from hybridqual.bench.engine import copy_bandwidth

DEV = torch.device("cuda")


def shapes(config_name: str = "anchor-3b") -> dict[str, tuple[int, int]]:
    """(N, K) of each distinct projection of the named config."""
    c = named_config(config_name)
    d_in_proj = 2 * c.d_inner + 2 * c.mamba_n_groups * c.mamba_d_state + c.mamba_n_heads
    qkv = (c.n_attn_heads + 2 * c.n_kv_heads) * c.attn_head_dim
    return {"in_proj": (d_in_proj, c.hidden_size), "out_proj": (c.hidden_size, c.d_inner),
            "qkv": (qkv, c.hidden_size), "o_proj": (c.hidden_size, c.n_attn_heads * c.attn_head_dim),
            "gate_up": (2 * c.mlp_intermediate_size, c.hidden_size), "down": (c.hidden_size, c.mlp_intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def weights(N: int, K: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """Enough distinct copies of an [N, K] weight to exceed L2 many times over."""
    n = max(2, -(-(256 << 20) // (N * K * 2)))
    g = torch.Generator(device=DEV).manual_seed(N * 7 + K)
    return [torch.randn(N, K, generator=g, device=DEV, dtype=dtype) * K ** -0.5 for _ in range(n)]


def graph_us(fn, ws: list[torch.Tensor], reps: int = 24) -> float:
    """Per-call microseconds of fn(w) inside one CUDA graph of `reps` calls over the weight copies."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in ws[:2]:
            fn(w)                                  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            fn(ws[r % len(ws)])
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    del g
    return sorted(ts[2:])[2]


def sweep_gemv(shp: dict, bw: float, quick: bool) -> dict:
    from fastpath.kernels.gemv import gemv, gemv_launch_rule
    out = {}
    bns, bks = ((4, 8, 16), (512, 1024)) if quick else ((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048, 4096))
    for name, (N, K) in shp.items():
        ws = weights(N, K)
        x = torch.randn(1, K, device=DEV, dtype=torch.bfloat16)
        y = torch.empty(1, N, device=DEV, dtype=torch.bfloat16)
        gb = N * K * 2
        rows = [{"rule": "cublas", "us": graph_us(lambda w: torch.matmul(x, w.t(), out=y), ws)}]
        rows.append({"rule": "gemv default " + str(gemv_launch_rule(N, K)),
                     "us": graph_us(lambda w: gemv(x, w, out=y), ws)})
        for bn, bk, nw, st, sp in itertools.product(bns, bks, (4, 8), (1, 3), (1, 2, 4)):
            if not 2048 <= bn * bk <= 8192 or (sp > 1 and N > 4096) or bk * sp > K:
                continue
            rule = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st, SPLIT=sp)
            try:
                rows.append({"rule": rule, "us": graph_us(lambda w: gemv(x, w, out=y, rule=rule), ws)})
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                rows.append({"rule": rule, "error": f"{type(e).__name__}: {str(e)[:80]}"})
        for r in rows:
            if "us" in r:
                r["GB/s"] = gb / r["us"] / 1e3
                r["pct_copy"] = 100 * gb / (r["us"] * 1e-6) / bw
        ok = [r for r in rows if "us" in r and r["rule"] != "cublas"]
        best = min(ok, key=lambda r: r["us"])
        out[name] = {"N": N, "K": K, "cublas_us": rows[0]["us"], "best": best, "rows": rows}
        print(f"gemv {name:8s} N{N} K{K}: cuBLAS {rows[0]['us']:.1f} us ({rows[0]['pct_copy']:.0f}% copy bw), "
              f"default {rows[1]['us']:.1f}, best {best['us']:.1f} us ({best['pct_copy']:.0f}%) {best['rule']}",
              flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


def sweep_matmul(shp: dict, bw: float, quick: bool, M: int = 64) -> dict:
    from fastpath.kernels.matmul import matmul, matmul_launch_rule
    out = {}
    grid = itertools.product((32, 64, 128), (64, 128), (3, 4) if quick else (3, 4, 5), (1, 2, 4))
    grid = list(grid)
    for name, (N, K) in shp.items():
        ws = weights(N, K)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
        gb = N * K * 2
        rows = [{"rule": "cublas", "us": graph_us(lambda w: torch.matmul(x, w.t(), out=y), ws)},
                {"rule": "matmul default " + str(matmul_launch_rule(N, K)),
                 "us": graph_us(lambda w: matmul(x, w, out=y), ws)}]
        for bn, bk, st, sp in grid:
            if (sp > 1 and N > 4096) or bk * sp > K:
                continue
            rule = dict(BN=bn, BK=bk, num_warps=4 if bn < 128 else 8, num_stages=st, SPLIT=sp)
            try:
                rows.append({"rule": rule, "us": graph_us(lambda w: matmul(x, w, out=y, rule=rule), ws)})
            except Exception as e:  # noqa: BLE001
                rows.append({"rule": rule, "error": f"{type(e).__name__}: {str(e)[:80]}"})
        for r in rows:
            if "us" in r:
                r["pct_copy"] = 100 * gb / (r["us"] * 1e-6) / bw
        ok = [r for r in rows[1:] if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        out[name] = {"N": N, "K": K, "M": M, "cublas_us": rows[0]["us"], "default_us": rows[1]["us"], "best": best,
                     "rows": rows}
        print(f"matmul M{M} {name:8s} N{N} K{K}: cuBLAS {rows[0]['us']:.1f} us, default {rows[1]['us']:.1f}, "
              f"best {best['us']:.1f} us ({best['us'] / rows[0]['us']:.2f}x cuBLAS) {best['rule']}", flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


def invariance(shp: dict, impl: str) -> dict:
    """For each shape: rows of impl(x[:m]) vs impl(x[:130]) for m in 1..130 and under a row permutation
    (bitwise), and the M = 64 time."""
    from fastpath.kernels.matmul import matmul
    res = {}
    for name, (N, K) in shp.items():
        ws = weights(N, K)
        w = ws[0]
        g = torch.Generator(device=DEV).manual_seed(1)
        x = torch.randn(130, K, generator=g, device=DEV, dtype=torch.bfloat16)
        f = (lambda a, ww=w: matmul(a, ww)) if impl == "triton" else (lambda a, ww=w: F.linear(a, ww))
        full = f(x)
        differ = [m for m in range(1, 131) if not torch.equal(f(x[:m]), full[:m])]
        perm = torch.randperm(130, generator=torch.Generator().manual_seed(2)).to(DEV)
        moved = not torch.equal(f(x[perm]), full[perm])
        res[name] = {"m_differing": differ, "row_position_matters": moved,
                     "us_m64": graph_us(lambda ww: f(x[:64], ww), ws)}
        del ws
        torch.cuda.empty_cache()
    return res


def cublas_nows_child() -> None:
    """Runs in a subprocess with cuBLAS workspaces set to 0 (split-K needs workspace)."""
    print("CHILD_JSON " + json.dumps(invariance(shapes(), "cublas")))


def run_nows() -> dict:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":0:0", CUBLASLT_WORKSPACE_SIZE="0")
    p = subprocess.run([sys.executable, "-m", __spec__.name, "--nows-child"], env=env, capture_output=True, text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("CHILD_JSON "):
            return json.loads(line[len("CHILD_JSON "):])
    return {"error": (p.stderr or p.stdout)[-800:]}


def step_figures() -> dict:
    from fastpath.batch_invariant import BatchInvariantModel
    from fastpath.engine.configs import random_device_weights
    from fastpath.model import FastModel
    from hybridqual.bench.engine import bs1_run
    from hybridqual.bench.tp import batch_decode
    cfg = named_config("anchor-3b")
    full = random_device_weights(cfg, DEV, torch.bfloat16, seed=0)
    out = {}
    m_def = FastModel(cfg, full, DEV, torch.bfloat16)
    m_bi = BatchInvariantModel(cfg, full, DEV, torch.bfloat16)
    a = batch_decode(m_def)
    b = batch_decode(m_bi)
    a2 = batch_decode(m_def)
    out["batch64_ms"] = {"default": [a, a2], "batch_invariant": b, "overhead_pct": 100 * (b / min(a, a2) - 1)}
    print(f"batch-64 decode ctx 512: default {a:.3f}/{a2:.3f} ms/step, batch-invariant {b:.3f} "
          f"({out['batch64_ms']['overhead_pct']:+.1f}%)", flush=True)
    del m_bi
    for gvf in (False, True, False, True):
        r = bs1_run(m_def.with_options(gemv=gvf), "async", True, 256, 3, 32)
        out.setdefault("bs1_tok_s", []).append({"gemv": gvf, **r})
        print(f"bs1 async+graphs OSL256 gemv={gvf}: {r.get('tok_s', r)}", flush=True)
    return out


SECTIONS = ("gemv", "matmul", "invariance", "step")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_gemm.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="gemv,matmul,invariance,step",
                    help="comma list of gemv, matmul, invariance, step")
    ap.add_argument("--nows-child", action="store_true")
    args = ap.parse_args(argv)
    if args.nows_child:
        cublas_nows_child()
        return 0
    problem = arguments.first(arguments.comma_names("--sections", args.sections, SECTIONS),
                              arguments.writable_file("--out", args.out))
    if problem:
        return arguments.refuse(problem)
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} copy {bw / 1e12:.2f} TB/s", flush=True)
    shp = shapes()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "copy_TBps": bw / 1e12}

    def save():
        res["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    sections = set(args.sections.split(","))
    if "gemv" in sections:
        res["gemv"] = sweep_gemv(shp, bw, args.quick)
        save()
    if "matmul" in sections:
        res["matmul_m64"] = sweep_matmul(shp, bw, args.quick, 64)
        save()
    if "invariance" in sections:
        res["invariance_triton"] = invariance(shp, "triton")
        res["invariance_cublas_default"] = invariance(shp, "cublas")
        res["invariance_cublas_no_workspace"] = run_nows()
        for k in ("invariance_triton", "invariance_cublas_default", "invariance_cublas_no_workspace"):
            v = res[k]
            if "error" in v:
                print(k, "ERROR", v["error"])
                continue
            print(k, "(M values of 130 whose rows differ, row position matters, us at M=64):",
                  {n: (len(r["m_differing"]), r["row_position_matters"], round(r["us_m64"], 1))
                   for n, r in v.items()}, flush=True)
    if "step" in sections:
        res["step"] = step_figures()
    save()
    print(f"done in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
