"""Measure the fast path's logit error against the oracle (fp64) on the shipped corpus — the basis of τ.

    python -m tools.measure_tau [--dtype float32]

For every (shipped model, fitting trace) it runs the fast-path engine, records the logits row of every sampled
position, and compares it with the oracle's fp64 logits for the same tokens (teacher-forced on the engine's own
tokens). Prints the largest |Δlogit| per model and overall; τ in tools/compare.py must stay ≥ TAU_MIN_RATIO × the
overall maximum for the dtype (10× fp32, 2.5× bf16: a flip needs a gap ≤ 2× the error; exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import sys

import torch

import tools  # noqa: F401  (turns on the Triton interpreter without CUDA)


def measure(dtype: torch.dtype, device: str) -> dict[str, float]:
    """Largest |fast-path logit − oracle fp64 logit| per shipped model, over every fitting corpus trace."""
    import oracle
    from fastpath.batch_invariant import run_recording_logits
    from fastpath.engine.engine import Engine
    from tools import goldens
    from tools.compare import teacher_forced_logits
    worst: dict[str, float] = {}
    for mdir in sorted(p for p in goldens.MODELS.iterdir() if (p / "config.json").exists()):
        omodel = oracle.load(mdir, dtype=torch.float64)
        for tpath in sorted(goldens.TRACES.glob("*.json")):
            trace = oracle.load_trace(tpath)
            if not goldens.trace_fits(trace, omodel.config.vocab_size):
                continue
            engine = Engine.from_pretrained(mdir, trace.engine, device=device, dtype=dtype)
            result, rows = run_recording_logits(engine, trace, "legacy")
            for req in trace.requests:
                toks = result.tokens[req.id]
                ref = teacher_forced_logits(omodel, req.prompt, toks)
                for i in range(len(toks)):
                    got = rows[(req.id, len(req.prompt) + i)].double()
                    d = float((got - ref[i]).abs().max())
                    worst[mdir.name] = max(worst.get(mdir.name, 0.0), d)
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.measure_tau", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    from tools.compare import TAU, TAU_MIN_RATIO
    worst = measure(dtype, args.device)
    for name, d in worst.items():
        print(f"  {name:24s} max |Δlogit| {d:.3e}")
    overall = max(worst.values())
    ratio = TAU_MIN_RATIO[dtype]
    print(f"overall max |Δlogit| {overall:.3e} ({args.dtype}, {args.device}); τ = {TAU[dtype]:g} "
          f"= {TAU[dtype] / overall:.1f}× the largest error (required: >= {ratio:g}×)")
    return 0 if TAU[dtype] >= ratio * overall else 1


if __name__ == "__main__":
    sys.exit(main())
