"""TP=2 vs TP=1 and batch-invariant vs default on the GPU (one torchrun of 2 processes, NCCL).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 tools/bench/tp.py --out bench_tp.json

1. Trained tiny model (goldens/models/tiny-sort), corpus traces it can read, legacy+async: TP=2 tokens vs TP=1,
   schedule digests equal across ranks and to TP=1.
2. anchor-3b random weights: a 4-request trace, TP=2 tokens vs TP=1, and the first logits' max |diff|; the
   same in fp32 beside bf16's own rounding (bf16 vs fp32), which tells TP error from bf16 noise.
3. anchor-3b bs1 decode tok/s, TP=2 vs TP=1 (async; CUDA graphs, eager if capture fails).
4. anchor-3b batch-64 decode (rank 0 alone, TP=1): BatchInvariantModel vs FastModel, same run; and the
   batch-invariant Triton matmul vs cuBLAS (F.linear) on the anchor's projection shapes (single eager calls:
   host-launch bound; tools/bench/gemm.py times them inside CUDA graphs).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastpath.batch_invariant import BatchInvariantModel
from fastpath.engine.configs import named_config, random_device_weights
from fastpath.engine.engine import Engine
from fastpath.kernels.matmul import matmul
from fastpath.model import FastModel
from fastpath.tp import TPModel, init_from_env
from hybridqual.bench import arguments
from oracle.checkpoint import load_checkpoint
from oracle.trace import EngineConfig, Request, Trace, load_trace

LINES: list[str] = []


def say(s: str) -> None:
    """Print on rank 0 and keep for the summary."""
    if dist.get_rank() == 0:
        print(s, flush=True)
        LINES.append(s)


def same_on_all_ranks(text: str) -> bool:
    """True when every rank passes the same string (compared by sha256 through an all-gather)."""
    h = torch.tensor(list(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8, device="cuda")
    out = [torch.empty_like(h) for _ in range(dist.get_world_size())]
    dist.all_gather(out, h)
    return all(torch.equal(o, h) for o in out)


def compare_traces(tp: TPModel, one: FastModel, traces: list[Trace], label: str) -> dict:
    """TP=2 vs TP=1 tokens and logs on `traces` (legacy and async)."""
    res = {"requests": 0, "equal_tokens": 0, "logs_equal_ranks": True, "logs_equal_tp1": 0, "runs": 0}
    for tr in traces:
        max_len = max(len(r.prompt) + r.max_new_tokens for r in tr.requests) + 8
        e2, e1 = Engine(tp, tr.engine, max_len=max_len), Engine(one, tr.engine, max_len=max_len)
        for mode in ("legacy", "async"):
            r2, r1 = e2.run_trace(tr, mode=mode), e1.run_trace(tr, mode=mode)
            res["runs"] += 1
            res["logs_equal_ranks"] &= same_on_all_ranks(json.dumps(r2.schedule_log.to_json(), sort_keys=True))
            res["logs_equal_tp1"] += r2.digest == r1.digest
            res["requests"] += len(tr.requests)
            res["equal_tokens"] += sum(r2.tokens[k] == r1.tokens[k] for k in r1.tokens)
        del e2, e1
    say(f"{label}: TP=2 vs TP=1 tokens equal for {res['equal_tokens']}/{res['requests']} request-runs; "
        f"schedule logs identical across ranks: {res['logs_equal_ranks']}; digest == TP=1 in "
        f"{res['logs_equal_tp1']}/{res['runs']} runs")
    return res


def bs1_tok_s(model, graphs: bool, osl: int = 128, n_req: int = 3, prompt_len: int = 32) -> float:
    """Async bs1 decode tok/s over requests 2..n (first = warm-up)."""
    C = model.config.chunk_size
    eng = Engine(model, EngineConfig(1, max(C, prompt_len), max(C, prompt_len), "async"),
                 max_len=prompt_len + osl + 8, graphs=graphs)
    rates = []
    for i in range(n_req):
        eng.reset("async")
        eng.add_request(Request(f"q{i}", 0, tuple((17 * i + 7 * j) % 32000 for j in range(prompt_len)), osl))
        eng.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.step():
            pass
        torch.cuda.synchronize()
        if i:
            rates.append((len(eng.requests[f"q{i}"].output) - 1) / (time.perf_counter() - t0))
    return sum(rates) / len(rates)


def bs1_both(model) -> tuple[float, str]:
    """(tok/s, 'graphs'|'eager'): graphs first, eager when capture fails."""
    try:
        return bs1_tok_s(model, True), "graphs"
    except Exception as e:  # noqa: BLE001 - report and fall back
        say(f"  graphs failed ({type(e).__name__}: {str(e)[:120]}); eager instead")
        torch.cuda.synchronize()
        return bs1_tok_s(model, False), "eager"


def batch_decode(model, rows: int = 64, ctx: int = 512, steps: int = 40) -> float:
    """rows requests decoding at context ctx (prefill skipped), async + graphs; ms per step."""
    from oracle.schedule_log import StepRecord
    C = model.config.chunk_size
    eng = Engine(model, EngineConfig(rows, rows - 1 + C, C, "async"), max_len=ctx + steps + 8, graphs=True)
    for i in range(rows):
        eng.add_request(Request(f"b{i}", 0, (1,) * ctx, steps + 4))
    eng.admit(StepRecord(0))
    for st in eng.requests.values():
        st.done, st.output = ctx, [1]
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = steps - 6
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / n
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def time_it(fn, reps: int = 50) -> float:
    """Median microseconds of fn() by CUDA events."""
    ts = []
    for _ in range(reps + 5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts = sorted(ts[5:])
    return ts[len(ts) // 2]


def anchor_fp32_check(dev) -> dict:
    """anchor-3b in fp32 and bf16, TP=2 vs TP=1: first-token logits max|diff| beside bf16's own rounding noise."""
    from fastpath.batch_invariant import run_recording_logits
    cfg = named_config("anchor-3b")
    reqs = tuple(Request(f"a{i}", i, tuple((31 * i + 7 * j) % 32000 for j in range(64)), 8) for i in range(2))
    tr = Trace(EngineConfig(2, 512, 256, "legacy"), reqs)
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        full = random_device_weights(cfg, dev, dt, seed=0)
        for name, cls in (("tp2", TPModel), ("tp1", FastModel)):
            r, rows = run_recording_logits(Engine(cls(cfg, full, dev, dt), tr.engine, max_len=128), tr, "legacy")
            res[(name, dt)] = (r.tokens, rows[("a0", 64)])
        del full
        torch.cuda.empty_cache()
    F32, BF = torch.float32, torch.bfloat16

    def d(a, b):
        return float((res[a][1] - res[b][1]).abs().max())
    out = {"tp2_vs_tp1_fp32": d(("tp2", F32), ("tp1", F32)), "tp1_bf16_vs_fp32": d(("tp1", BF), ("tp1", F32)),
           "tp2_vs_tp1_bf16": d(("tp2", BF), ("tp1", BF)), "tokens_fp32_equal": res[("tp2", F32)][0] == res[("tp1", F32)][0]}
    say(f"anchor-3b first logits max|diff|: TP=2 vs TP=1 fp32 {out['tp2_vs_tp1_fp32']:.2e}, bf16 "
        f"{out['tp2_vs_tp1_bf16']:.3f}; bf16 vs fp32 (TP=1) {out['tp1_bf16_vs_fp32']:.3f}; fp32 tokens equal "
        f"{out['tokens_fp32_equal']}")
    return out


@dataclass
class AnchorModels:
    """anchor-3b's random bf16 weights and the two models over them: TP=2 (tp, dropped after bs1) and TP=1 (one)."""
    cfg: object
    full: dict
    tp: TPModel | None
    one: FastModel


def tiny_section(dev: torch.device, bf: torch.dtype, out: dict) -> None:
    """The trained tiny model on the corpus traces it can read (vocab 16), TP=2 vs TP=1, fp32 and bf16."""
    if __package__:   # python -m hybridqual.bench.tp / hybridqual bench tp: the shipped data, installed or in a checkout
        from hybridqual.paths import MODELS, TRACES
    else:             # torchrun tools/bench/tp.py (a script file, PYTHONPATH=.)
        from hybridqual.paths import MODELS, TRACES
    cfg, w = load_checkpoint(MODELS / "tiny-sort")
    traces = [load_trace(p) for p in sorted(TRACES.glob("*.json"))]
    traces = [t for t in traces if max(max(r.prompt + r.stop_token_ids) for r in t.requests) < cfg.vocab_size]
    for dtype in (torch.float32, bf):
        out[f"tiny_{dtype}"] = compare_traces(TPModel(cfg, w, dev, dtype), FastModel(cfg, w, dev, dtype), traces,
                                              f"tiny-sort {str(dtype)[6:]} ({len(traces)} traces)")


def anchor_section(dev: torch.device, bf: torch.dtype, out: dict) -> AnchorModels:
    """anchor-3b random weights, TP=2 vs TP=1: tokens and the first token's logits."""
    acfg = named_config("anchor-3b")
    full = random_device_weights(acfg, dev, bf, seed=0)
    tp = TPModel(acfg, full, dev, bf)
    one = FastModel(acfg, full, dev, bf)
    reqs = tuple(Request(f"a{i}", i, tuple((31 * i + 7 * j) % 32000 for j in range(64)), 32) for i in range(4))
    tr = Trace(EngineConfig(4, 512, 256, "legacy"), reqs)
    out["anchor_tokens"] = compare_traces(tp, one, [tr], "anchor-3b bf16 (4 requests x 32 tokens)")
    from fastpath.batch_invariant import run_recording_logits
    _, l2 = run_recording_logits(Engine(tp, tr.engine, max_len=128), tr, "legacy")
    _, l1 = run_recording_logits(Engine(one, tr.engine, max_len=128), tr, "legacy")
    first = (reqs[0].id, 64)
    d = float((l2[first] - l1[first]).abs().max())
    say(f"anchor-3b first-token logits TP=2 vs TP=1: max|diff| {d:.4f} (logit range "
        f"{float(l1[first].abs().max()):.2f})")
    out["anchor_first_logits_maxdiff"] = d
    return AnchorModels(acfg, full, tp, one)


def bs1_section(rank: int, tp: TPModel, one: FastModel, out: dict) -> None:
    """bs1 async decode tok/s, TP=2 on every rank, TP=1 on rank 0."""
    tok2, how2 = bs1_both(tp)
    dist.barrier()
    if rank == 0:
        tok1, how1 = bs1_both(one)
        say(f"anchor-3b bs1 async decode: TP=1 {tok1:.1f} tok/s ({how1}), TP=2 {tok2:.1f} tok/s ({how2}), "
            f"speedup {tok2 / tok1:.2f}x")
        out["bs1"] = {"tp1_tok_s": tok1, "tp1": how1, "tp2_tok_s": tok2, "tp2": how2}
    dist.barrier()


def matmul_rows(one: FastModel, dev: torch.device, bf: torch.dtype) -> list[dict]:
    """The fixed-tile Triton matmul vs cuBLAS on anchor-3b's projection shapes at M = 1, 64, 512 (microseconds)."""
    shapes = {"in_proj": one.w["layers.0.mamba.in_proj.weight"], "out_proj": one.w["layers.0.mamba.out_proj.weight"],
              "gate_up": one.w["layers.0.mlp.gate_up.weight"], "down": one.w["layers.0.mlp.down_proj.weight"],
              "lm_head": one.w["lm_head.weight"]}
    rows = []
    for M in (1, 64, 512):
        parts = []
        for name, W in shapes.items():
            x = torch.randn(M, W.shape[1], device=dev, dtype=bf)
            tc, tt = time_it(lambda: F.linear(x, W)), time_it(lambda: matmul(x, W))
            rows.append({"M": M, "name": name, "N": W.shape[0], "K": W.shape[1], "cublas_us": tc,
                         "triton_us": tt})
            parts.append(f"{name} {tc:.1f}/{tt:.1f}")
        say(f"matmul M={M} (cuBLAS/Triton fixed-tile us): " + ", ".join(parts))
    return rows


def batch_section(m: AnchorModels, dev: torch.device, bf: torch.dtype, out: dict) -> None:
    """Batch-64 decode, batch-invariant vs default, then the matmul vs cuBLAS (rank 0 only)."""
    bi = BatchInvariantModel(m.cfg, m.full, dev, bf)
    one = m.one
    ms_d, ms_b = batch_decode(one), batch_decode(bi)
    ms_d2 = batch_decode(one)
    say(f"anchor-3b batch-64 decode (ctx 512, async+graphs): default {ms_d:.2f} / {ms_d2:.2f} ms/step, "
        f"batch-invariant {ms_b:.2f} ms/step ({100 * (ms_b / min(ms_d, ms_d2) - 1):+.1f}%)")
    out["batch64"] = {"default_ms": [ms_d, ms_d2], "batch_invariant_ms": ms_b}
    out["matmul"] = matmul_rows(one, dev, bf)


def main(argv: list[str] | None = None) -> int:
    """Every section on each rank of a TP=2 torchrun; rank 0 writes --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_tp.json")
    args = ap.parse_args(argv)
    problem = arguments.writable_file("--out", args.out)
    if problem:
        return arguments.refuse(problem)
    rank, world = init_from_env("cuda")
    dev, bf = torch.device("cuda", rank), torch.bfloat16
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
           "world": world}
    say(f"{out['date']} {world}x {out['gpu']} torch {torch.__version__}")
    tiny_section(dev, bf, out)                        # 1. trained tiny model
    models = anchor_section(dev, bf, out)             # 2. anchor-3b random weights: tokens and first logits
    out["anchor_fp32"] = anchor_fp32_check(dev)
    bs1_section(rank, models.tp, models.one, out)     # 3. bs1 decode tok/s
    models.tp = None
    gc.collect()
    torch.cuda.empty_cache()
    if rank == 0:                                     # 4. batch-64: batch-invariant vs default, matmul vs cuBLAS
        batch_section(models, dev, bf, out)
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
