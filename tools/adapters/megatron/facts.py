"""Print Megatron's own schedule for a trace: per step, the batches it sampled (request, context row, start position,
token count, Mamba state slot, padded token count) and the requests that finished, with the tokens.

    python -m hybridqual.adapters.megatron.facts TRACE [--model M] [--mode legacy|async] [--device cpu|cuda] [--rounded]
        [--engine megatron-NAME]      # any Megatron engine name qualify accepts (e.g. megatron-preempt)

Megatron's scheduler is not ours (docs/megatron.md), so qualify does not compare it with the oracle's log; this is
where a reader looks at it (e.g. which row a compaction moved, which Mamba slot a request reads).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.adapters.megatron.facts", description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--model", type=Path, default=Path(__file__).resolve().parents[3] / "goldens/models/zoo-bamba")
    ap.add_argument("--mode", choices=["legacy", "async"], default="legacy")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounded", action="store_true", help="max_tokens rounded up to a multiple of 64 (F1)")
    ap.add_argument("--engine", help="a Megatron engine name of qualify's --engine (overrides --rounded)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from oracle.trace import load_trace
    from hybridqual.adapters.megatron.adapter import MegatronAdapter, MegatronRoundedAdapter
    cls = MegatronRoundedAdapter if args.rounded else MegatronAdapter
    if args.engine:
        from hybridqual.adapters import resolve
        cls = resolve(args.engine)
    adapter = cls(args.model, load_trace(args.trace), args.mode, args.device)
    result = adapter.run_trace()
    print(cls.version())
    for k, fact in enumerate(result.schedule_facts):
        for b in fact["batches"]:
            rows = "  ".join(f"{r['request']}@row{r['slot']}/m{r['mamba_slot']} pos {r['pos']}+{r['tokens']}"
                             for r in b["rows"])
            print(f"step {k:3d}  padded {b['padded_tokens']:3d}  {rows}")
        if fact["finished"]:
            print(f"          finished: {', '.join(fact['finished'])}")
        if fact.get("evicted") or fact.get("paused"):
            print(f"          paused {fact.get('paused', 0)}, evicted {fact.get('evicted', 0)}, "
                  f"waiting {fact.get('waiting', 0)}")
    from hybridqual.adapters.megatron.schedule_facts import problems, summary
    print("summary:", summary(result.schedule_facts, adapter.trace))
    bad = problems(adapter.trace, result.tokens, result.schedule_facts, cls.prefix_caching,
                   speculative=cls.speculative_k(adapter.trace))
    print("consistent with a correct schedule" if not bad else "PROBLEMS: " + "; ".join(bad))
    for rid, toks in result.tokens.items():
        print(f"{rid}: {toks} ({result.finish_reasons.get(rid)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
