"""The main job: replay the trace corpus through an engine and check it against the goldens / the oracle.

    python -m tools.qualify [--model goldens/models/tiny-sort] [--engine fastpath|oracle|hf|module:Class]
                            [--mode legacy async] [--trace PATH ...] [--out out/qualify] [--batch-invariant]
    torchrun --nproc_per_node 2 -m tools.qualify --tp 2 ...        # tensor parallel fast path

Checks, a line each: tokens vs the truth (tie-aware, DESIGN §5), schedule-log digest vs the oracle's (engines
that emit a log), legacy == async bitwise. The truth is the shipped golden when one exists for this exact model
and trace (sha256-checked), else the oracle (fp64) run now. Writes report.json and junit.xml under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tools import adapters, goldens, task_traces
from tools.compare import TAU, compare_bitwise, compare_tie_aware

DEFAULT_MODEL = goldens.MODELS / "tiny-sort"


@dataclass
class Check:
    """One line of the report."""
    trace: str
    name: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0


def truth_for(model_dir: Path, trace_path: Path, oracle_model) -> dict:
    """The golden record for (model, trace) if shipped and current, else one computed by the oracle now."""
    path = goldens.OUTPUTS / model_dir.name / f"{trace_path.stem}.json"
    if path.exists():
        g = json.loads(path.read_text())
        if g.get("model_sha256") == goldens.model_sha256(model_dir):
            g["source"] = f"golden {path.relative_to(goldens.ROOT)}"
            return g
    g = goldens.golden_for(oracle_model, model_dir, trace_path)
    g["source"] = "oracle (computed now; no shipped golden for this model/trace)"
    return g


def continuation(adapter_cls, model_dir: Path, trace, req, device: str):
    """Teacher forcing for the tie-aware check: the engine's own continuation after prompt + the oracle's prefix,
    from a one-request trace through the same engine (its prefix becomes part of the prompt)."""
    from oracle.trace import parse_trace

    def run(prefix: list[int]) -> list[int]:
        left = req.max_new_tokens - len(prefix)
        if left <= 0 or (prefix and prefix[-1] in req.stop_token_ids):
            return []
        one = parse_trace({"schema": "hybridqual.trace/1", "engine": trace.engine.to_json(),
                           "requests": [{"id": req.id, "arrival_step": 0, "prompt": list(req.prompt) + list(prefix),
                                         "max_new_tokens": left, "stop_token_ids": list(req.stop_token_ids),
                                         "sampling": req.sampling.to_json()}]})
        return adapter_cls(model_dir, one, "legacy", device).run_trace().tokens[req.id]
    return run


def check_trace(adapter_cls, model_dir: Path, trace_path: Path, modes: list[str], oracle_model,
                device: str, tau: float) -> list[Check]:
    """Every check for one trace."""
    import oracle
    trace = oracle.load_trace(trace_path)
    name = trace_path.stem
    truth = truth_for(model_dir, trace_path, oracle_model)
    checks, runs = [], {}
    for mode in modes:
        t0 = time.time()
        try:
            run = adapter_cls(model_dir, trace, mode, device).run_trace()
        except Exception as e:  # an engine crash is a failed check with its message, not a traceback
            checks.append(Check(name, f"{mode}: engine runs the trace", False, f"{type(e).__name__}: {e}",
                                time.time() - t0))
            continue
        runs[mode] = run
        bad, ties = [], []
        for req in trace.requests:
            want = truth["requests"][req.id]["tokens"]
            got = run.tokens.get(req.id, [])
            if got == want:
                continue
            v = compare_tie_aware(oracle_model, req.id, req.prompt, got, req.stop_token_ids,
                                  req.max_new_tokens, tau, sampling=req.sampling,
                                  continue_from=continuation(adapter_cls, model_dir, trace, req, device))
            ties += [f"{m.request}@{m.position}: oracle {m.oracle_token} vs {m.candidate_token}, "
                     f"gap {m.oracle_gap:.2e}, margin {m.oracle_margin:.2e}" for m in v.near_ties]
            if not v.ok:
                f = v.failure
                bad.append(f"request {req.id} position {f.position}: oracle token {f.oracle_token} "
                           f"(margin {f.oracle_margin:.3g}) vs engine {f.candidate_token} (oracle gap {f.oracle_gap:.3g})"
                           if f else f"request {req.id}: {v.note}")
        detail = "; ".join(bad) or (f"near ties: {'; '.join(ties)}" if ties else f"{len(trace.requests)} requests exact")
        checks.append(Check(name, f"{mode}: tokens match the truth (tie-aware, τ={tau:g})", not bad, detail,
                            time.time() - t0))
        if run.digest is not None and not getattr(adapter_cls, "batch_invariant", False):
            want = truth["schedule_digest"][mode]
            checks.append(Check(name, f"{mode}: schedule log matches the oracle's", run.digest == want,
                                f"digest {run.digest[:12]} vs {want[:12]}"))
    if "legacy" in runs and "async" in runs:
        diffs = compare_bitwise(runs["legacy"].tokens, runs["async"].tokens)
        checks.append(Check(name, "async == legacy, bitwise", not diffs, "; ".join(diffs) or "identical"))
    if runs and task_traces.is_task_trace(trace):
        want = task_traces.task_accuracy(trace, {r: g["tokens"] for r, g in truth["requests"].items()})
        got = {mode: task_traces.task_accuracy(trace, run.tokens) for mode, run in runs.items()}
        checks.append(Check(name, "task accuracy identical in every mode and to the oracle's",
                            all(a == want for a in got.values()),
                            f"oracle {want:.3f}; " + ", ".join(f"{m} {a:.3f}" for m, a in got.items())))
    return checks


def junit(checks: list[Check]) -> str:
    """JUnit XML for CI dashboards."""
    suite = ET.Element("testsuite", name="hybridqual.qualify", tests=str(len(checks)),
                       failures=str(sum(not c.ok for c in checks)))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=c.trace, name=c.name, time=f"{c.seconds:.3f}")
        if not c.ok:
            ET.SubElement(case, "failure", message=c.detail[:500]).text = c.detail
    return ET.tostring(suite, encoding="unicode")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.qualify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF-format model folder")
    ap.add_argument("--engine", default="fastpath", help="fastpath | oracle | hf | module:Class")
    ap.add_argument("--mode", nargs="+", default=["legacy", "async"], choices=["legacy", "async"])
    ap.add_argument("--trace", nargs="+", type=Path, help="trace files (default: goldens/traces/*.json)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tau", type=float, default=TAU[torch.float32], help="near-tie threshold on the oracle logit gap")
    ap.add_argument("--out", type=Path, default=Path("out/qualify"))
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (launch with torchrun --nproc_per_node N)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="fast path in batch-invariant mode (its prefill pieces depend only on the request, so its "
                         "schedule log is not the default policy's and is not compared)")
    args = ap.parse_args(argv)
    import os
    if args.tp < 1 or (args.tp > 1 and int(os.environ.get("WORLD_SIZE", "1")) != args.tp):
        print(f"--tp {args.tp}: needs torchrun --nproc_per_node {args.tp} (WORLD_SIZE="
              f"{os.environ.get('WORLD_SIZE', 'unset')})", file=sys.stderr)
        return 2
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if not rank0:   # every rank runs the same traces; only rank 0 reports
        sys.stdout = open(os.devnull, "w")

    import oracle
    if not (args.model / "config.json").exists():
        print(f"--model {args.model}: no config.json there", file=sys.stderr)
        return 2
    try:
        adapter_cls = adapters.resolve(args.engine)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.tp > 1 or args.batch_invariant:
        if not issubclass(adapter_cls, adapters.FastpathAdapter):
            print("--tp / --batch-invariant apply to the fastpath engine only", file=sys.stderr)
            return 2
        adapter_cls = type("FastpathAdapterConfigured", (adapter_cls,),
                           {"tp": args.tp, "batch_invariant": args.batch_invariant})
    oracle_model = oracle.load(args.model, dtype=torch.float64)
    traces = args.trace or sorted(goldens.TRACES.glob("*.json"))
    traces = [t for t in traces if goldens.trace_fits(oracle.load_trace(t), oracle_model.config.vocab_size)]
    print(f"hybridqual qualify: engine={args.engine} model={args.model} modes={','.join(args.mode)} "
          f"traces={len(traces)}" + (f" tp={args.tp}" if args.tp > 1 else "")
          + (" batch-invariant" if args.batch_invariant else ""))
    checks: list[Check] = []
    t0 = time.time()
    for i, tpath in enumerate(traces, 1):
        print(f"[{i}/{len(traces)}] {tpath.stem} ...", flush=True)
        for c in check_trace(adapter_cls, args.model, tpath, args.mode, oracle_model, args.device, args.tau):
            checks.append(c)
            print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}", flush=True)
    failed = sum(not c.ok for c in checks)
    if not rank0:
        return 0 if (checks and not failed) else 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(
        {"engine": args.engine, "model": str(args.model), "checks": [asdict(c) for c in checks],
         "passed": len(checks) - failed, "failed": failed}, indent=1))
    (args.out / "junit.xml").write_text(junit(checks))
    print(f"{len(checks) - failed}/{len(checks)} checks passed, {failed} failed, {time.time() - t0:.0f} s; "
          f"report in {args.out}/report.json and junit.xml")
    return 0 if (checks and not failed) else 1


def finish_distributed() -> None:
    """Under torchrun: wait for every rank, then tear the process group down (a rank exiting while gloo's threads
    still run aborts the process)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        rc = main()
    finally:
        finish_distributed()
    sys.exit(rc)
