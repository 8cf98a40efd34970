"""python -m tools.mutants [--only NAME ...] [--quick] [--jobs N] [--list]: run the bug zoo, print the kill table."""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tools.mutants.runner import run_one
from tools.mutants.zoo import MUTANTS, QUICK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.mutants", description=__doc__)
    ap.add_argument("--only", nargs="+", help="run only these mutants")
    ap.add_argument("--quick", action="store_true", help="the CI subset")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--gpu", action="store_true", help="also run GPU-only mutants (needs CUDA)")
    ap.add_argument("--list", action="store_true", help="list the zoo and exit")
    ap.add_argument("--markdown", action="store_true", help="print the zoo as a markdown table and exit")
    args = ap.parse_args(argv)
    names = {m.name for m in MUTANTS}
    for n in args.only or []:
        if n not in names:
            print(f"--only {n}: no such mutant (known: {', '.join(sorted(names))})", file=sys.stderr)
            return 2
    chosen = [m for m in MUTANTS if (not args.only or m.name in args.only) and (not args.quick or m.name in QUICK)
              and (args.gpu or not m.gpu_only)]
    if args.markdown:
        print("| mutant | class | story | file | expected killer(s) |\n|---|---|---|---|---|")
        for m in MUTANTS:
            tests = ", ".join(t.replace("tests/", "").replace(".py::", "::") for t in m.tests)
            gpu = " (gpu only)" if m.gpu_only else ""
            print(f"| `{m.name}`{gpu} | {m.bug_class} | {m.story} | {m.file} | {tests} |")
        return 0
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:34s} {m.bug_class:22s} {'gpu ' if m.gpu_only else ''}{m.story}")
        return 0
    print(f"{'mutant':34s} {'class':22s} {'status':9s} {'time':>6s}  killed by")
    outcomes, t0 = [], time.time()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for o in pool.map(run_one, chosen):
            outcomes.append(o)
            print(f"{o.mutant.name:34s} {o.mutant.bug_class:22s} {o.status:9s} {o.seconds:5.0f}s  {o.killed_by}",
                  flush=True)
    killed = sum(o.status == "KILLED" for o in outcomes)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("KILLED", "SURVIVED", "CRASH", "STALE")}
    print(f"kill rate: {killed}/{len(outcomes)} = {100 * killed / max(1, len(outcomes)):.0f}%"
          f" (crashes and stale patches do not count as kills) | "
          + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f" | {time.time() - t0:.0f} s wall, --jobs {args.jobs}")
    return 0 if outcomes and killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
