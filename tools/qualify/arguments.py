"""qualify's command line: every argument, and the checks of their values made before any work (exit 2, one line).

Owns the argparse definition and the value rules (--tau, --tp, --jobs, --engine-threads, --timeout,
--piece-granularity, --scenario, --out writable); the runner (hybridqual.qualify.runner) parses with it. Imports
only hybridqual.paths, hybridqual.scenarios.plan, hybridqual.qualify.truth and the engine names
(hybridqual.adapters.ENGINES).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from hybridqual import paths
from hybridqual.adapters import ENGINES
from hybridqual.scenarios import plan as scenarios
from hybridqual.qualify.truth import ORACLES

DEFAULT_TIMEOUT = 1800.0        # seconds per instance (every mode and continuation of one trace)
MAX_ENGINE_THREADS = 4096


def parse_args(argv: list[str] | None, usage: str | None = None) -> argparse.Namespace:
    """qualify's command line; `usage` is the help text's description (the runner's docstring)."""
    ap = argparse.ArgumentParser(prog="python -m hybridqual.qualify", description=usage,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=paths.model_arg,
                    help="HF-format model folder, or a shipped model's name (`hybridqual list`; default: the default "
                         "plan's models)")
    ap.add_argument("--scenario", nargs="+", help="only these scenarios (with --model)")
    ap.add_argument("--engine", default="fastpath",
                    help=f"{' | '.join(sorted(ENGINES))} | module:Class (your own adapter, docs/api.md)")
    ap.add_argument("--mode", nargs="+", default=["legacy", "async"], choices=["legacy", "async"])
    ap.add_argument("--trace", nargs="+", type=paths.trace_arg,
                    help="trace files (or shipped trace names), one instance each")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tau", type=float, default=None,
                    help="near-tie threshold on the oracle logit gap (default: compare.TAU of the engine's dtype)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="fast path compute dtype (default: bf16 on "
                                                                     "cuda, fp32 on cpu)")
    ap.add_argument("--graphs", action="store_true", help="fast path with CUDA graphs for decode-only steps")
    ap.add_argument("--out", type=Path, default=Path("out/qualify"))
    ap.add_argument("--quiet", action="store_true", help="no progress lines: failures and the summary only")
    ap.add_argument("--strict", action="store_true", help="a skipped check makes the run fail too")
    ap.add_argument("--fail-fast", action="store_true", help="stop at the first FAIL (exit 1; the report says so)")
    ap.add_argument("--oracle", choices=ORACLES, default="auto",
                    help="the truth: auto (in memory when the fp64 model fits, else streamed), memory, streamed")
    ap.add_argument("--oracle-device", default="cpu", help="where the fp64 oracle computes: cpu or cuda")
    ap.add_argument("--jobs", type=int, default=None,
                    help="worker processes running instances side by side, reported in plan order (default: "
                         "min(2, CPU cores) for the default plan on cpu, else 1); each uses cores/jobs torch threads")
    ap.add_argument("--engine-threads", type=int, default=None, metavar="N",
                    help="CPU threads each engine may use (llama.cpp's n_threads, vLLM CPU's and torch's threads; "
                         "default: CPU cores // (--jobs x --tp), so the engines side by side fit the cores); the "
                         "report header says which")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (launch with torchrun --nproc_per_node N)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help=f"seconds one instance may run before it is a FAIL (default {DEFAULT_TIMEOUT:g}); enforced "
                         "by killing its worker process when it runs in one, else by an alarm in this process")
    iso = ap.add_mutually_exclusive_group()
    iso.add_argument("--isolate", action="store_true", default=None,
                     help="run every instance in a worker process even with --jobs 1 (the default for an engine "
                          "given as module:Class): an adapter that hangs or kills its process is a FAIL line")
    iso.add_argument("--in-process", dest="isolate", action="store_false",
                     help="run instances in this process (e.g. under a debugger) when --jobs is 1")
    ap.add_argument("--skip-invalid-traces", action="store_true",
                    help="a --trace file that is malformed or does not fit the model is a SKIP line (default: a FAIL)")
    ap.add_argument("--base-url", help="--engine openai: the OpenAI-compatible server's address (http://HOST:PORT)")
    ap.add_argument("--served-model", help="--engine openai: the model name the server serves it under (default: "
                                           "the only one /v1/models lists)")
    ap.add_argument("--piece-granularity", type=int, nargs="+", default=[], metavar="N",
                    help="the engine's own piece rule: block sizes / budget roundings its scheduler cuts prefill at "
                         "(vLLM's block size, SGLang's page size, a budget rounding); the engine-aware scenarios add "
                         "prompts = 1 mod each, beside the adapter's declared ones and the defaults (16, 64, chunk)")
    ap.add_argument("--engine-budget", metavar="KEY=VALUE,...",
                    help="the step rule of an engine the adapter does not declare one for (it replaces a declared "
                         "one): keys of hybridqual.scenarios.step_rule.StepRule, e.g. 'budget_multiple=64,"
                         "uses_prefill_chunk=false,chunk_aligned=false,no_one_token_remainder=true' (a budget-only "
                         "engine rounding to 64); piece_tails is instantiated so prompts end with pieces of "
                         "1..d_conv tokens under it")
    ap.add_argument("--configuration", nargs="+", metavar="NAME",
                    help="run the engine in these of its declared configurations ('default' for its defaults; "
                         "an unknown name is refused with the list): with --model/--trace, every instance in each; in the main job, "
                         "each on the instances that reach its code (default: the main job runs the default plan, "
                         "then every declared configuration on its reach)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="fast path in batch-invariant mode (its prefill pieces depend only on the request, so its "
                         "schedule log is not the default policy's: that check is skipped)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # what --jobs workers are started with
    return args


def argument_problem(args, check_out: bool = True) -> str | None:
    """The first bad value among the numeric, output and scenario arguments (one line), or None; no work done."""
    if args.tau is not None and not (math.isfinite(args.tau) and args.tau >= 0):
        return f"--tau {args.tau}: must be a finite number >= 0"
    if args.tp < 1:
        return f"--tp {args.tp}: must be at least 1"
    if args.jobs is not None and args.jobs < 1:
        return f"--jobs {args.jobs}: must be at least 1"
    threads = getattr(args, "engine_threads", None)
    if threads is not None and not 1 <= threads <= MAX_ENGINE_THREADS:
        return f"--engine-threads {threads}: must be an integer in [1, {MAX_ENGINE_THREADS}]"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout {args.timeout}: must be a finite number of seconds > 0"
    bad = [g for g in args.piece_granularity if not 1 <= g <= 1 << 16]
    if bad:
        return f"--piece-granularity {bad[0]}: must be an integer in [1, 65536]"
    if getattr(args, "engine_budget", None):
        from hybridqual.scenarios.step_rule import parse_step_rule
        try:
            parse_step_rule(args.engine_budget)
        except scenarios.ScenarioError as e:
            return str(e)
    if args.scenario:
        unknown = [n for n in args.scenario if n not in scenarios.SCENARIOS]
        if unknown:
            return (f"--scenario {unknown[0]}: no such scenario; known: {', '.join(scenarios.SCENARIOS)}")
    return out_problem(args.out) if check_out else None


def out_problem(out: Path) -> str | None:
    """Why --out cannot hold the report (not a folder we can create and write in), or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"--out {out}: not a writable folder ({type(e).__name__}: {e.strerror or e})"
    return None


def oracle_device_problem(device: str) -> str | None:
    """Why --oracle-device cannot be used, or None."""
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        return f"--oracle-device {device!r}: not a torch device ({e})"
    if dev.type not in ("cpu", "cuda"):
        return f"--oracle-device {device}: only cpu and cuda are supported"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--oracle-device {device}: CUDA is not available on this machine"
    return None
