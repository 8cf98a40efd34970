"""Measure the fast path's logit error against the oracle (fp64) on the shipped corpus — the basis of τ and of the
logits check's constant c (tools/qualify/compare.py).

    python -m hybridqual.measure_tau [--dtype float32|bfloat16] [--device cpu|cuda] [--model NAME ...] [--trace NAME ...]
                                     [--state-dtype float16|bfloat16]

For every (shipped model, fitting trace) it runs the fast-path engine, records the logits row of every sampled
position, and compares it with the oracle's fp64 logits for the same tokens (teacher-forced on the engine's own
tokens). Per position it records the absolute error e = max|Δlogit| and the scaled error e / max(1, std(oracle
row)). Prints, per model and overall, the largest and the 50th/99th percentiles of both (the distribution the
tables come from). --state-dtype runs the engine with a reduced-precision state bank (FastOptions.state_dtype, the
torch kernels: DESIGN §20) and prints the distribution only: its constants are declared from it
(hybridqual.adapters.state_precision). Exit 1 when τ < TAU_MIN_RATIO × the largest absolute error, or when
LOGITS_C < LOGITS_MIN_RATIO × the largest scaled error, for the dtype (a flip needs a gap ≤ 2× the error).
"""
from __future__ import annotations

import argparse
import sys

import torch


def measure(dtype: torch.dtype, device: str, models: list[str] | None = None,
            traces: list[str] | None = None, options=None) -> dict[str, tuple[list, list]]:
    """Per shipped model: (absolute errors, scaled errors), one per sampled position over every fitting trace."""
    import oracle
    from fastpath.batch_invariant import run_recording_logits
    from fastpath.engine.engine import Engine
    from hybridqual.goldens import regen as goldens
    from hybridqual.qualify.compare import logit_scale, teacher_forced_logits
    out: dict[str, tuple[list, list]] = {}
    for mdir in sorted(p for p in goldens.MODELS.iterdir() if (p / "config.json").exists()):
        if models and mdir.name not in models:
            continue
        omodel = oracle.load(mdir, dtype=torch.float64)
        absolute, scaled = out.setdefault(mdir.name, ([], []))
        for tpath in sorted(goldens.TRACES.glob("*.json")):
            if traces and tpath.stem not in traces:
                continue
            trace = oracle.load_trace(tpath)
            if not goldens.trace_fits(trace, omodel.config.vocab_size):
                continue
            engine = Engine.from_pretrained(mdir, trace.engine, device=device, dtype=dtype, options=options)
            result, rows = run_recording_logits(engine, trace, "legacy")
            for req in trace.requests:
                toks = result.tokens[req.id]
                ref = teacher_forced_logits(omodel, req.prompt, toks)
                for i in range(len(toks)):
                    got = rows[(req.id, len(req.prompt) + i)].double()
                    d = float((got - ref[i]).abs().max())
                    absolute.append(d)
                    scaled.append(d / logit_scale(ref[i]))
    return out


def percentiles(xs: list[float]) -> str:
    """'max M, p99 A, p50 B' of a list (fp64)."""
    t = torch.tensor(xs, dtype=torch.float64)
    return (f"max {float(t.max()):.3e}, p99 {float(torch.quantile(t, 0.99)):.3e}, "
            f"p50 {float(torch.quantile(t, 0.5)):.3e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.measure_tau", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", nargs="+", help="only these shipped model names")
    ap.add_argument("--trace", nargs="+", help="only these shipped trace names (file stems)")
    ap.add_argument("--state-dtype", choices=["float16", "bfloat16"],
                    help="a reduced-precision state bank (torch kernels); prints the distribution only")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    from hybridqual.qualify.compare import LOGITS_C, LOGITS_MIN_RATIO, TAU, TAU_MIN_RATIO
    options = None
    if args.state_dtype:
        from fastpath.options import FastOptions
        options = FastOptions(backend="torch", state_dtype=args.state_dtype)
    per_model = measure(dtype, args.device, args.model, args.trace, options)
    for name, (absolute, scaled) in per_model.items():
        print(f"  {name:24s} {len(absolute):4d} positions  |Δlogit|: {percentiles(absolute)}")
        print(f"  {'':24s} {'':4s}            scaled:  {percentiles(scaled)}")
    absolute = [x for a, _ in per_model.values() for x in a]
    scaled = [x for _, s in per_model.values() for x in s]
    print(f"overall ({args.dtype}, {args.device}, {len(absolute)} positions): |Δlogit| {percentiles(absolute)}; "
          f"scaled {percentiles(scaled)}")
    worst, worst_scaled = max(absolute), max(scaled)
    if options is not None:
        return 0
    print(f"τ = {TAU[dtype]:g} = {TAU[dtype] / worst:.1f}× the largest error (required: >= {TAU_MIN_RATIO[dtype]:g}×)")
    print(f"logits check c = {LOGITS_C[dtype]:g} = {LOGITS_C[dtype] / worst_scaled:.1f}× the largest scaled error "
          f"(required: >= {LOGITS_MIN_RATIO[dtype]:g}×)")
    return 0 if (TAU[dtype] >= TAU_MIN_RATIO[dtype] * worst
                 and LOGITS_C[dtype] >= LOGITS_MIN_RATIO[dtype] * worst_scaled) else 1


if __name__ == "__main__":
    sys.exit(main())
