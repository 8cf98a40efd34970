"""Measure llama.cpp's logit error against the fp64 oracle for one GGUF output type — the basis of the judging
constants a quantized GGUF declares (adapter.Q8_0, a base.MeasuredPrecision).

    python -m hybridqual.adapters.llamacpp.measure_tau [--outtype q8_0|bf16|f32] [--model NAME ...] [--trace NAME ...]
    python -m hybridqual.adapters.llamacpp.measure_tau --configuration kv_q8_0 [--model NAME ...]   # a K/V cache type

For every (model, shipped trace) that fits — the models whose GGUF is the model (zoo-mamba2, zoo-granitemoehybrid;
the partial-RoPE ones diverge by conversion, docs/findings.md L1) and the traces whose requests are all greedy — it
runs the in-process adapter on that GGUF, compares every returned logits row with the oracle's fp64 row for the
same tokens (teacher-forced on the engine's own tokens) and records the absolute error max|Δlogit|, the scaled error
(÷ max(1, std(oracle row))) and every greedy flip (the engine's token is not the oracle's argmax there: its gap,
margin and rank). Prints the distribution, the flips and the constants it proposes (`propose`): τ and c = RATIO ×
the largest error (rounded up to two significant digits), the rank bound k = max(5, ceil(RATIO × deepest flip)).
--configuration runs the f32 GGUF with one of the adapter's K/V cache settings (kv_cache.KV_CACHES: the attention
cache quantized), by default on the models it is measured on (kv_cache.KVCache.models).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

MODELS = ("zoo-mamba2", "zoo-granitemoehybrid")
RATIO = 2.5          # the bf16 headroom of compare.TAU_MIN_RATIO: a noisy precision, measured on a small corpus


def adapter_for(outtype: str):
    """The adapter class that runs a GGUF of `outtype` (f32 K/V, flash attention off)."""
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter, LlamaCppBF16Adapter, LlamaCppQ8Adapter
    return {"f32": LlamaCppAdapter, "bf16": LlamaCppBF16Adapter, "q8_0": LlamaCppQ8Adapter}[outtype]


def measure(outtype: str, models: list[str] | None = None, traces: list[str] | None = None,
            configuration: str | None = None) -> dict[str, dict]:
    """Per model: {"absolute": [...], "scaled": [...], "flips": [...], "requests": n}, one error per position."""
    import oracle
    from hybridqual.adapters.base import Engine, EngineOptions
    from hybridqual.goldens import regen as goldens
    from hybridqual.qualify.compare import logit_scale, teacher_forced_logits, top2_margin
    cls = Engine(adapter_for(outtype), EngineOptions(configuration=configuration))
    out: dict[str, dict] = {}
    from hybridqual.adapters.llamacpp.kv_cache import kv_cache
    kv = kv_cache(configuration)
    for name in models or (kv.models if kv is not None else MODELS):
        mdir = goldens.MODELS / name
        omodel = oracle.load(mdir, dtype=torch.float64)
        rec = out.setdefault(name, {"absolute": [], "scaled": [], "flips": [], "requests": 0})
        for tpath in sorted(goldens.TRACES.glob("*.json")):
            if traces and tpath.stem not in traces:
                continue
            trace = oracle.load_trace(tpath)
            if not goldens.trace_fits(trace, omodel.config.vocab_size) or \
                    any(r.sampling.kind != "greedy" for r in trace.requests):
                continue
            run = cls(mdir, trace, "legacy").run_trace()
            for req in trace.requests:
                toks = run.tokens[req.id]
                ref = teacher_forced_logits(omodel, req.prompt, toks)
                got = run.logits[req.id].double()
                rec["requests"] += 1
                for i, t in enumerate(toks):
                    d = float((got[i] - ref[i]).abs().max())
                    rec["absolute"].append(d)
                    rec["scaled"].append(d / logit_scale(ref[i]))
                    top = int(ref[i].argmax())
                    if top != t:
                        rec["flips"].append({"trace": tpath.stem, "request": req.id, "position": i, "token": t,
                                             "oracle_token": top, "gap": float(ref[i][top] - ref[i][t]),
                                             "margin": top2_margin(ref[i]), "rank": int((ref[i] > ref[i][t]).sum())})
    return out


def _up(x: float) -> float:
    """x rounded up to two significant digits."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    return math.ceil(x / 10 ** e) * 10 ** e


def propose(per_model: dict[str, dict]) -> dict[str, float]:
    """τ, c and k from the measurement (RATIO × the largest error / deepest flip), and the largest errors."""
    absolute = [x for r in per_model.values() for x in r["absolute"]]
    scaled = [x for r in per_model.values() for x in r["scaled"]]
    ranks = [f["rank"] for r in per_model.values() for f in r["flips"]]
    worst, worst_scaled = max(absolute), max(scaled)
    return {"measured_err": worst, "measured_scaled": worst_scaled, "tau": _up(RATIO * worst),
            "logits_c": _up(RATIO * worst_scaled), "top_k": max(5, math.ceil(RATIO * max(ranks, default=0))),
            "positions": len(absolute), "flips": len(ranks)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.adapters.llamacpp.measure_tau", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outtype", default="q8_0", choices=["f32", "bf16", "q8_0"])
    ap.add_argument("--model", nargs="+", help=f"only these shipped models (default: {', '.join(MODELS)})")
    ap.add_argument("--trace", nargs="+", help="only these shipped trace names (file stems)")
    ap.add_argument("--configuration", help="a K/V cache setting of the f32 adapter (kv_cache.KV_CACHES)")
    args = ap.parse_args(argv)
    from hybridqual.adapters.llamacpp.kv_cache import kv_cache
    from hybridqual.measure_tau import percentiles
    kv = kv_cache(args.configuration)
    if kv is not None and args.outtype != "f32":
        ap.error("--configuration: the K/V cache settings run on the f32 GGUF (--outtype f32)")
    per_model = measure(args.outtype, args.model, args.trace, args.configuration)
    for name, r in per_model.items():
        print(f"  {name:22s} {r['requests']:3d} requests {len(r['absolute']):4d} positions  |Δlogit|: "
              f"{percentiles(r['absolute'])}")
        print(f"  {'':22s} {'':33s}scaled:  {percentiles(r['scaled'])}")
        for f in r["flips"]:
            print(f"  {'':22s} flip {f['trace']}/{f['request']}@{f['position']}: {f['token']} for the oracle's "
                  f"{f['oracle_token']}, gap {f['gap']:.3e}, margin {f['margin']:.3e}, rank {f['rank']}")
    p = propose(per_model)
    cls = adapter_for(args.outtype)
    what = args.outtype + (f", {args.configuration}" if kv is not None else "")
    undeclared = kv is not None and kv.precision is None
    print(f"overall ({what}, {p['positions']} positions, {p['flips']} flips): largest |Δlogit| "
          f"{p['measured_err']:.3e}, largest scaled {p['measured_scaled']:.3e}")
    print(f"proposed (×{RATIO:g}): tau={p['tau']:g} logits_c={p['logits_c']:g} top_k={p['top_k']}"
          + (f"; {args.configuration} declares no constants yet" if undeclared else ""))
    if undeclared:
        return 1
    declared = kv.precision if kv is not None else cls.capabilities("cpu").compute_dtype
    from hybridqual.qualify.compare import LOGITS_C, TAU, TOP_K
    ok = TAU[declared] >= 2 * p["measured_err"] and LOGITS_C[declared] >= p["measured_scaled"]
    print(f"declared by {cls.__name__} ({declared}): tau={TAU[declared]:g} "
          f"({TAU[declared] / p['measured_err']:.1f}× the largest error), logits_c={LOGITS_C[declared]:g} "
          f"({LOGITS_C[declared] / p['measured_scaled']:.1f}× the largest scaled error), top_k={TOP_K[declared]}"
          f"{'' if ok else ' — BELOW the measured error'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
