"""Benchmark the fast-path engine on one GPU (DESIGN §8): anchor-3b, random bf16 weights.

    PYTHONPATH=. python3 tools/bench/engine.py [--out bench_engine.json] [--summary bench_engine.summary] [--quick]

1. bs1 decode, the seed protocol: 4 requests one after another (bs1), OSL 512, the first discarded as warm-up
   (eager rows: 2 requests, one timed — they are host-bound, so they only bound the run's time);
   tok/s for legacy and async, CUDA graphs on/off, beside the roofline (parameter bytes / copy bandwidth
   measured in this run) and the host time per step (step wall time minus time blocked on the device).
2. Hidden syncs: torch.profiler over async+graphs decode steps, CUDA runtime synchronisations per step.
   The async+graphs case runs twice: with the fused decode kernels (FastOptions.fused, the default) and without
   (the unfused torch ops), so before/after come from the same run.
   --profile: the device kernel table of graph-replayed bs1 decode steps (torch.profiler), fused and unfused,
   and the achieved bandwidth of each bs1 projection (M = 1 GEMM through F.linear, cold weights).
3. Batch-64 decode at 32k context, anchor-3b vs anchor-3b-attn (the context is placed in the bank's
   bookkeeping without running the prefill: decode cost depends only on positions; attention reads them all).
4. --prefix-cache (only): TTFT of a 100-token suffix after a 32k shared prefix, cold vs prefix-cache hit, then one
   more hit timed by stage (validate, lookup, restore, forward, sample, resolve: host and CUDA-event device
   times) and one under torch.profiler (top-10 kernels by device time, launches, syncs), printed last.
   `--prefix-cache --tiny`: the same code path on a tiny model in seconds (CPU: TRITON_INTERPRET=1), a smoke run.
5. The long prefill (`--long-only`: only it): a 131,072-token prompt at bs1 in 16,384-token pieces, after a warm-up
   request that compiles the kernels; time to the first token and decode time; memory predicted vs peak.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import triton

from fastpath.engine.configs import n_params, named_config, random_device_weights
from fastpath.engine.engine import Engine
from fastpath.kernels.gemv import gemv, gemv_launch_rule
from fastpath.model import FastModel
from hybridqual.bench import arguments
from oracle.schedule_log import StepRecord
from oracle.trace import EngineConfig, Request

DEV = torch.device("cuda")


def sync() -> None:
    """Wait for the device (no-op on the CPU smoke run)."""
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write counted), median of 20."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEV)
    b = torch.empty_like(a)
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    t = sorted(times[5:])[len(times[5:]) // 2]
    del a, b
    return 2 * nbytes / t


def bs1_run(model: FastModel, mode: str, graphs: bool, osl: int, n_req: int, prompt_len: int) -> dict:
    """Seed protocol: n_req requests one at a time; decode tok/s over requests 2..n (first = warm-up)."""
    C = model.config.chunk_size
    ec = EngineConfig(1, max(C, prompt_len), max(C, prompt_len), mode)
    eng = Engine(model, ec, max_len=prompt_len + osl + 8, graphs=graphs)
    rates, host = [], []
    for i in range(n_req):
        eng.reset(mode)
        prompt = tuple((17 * i + 7 * j) % 32000 for j in range(prompt_len))
        eng.add_request(Request(f"q{i}", 0, prompt, osl))
        eng.step()                                    # admission + prefill (samples token 1)
        sync()
        eng.wait_s, steps = 0.0, 0
        t0 = time.perf_counter()
        while eng.step():
            steps += 1
        sync()
        dt = time.perf_counter() - t0
        out = len(eng.requests[f"q{i}"].output)
        if i > 0:
            rates.append((out - 1) / dt)
            host.append((dt - eng.wait_s) / max(steps, 1))
    return {"mode": mode, "graphs": graphs, "tok_s": sum(rates) / len(rates),
            "host_ms_per_step": 1e3 * sum(host) / len(host), "osl": osl, "requests_timed": len(rates)}


def kernel_table(model: FastModel, steps: int = 24, top: int = 18, graphs: bool = True, prompt_len: int = 32,
                 spec=None) -> dict:
    """Device kernels of async bs1 decode steps (torch.profiler over graph replays; graphs=False: the same padded
    shapes eagerly): per-step count and µs by kernel name, the per-step kernel sum and the step's wall time.
    spec (an oracle SpecConfig for request "p"): the steps are speculative (verify + rollback) instead."""
    from torch.profiler import ProfilerActivity, profile
    C = model.config.chunk_size
    budget = max(256, -(-prompt_len // C) * C)
    eng = Engine(model, EngineConfig(1, budget, budget, "async", spec), max_len=prompt_len + steps + 1024,
                 graphs=graphs, pad_decode=not graphs)
    if eng.spec is not None:
        eng.spec.runner.capture_all()
    eng.add_request(Request("p", 0, tuple(1 + i % 31999 for i in range(prompt_len)), steps + 40))
    for _ in range(12):
        eng.step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    agg: dict[str, list[float]] = {}
    spans: list[tuple[str, float, float]] = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy"):
            a = agg.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.time_range.elapsed_us()
            spans.append((e.name, e.time_range.start, e.time_range.end))
    rows = sorted(((n, c / steps, us / steps) for n, (c, us) in agg.items()), key=lambda r: -r[2])
    del eng
    if not rows and graphs:                           # the profiler saw no kernels inside graphs: eager instead
        return kernel_table(model, steps, top, graphs=False, prompt_len=prompt_len, spec=spec)
    excl = {n: us / steps for n, us in exclusive_us(spans).items()}
    return {"graphs": graphs, "wall_ms_per_step": 1e3 * wall, "kernel_us_per_step": sum(r[2] for r in rows),
            "busy_us_per_step": sum(excl.values()), "launches_per_step": sum(r[1] for r in rows),
            "top": [list(r) for r in rows[:top]], "exclusive_us": excl}


def exclusive_us(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """Each kernel name's time on the device timeline that no earlier-started kernel already covers: a kernel that
    starts before its predecessor ends (programmatic dependent launch, or concurrent streams) is charged only from
    the latest end seen so far to its own end (nothing, if it ends before). The values add up to the union of the
    spans (the device's busy time), so a step's wall time = their sum + the idle time between kernels, never less."""
    out: dict[str, float] = {}
    covered = -math.inf
    for name, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        out[name] = out.get(name, 0.0) + max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return out


def gemv_bandwidth(model: FastModel, copies: int = 6, reps: int = 30) -> list[dict]:
    """Median time of each bs1 projection F.linear(x[1, K], W[N, K]) over `copies` distinct weights (cold in L2),
    and its achieved TB/s on the weight bytes."""
    c = model.config
    shapes = {"mamba.in_proj": (2 * c.d_inner + 2 * c.mamba_n_groups * c.mamba_d_state + c.mamba_n_heads,
                                c.hidden_size), "mamba.out_proj": (c.hidden_size, c.d_inner),
              "mlp.gate_up": (2 * c.mlp_intermediate_size, c.hidden_size),
              "mlp.down_proj": (c.hidden_size, c.mlp_intermediate_size),
              "attn.q_proj": (c.n_attn_heads * c.attn_head_dim, c.hidden_size),
              "attn.k_proj": (c.n_kv_heads * c.attn_head_dim, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size)}
    out = []
    for name, (N, K) in shapes.items():
        ws = [torch.randn(N, K, device=DEV, dtype=model.dtype) for _ in range(copies)]
        x = torch.randn(1, K, device=DEV, dtype=model.dtype)
        for w in ws:
            torch.nn.functional.linear(x, w)
        times = []
        for r in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.nn.functional.linear(x, ws[r % copies])
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        t = sorted(times)[len(times) // 2]
        row = {"proj": name, "N": N, "K": K, "us": 1e6 * t, "TBps": 2 * N * K / t / 1e12}
        base = gemv_launch_rule(N, K)
        variants = {"rule": {}, "bn*2": {"BLOCK_N": 2 * base["BLOCK_N"]}, "bn/2": {"BLOCK_N": max(1, base["BLOCK_N"] // 2)},
                    "bk*2": {"BLOCK_K": min(triton.next_power_of_2(K), 2 * base["BLOCK_K"])},
                    "bk/2": {"BLOCK_K": max(32, base["BLOCK_K"] // 2)}, "w8": {"num_warps": 8}, "w2": {"num_warps": 2}}
        for vname, rule in variants.items():
            try:
                for w in ws:
                    gemv(x, w, rule=rule)
                times = []
                for r in range(reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    gemv(x, ws[r % copies], rule=rule)
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / 1e3)
                t = sorted(times)[len(times) // 2]
                row["triton_" + vname] = round(2 * N * K / t / 1e12, 3)
            except Exception as ex:
                row["triton_" + vname] = f"{type(ex).__name__}"
        out.append(row)
        del ws
    return out


def _profiled_syncs(eng: Engine, steps: int) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
    counts: dict[str, int] = {}
    for e in prof.events():
        if "ynchronize" in e.name or e.name in ("cudaMemcpy", "aten::item", "aten::_local_scalar_dense"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def count_syncs(model: FastModel, short: int = 8, long: int = 40) -> dict:
    """CUDA runtime syncs per async+graphs decode step: (count over `long` steps - over `short`) / (long - short),
    which cancels the profiler's own per-window synchronisation."""
    ec = EngineConfig(1, 256, 256, "async")
    eng = Engine(model, ec, max_len=1024, graphs=True)
    eng.add_request(Request("s", 0, (1, 2, 3, 4), short + long + 32))
    for _ in range(8):
        eng.step()
    a, b = _profiled_syncs(eng, short), _profiled_syncs(eng, long)
    names = sorted(set(a) | set(b))
    return {"steps": (short, long), "per_step": {k: (b.get(k, 0) - a.get(k, 0)) / (long - short) for k in names},
            "raw": {"short": a, "long": b}}


def batch_decode(model: FastModel, rows: int, ctx: int, steps: int) -> dict:
    """`rows` requests decoding at context `ctx` (placed in the bookkeeping), graphs + async; tok/s."""
    C = model.config.chunk_size
    ec = EngineConfig(rows, rows - 1 + C, C, "async")
    eng = Engine(model, ec, max_len=ctx + steps + 8, graphs=True)
    for i in range(rows):
        eng.add_request(Request(f"b{i}", 0, (1,) * ctx, steps + 4))
    eng.admit(StepRecord(0))
    for st in eng.requests.values():                  # as if the prompt had been prefilled
        st.done, st.output = ctx, [1]
    for _ in range(3):
        eng.step()
    sync()
    t0 = time.perf_counter()
    n = steps - 6
    for _ in range(n):
        eng.step()
    sync()
    dt = time.perf_counter() - t0
    res = {"rows": rows, "ctx": ctx, "tok_s": rows * n / dt, "ms_per_step": 1e3 * dt / n,
           "bank_GB": eng.bank.nbytes() / 1e9}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return res


def long_prefill(model: FastModel, prompt_len: int = 131072, osl: int = 64, chunk: int = 16384) -> dict:
    """One prompt_len-token prompt at bs1 (chunked prefill, then graphs + async decode): completes? its prefill
    time (to the first token) and decode time, after a warm-up request of two pieces that compiles the kernels (so
    the figure does not hold the JIT's first compile), and the engine's memory prediction (printed before the run)
    against the measured peak."""
    from fastpath.engine.memory import predict
    gc.collect()
    torch.cuda.empty_cache()
    eng = Engine(model, EngineConfig(1, chunk, chunk, "async"), max_len=prompt_len + osl + 8, graphs=True)
    pred = predict(eng)
    print("long prefill: predicted peak " + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in pred.items()),
          flush=True)
    prompt = tuple((11 * j) % 32000 for j in range(prompt_len))
    t0 = time.perf_counter()
    eng.add_request(Request("warm", 0, prompt[:min(prompt_len, chunk + 1)], 2))
    while eng.step():
        pass
    sync()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    eng.add_request(Request("long", eng.k, prompt, osl))
    t0 = time.perf_counter()
    first = None
    while eng.step():
        if first is None and eng.requests["long"].output:
            sync()
            first = time.perf_counter() - t0
    sync()
    total = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    first = total if first is None else first
    res = {"prompt": prompt_len, "generated": len(eng.requests["long"].output), "seconds": total,
           "prefill_s": first, "prefill_tok_s": prompt_len / first, "decode_s": total - first, "warmup_s": warm_s,
           "graph_replays": eng.graphs.replays, "predicted_GiB": pred["total"] / 2**30, "peak_GiB": peak / 2**30,
           "error_pct": 100 * (pred["total"] - peak) / peak}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return res


GEMV_VARIANTS = {      # name -> rule(N, K); None = the code's rule
    "rule now": None,
    "whole K, 2 rows, 8 warps": lambda N, K: dict(BLOCK_N=2, BLOCK_K=triton.next_power_of_2(K), SPLIT=1,
                                                  num_warps=8, num_stages=1),
    "whole K, 4 rows, 8 warps": lambda N, K: dict(BLOCK_N=4, BLOCK_K=triton.next_power_of_2(K), SPLIT=1,
                                                  num_warps=8, num_stages=1),
    "1024-wide K, 4 rows, 8 warps": lambda N, K: dict(BLOCK_N=4, BLOCK_K=1024, SPLIT=1, num_warps=8, num_stages=3),
    "2048-wide K, 2 rows, 8 warps": lambda N, K: dict(BLOCK_N=2, BLOCK_K=2048, SPLIT=1, num_warps=8, num_stages=1),
    "rule now, x in the weight tile's layout (XB)": lambda N, K: {**gemv_launch_rule(N, K), "XB": True},
    "XB at K >= 4096 only (where the rule converts x)": lambda N, K: {**gemv_launch_rule(N, K), "XB": K >= 4096},
}


def gemv_variants(model: FastModel, osl: int, roof: float, lines: list[str]) -> list[dict]:
    """async + graphs bs1 tok/s with each GEMV_VARIANTS rule patched into fastpath.kernels.gemv (bench only)."""
    import fastpath.kernels.gemv as gv
    original = gv.gemv_launch_rule
    out = []
    model = model.with_options(fused=True, gemv=True)
    try:
        for name, rule in GEMV_VARIANTS.items():
            gv.gemv_launch_rule = original if rule is None else rule
            try:
                r = bs1_run(model, "async", True, osl, 4, 32)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                lines.append(f"gemv variant {name!r}: FAILED {type(e).__name__}: {e}"[:300])
                print(lines[-1], flush=True)
                continue
            out.append({"variant": name, **r})
            lines.append(f"bs1 async graphs gemv variant {name!r}: {r['tok_s']:.1f} tok/s "
                         f"({100 * r['tok_s'] / roof:.1f}% of roofline)")
            print(lines[-1], flush=True)
    finally:
        gv.gemv_launch_rule = original
    return out


def _write(args, report: dict, lines: list[str]) -> None:
    print("\n".join(lines), flush=True)
    for path, text in ((args.out, json.dumps(report, indent=1)), (args.summary, "\n".join(lines) + "\n")):
        if path:
            with open(path, "w") as f:
                f.write(text)


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first bad value among engine's arguments (one line naming the flag), or None; no work done."""
    from hybridqual.bench.spec import ROW_GROUPS
    return arguments.first(arguments.int_list("--spec-k", args.spec_k, 1, 64),
                           arguments.comma_names("--spec-rows", args.spec_rows, ROW_GROUPS),
                           arguments.at_least("--spec-backoff", args.spec_backoff, 0),
                           "--tiny: only with --prefix-cache" if args.tiny and not args.prefix_cache else None,
                           "--tiny without CUDA: run with TRITON_INTERPRET=1 (the kernels run in the interpreter)"
                           if args.tiny and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                           else None,
                           arguments.writable_file("--out", args.out),
                           arguments.writable_file("--summary", args.summary))


@dataclass
class EngineRun:
    """One engine bench run's shared state: its arguments, the model, the roofline, and the report it builds."""
    args: argparse.Namespace
    osl: int
    model: FastModel | None
    bw: float
    roof: float
    report: dict
    lines: list[str]


@dataclass(frozen=True)
class Bs1Case:
    """One bs1 decode row: the step mode, CUDA graphs, the fused decode kernels, the Triton GEMV."""
    mode: str
    graphs: bool
    fused: bool
    gemv: bool


def build_parser() -> argparse.ArgumentParser:
    """engine's command line."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out")
    ap.add_argument("--summary")
    ap.add_argument("--quick", action="store_true", help="OSL 64, fewer steps (smoke run)")
    ap.add_argument("--skip-batch", action="store_true")
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel tables + projection bandwidth, then bs1 only")
    ap.add_argument("--bs1-only", action="store_true", help="only the async+graphs bs1 rows (fused and unfused)")
    ap.add_argument("--long-only", action="store_true", help="only the 131k-token long prefill + memory prediction")
    ap.add_argument("--batch-only", action="store_true", help="only the 32k-context batch decode, hybrid vs attention")
    ap.add_argument("--spec", action="store_true", help="only speculative bs1 (tools/bench/spec.py): none vs ngram vs "
                    "an upper bound (scripted drafts = the run's own tokens) vs a 4-layer draft (32 tokens, time cap), "
                    "k in --spec-k, async + graphs; acceptance, ratio, verify vs k+1 decode step times")
    ap.add_argument("--spec-k", default="1,2,4,8", help="k values for --spec (comma-separated)")
    ap.add_argument("--spec-rows", default="ngram,upper_bound,draft,draft_right,draft_backoff,self_draft,last_wrong",
                    help="row groups for --spec besides the baseline (comma-separated; e.g. draft)")
    ap.add_argument("--spec-backoff", type=int, default=16,
                    help="engine.speculative.backoff of the draft_backoff rows (most decode steps a missing request "
                         "pauses drafting)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="only: TTFT of a 100-token suffix after a 32k shared prefix, prefix-cache hit vs cold")
    ap.add_argument("--gemv-variants", action="store_true",
                    help="also: async+graphs bs1 with other GEMV launch rules patched in (bench-only comparison)")
    ap.add_argument("--tiny", action="store_true", help="with --prefix-cache: a smoke run of the section's code path "
                    "on a tiny zoo model (CPU without CUDA: run with TRITON_INTERPRET=1), seconds")
    return ap


def start_run(args: argparse.Namespace) -> EngineRun:
    """Measure the copy bandwidth and build anchor-3b with random bf16 weights: the roofline line opens the report."""
    osl = 64 if args.quick else 512
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bw = copy_bandwidth()
    cfg = named_config("anchor-3b")
    P = n_params(cfg)
    model = FastModel(cfg, random_device_weights(cfg, DEV, torch.bfloat16), DEV, torch.bfloat16)
    roof = bw / (2 * P)
    report.update(copy_TBps=bw / 1e12, params=P, roofline_tok_s=roof)
    lines = [f"anchor-3b {P:,} params bf16 | copy {bw / 1e12:.2f} TB/s -> bs1 roofline {roof:.0f} tok/s"]
    report["bs1"] = []
    return EngineRun(args, osl, model, bw, roof, report, lines)


def prefix_section(run: EngineRun) -> None:
    """--prefix-cache: TTFT after a shared prefix, cold vs hit (hybridqual.bench.prefix), written out."""
    from hybridqual.bench.prefix import prefix_lines, prefix_ttft
    r = prefix_ttft(run.model, 4096 if run.args.quick else 32768)
    run.report["prefix_cache"] = r
    run.lines += prefix_lines(r)
    _write(run.args, run.report, run.lines)


def profile_section(run: EngineRun) -> None:
    """--profile: the device kernel table of each fused/GEMV option, then each projection's GEMV bandwidth."""
    model, report, lines = run.model, run.report, run.lines
    report["kernels"] = {}
    for fused, gv in ((False, False), (True, False), (True, True)):
        try:
            k = kernel_table(model.with_options(fused=fused, gemv=gv))
        except Exception as e:
            lines.append(f"kernel table fused={fused} gemv={gv} FAILED {type(e).__name__}: {e}"[:300])
            continue
        report["kernels"][f"fused={fused} gemv={gv}"] = k
        lines.append(f"kernels fused={fused} gemv={gv} graphs={k['graphs']}: step {k['wall_ms_per_step']:.3f} ms wall, kernel sum "
                     f"{k['kernel_us_per_step']:.0f} us, {k['launches_per_step']:.0f} launches/step; top:")
        lines += [f"  {us:8.1f} us {cnt:6.1f}x  {name[:90]}" for name, cnt, us in k["top"]]
    try:
        g = gemv_bandwidth(model.with_options(fused=True, gemv=False))
        report["gemv"] = g
        lines += [f"gemv {r['proj']:15s} {r['N']:6d}x{r['K']:5d}: cuBLAS {r['us']:6.1f} us {r['TBps']:.2f} TB/s | triton "
                  + " ".join(f"{k[7:]} {v}" for k, v in r.items() if k.startswith("triton_")) for r in g]
    except Exception as e:
        lines.append(f"gemv FAILED {type(e).__name__}: {e}"[:300])
    print("\n".join(lines), flush=True)


def bs1_cases(run: EngineRun) -> list[Bs1Case]:
    """The bs1 rows the flags ask for; --long-only/--batch-only/--spec drop them and set the skips they imply
    (--spec runs its own rows here, hybridqual.bench.spec)."""
    args, g0 = run.args, run.model.options.gemv
    cases = [Bs1Case("legacy", False, True, g0), Bs1Case("async", False, True, g0), Bs1Case("legacy", True, True, g0),
             Bs1Case("async", True, False, False), Bs1Case("async", True, True, False),
             Bs1Case("async", True, True, True)]
    if args.bs1_only or args.profile:
        cases = [c for c in cases if c.graphs]
    if args.long_only:
        cases, args.skip_batch = [], True
    if args.batch_only:
        cases, args.skip_long = [], True
    if args.spec:
        from hybridqual.bench.spec import spec_bench
        run.report["spec"], spec_lines = spec_bench(run.model, tuple(int(x) for x in args.spec_k.split(",")),
                                                    osl=run.osl, groups=tuple(args.spec_rows.split(",")),
                                                    backoff=args.spec_backoff, copy_bps=run.bw)
        run.lines += spec_lines
        cases, args.skip_long, args.skip_batch, args.bs1_only = [], True, True, True
    return cases


def bs1_rows(run: EngineRun, cases: list[Bs1Case]) -> None:
    """Time each bs1 case (a failing case is a FAILED line, the others still run)."""
    lines = run.lines
    for c in cases:
        mode, graphs, fused, gv = c.mode, c.graphs, c.fused, c.gemv
        try:   # eager (slow per step): 1 timed request
            r = bs1_run(run.model.with_options(fused=fused, gemv=gv), mode, graphs, run.osl, 4 if graphs else 2, 32)
        except Exception as e:   # keep going: one GPU run must report every section it can
            lines.append(f"bs1 {mode} graphs={graphs} fused={fused}: FAILED {type(e).__name__}: {e}"[:300])
            print(lines[-1], flush=True)
            continue
        r["fused"], r["gemv"] = fused, gv
        run.report["bs1"].append(r)
        lines.append(f"bs1 {mode:6s} graphs={'on ' if graphs else 'off'} {'fused  ' if fused else 'unfused'} "
                     f"{'triton-gemv' if gv else 'cublas     '}: "
                     f"{r['tok_s']:7.1f} tok/s ({100 * r['tok_s'] / run.roof:4.1f}% of roofline), "
                     f"host {r['host_ms_per_step']:.3f} ms/step")
        print(lines[-1], flush=True)


def sync_section(run: EngineRun) -> None:
    """CUDA runtime synchronisations per async+graphs decode step (skipped by the only-one-section flags)."""
    args, lines = run.args, run.lines
    try:
        s = {"per_step": {"skipped (--bs1-only/--profile/--long-only)": 0}} \
            if (args.bs1_only or args.profile or args.long_only or args.batch_only) else count_syncs(run.model)
        run.report["syncs"] = s
        lines.append("syncs/step (async+graphs decode): " +
                     ", ".join(f"{k}={v:g}" for k, v in s["per_step"].items()))
    except Exception as e:
        lines.append(f"sync count FAILED {type(e).__name__}: {e}"[:300])
    print(lines[-1], flush=True)


def long_section(run: EngineRun) -> None:
    """The long bs1 prefill: time to the first token, decode time, memory predicted vs peak."""
    lines = run.lines
    try:
        r = long_prefill(run.model, 8192 if run.args.quick else 131072)
        run.report["long_prefill"] = r
        lines.append(f"long prefill {r['prompt']} tokens bs1 + {r['generated']} decoded (graph replays "
                     f"{r['graph_replays']}): {r['seconds']:.2f}s = prefill to the first token "
                     f"{r['prefill_s']:.2f}s ({r['prefill_tok_s']:.0f} tok/s) + decode {r['decode_s']:.2f}s "
                     f"(after a {r['warmup_s']:.1f}s warm-up request); memory predicted "
                     f"{r['predicted_GiB']:.2f} GiB vs peak {r['peak_GiB']:.2f} GiB ({r['error_pct']:+.1f}%)")
    except Exception as e:
        lines.append(f"long prefill FAILED {type(e).__name__}: {e}"[:300])
    print(lines[-1], flush=True)


def batch_one(name: str, steps: int, out: dict, lines: list[str]) -> None:
    """Batch decode at 32k context of one named model, as many rows (up to 64) as its KV fits; the hybrid also at
    the attention variant's row count when they differ. Results go into out[name] and one line."""
    c = named_config(name)
    m = FastModel(c, random_device_weights(c, DEV, torch.bfloat16), DEV, torch.bfloat16)
    per_slot = 2 * len(c.attention_layer_ids) * (32768 + steps + 8) * c.n_kv_heads * c.attn_head_dim * 2
    rows = 64
    gc.collect()                                   # engines <-> graph runners form cycles
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    while rows > 1 and rows * per_slot > 0.85 * free:
        rows -= 8
    try:
        out[name] = batch_decode(m, rows, 32768, steps)
    except Exception as e:
        out[name] = {"rows": rows, "error": f"{type(e).__name__}: {e}"[:200]}
        torch.cuda.empty_cache()
    out[name]["rows_requested"] = 64
    same = out.get("anchor-3b-attn", {}).get("rows")
    if name == "anchor-3b" and same and same != out[name].get("rows"):
        try:                                       # the hybrid at the attention variant's batch size
            out["anchor-3b@same_rows"] = batch_decode(m, same, 32768, steps)
        except Exception as e:
            out["anchor-3b@same_rows"] = {"rows": same, "error": f"{type(e).__name__}: {e}"[:200]}
    del m
    torch.cuda.empty_cache()
    lines.append(f"{name}: decode at 32k ctx, {out[name].get('rows')} rows: "
                 f"{out[name].get('tok_s', float('nan')):.0f} tok/s, "
                 f"{out[name].get('ms_per_step', float('nan')):.1f} ms/step {out[name].get('error', '')}")
    print(lines[-1], flush=True)


def batch_section(run: EngineRun) -> None:
    """Batch decode at 32k context, anchor-3b vs anchor-3b-attn; drops the run's bs1 model first to free memory."""
    steps = 24 if run.args.quick else 64
    run.model = None
    gc.collect()
    torch.cuda.empty_cache()
    out: dict = {}
    lines = run.lines
    for name in ("anchor-3b-attn", "anchor-3b"):     # attention first: its row count is the same-batch point
        batch_one(name, steps, out, lines)
    run.report["batch_decode_32k"] = out
    a, b = out["anchor-3b"].get("tok_s"), out["anchor-3b-attn"].get("tok_s")
    if a and b:
        lines.append(f"hybrid / attention tok/s ratio at 32k: {a / b:.2f}x "
                     f"(rows {out['anchor-3b']['rows']} vs {out['anchor-3b-attn']['rows']})")
    s_ = out.get("anchor-3b@same_rows", {})
    if s_.get("tok_s") and b:
        lines.append(f"same batch ({s_['rows']} rows each) at 32k: anchor-3b {s_['tok_s']:.0f} tok/s "
                     f"({s_['ms_per_step']:.1f} ms/step) vs anchor-3b-attn {b:.0f}: {s_['tok_s'] / b:.2f}x")


def finish(run: EngineRun) -> None:
    """Print the summary and write --out (the JSON report) and --summary (the lines)."""
    text = "\n".join(run.lines)
    print("\n" + text)
    if run.args.out:
        with open(run.args.out, "w") as f:
            json.dump(run.report, f, indent=1)
    if run.args.summary:
        with open(run.args.summary, "w") as f:
            f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the sections the flags ask for; 2 on a bad argument."""
    args = build_parser().parse_args(argv)
    problem = argument_problem(args)
    if problem:
        return arguments.refuse(problem)
    if args.tiny:
        from hybridqual.bench.prefix import tiny_prefix
        tiny_prefix(args, _write)
        return 0
    run = start_run(args)
    if args.prefix_cache:
        prefix_section(run)
        return 0
    if args.profile:
        profile_section(run)
    bs1_rows(run, bs1_cases(run))
    if args.gemv_variants:
        run.report["gemv_variants"] = gemv_variants(run.model, run.osl, run.roof, run.lines)
    if args.bs1_only or args.profile:
        args.skip_long = args.skip_batch = True
    sync_section(run)
    if not args.skip_long:
        long_section(run)
    if not args.skip_batch:
        batch_section(run)
    finish(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
