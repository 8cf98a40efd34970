"""Golden outputs (DESIGN §6): regenerate them from the oracle, or check that the shipped ones still hold.

    python -m tools.goldens regen   [--model NAME] [--trace NAME]     # rewrite, print a diff summary
    python -m tools.goldens regen --check                             # regenerate in memory, fail on any difference
    python -m tools.goldens zoo                                       # write the random zoo models (one per arch)

Goldens come only from the oracle (fp64) — never from the fast path — and are never edited by hand.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODELS, TRACES, OUTPUTS = ROOT / "goldens" / "models", ROOT / "goldens" / "traces", ROOT / "goldens" / "outputs"
SCHEMA = "hybridqual.golden/1"
MARGIN_DECIMALS = 4


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_sha256(folder: Path) -> str:
    """sha256 over config.json and every *.safetensors file of a model folder, in name order."""
    h = hashlib.sha256()
    for p in sorted([folder / "config.json", *folder.glob("*.safetensors")]):
        h.update(p.name.encode()); h.update(sha256_file(p).encode())
    return h.hexdigest()


def trace_fits(trace, vocab_size: int) -> bool:
    """Whether every prompt and stop token of the trace is a token id of this model."""
    ids = [t for r in trace.requests for t in (*r.prompt, *r.stop_token_ids)]
    return all(0 <= t < vocab_size for t in ids)


def golden_for(model, model_dir: Path, trace_path: Path) -> dict:
    """Run the oracle on one (model, trace) in both modes and build the golden record."""
    import oracle
    from oracle.trace import dump_trace
    from tools.compare import teacher_forced_logits, top2_margin

    trace = oracle.load_trace(trace_path)
    results = {mode: oracle.run_trace(model, trace, mode=mode) for mode in ("legacy", "async")}
    legacy = results["legacy"]
    if legacy.tokens != results["async"].tokens:
        raise RuntimeError(f"oracle legacy and async disagree on {trace_path.name}: the scheduler spec is broken")
    requests = {}
    for req in trace.requests:
        toks = legacy.tokens[req.id]
        logits = teacher_forced_logits(model, req.prompt, toks)
        requests[req.id] = {
            "tokens": toks,
            "finish_reason": legacy.finish_reasons[req.id],
            "margins": [round(top2_margin(row), MARGIN_DECIMALS) for row in logits],
        }
    return {
        "schema": SCHEMA,
        "model": model_dir.name,
        "model_sha256": model_sha256(model_dir),
        "trace": trace_path.stem,
        "trace_sha256": hashlib.sha256(dump_trace(trace).encode()).hexdigest(),
        "oracle_dtype": str(model.dtype).replace("torch.", "") if hasattr(model, "dtype") else "float64",
        "requests": requests,
        "schedule_digest": {mode: r.digest for mode, r in results.items()},
    }


def canonical(obj: dict) -> str:
    """Stable JSON text for goldens (sorted keys, one request per line is not needed: diffs are summarised)."""
    return json.dumps(obj, sort_keys=True, indent=1) + "\n"


def pairs(model_filter: str | None, trace_filter: str | None):
    """Every (model folder, trace file) pair the corpus defines, filtered by name."""
    for mdir in sorted(p for p in MODELS.iterdir() if (p / "config.json").exists()):
        if model_filter and mdir.name != model_filter:
            continue
        for tpath in sorted(TRACES.glob("*.json")):
            if trace_filter and tpath.stem != trace_filter:
                continue
            yield mdir, tpath


def diff_summary(old: dict | None, new: dict) -> str:
    """One line saying what changed between two golden records."""
    if old is None:
        return "new"
    if old == new:
        return "unchanged"
    what = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k != "requests"]
    reqs = [r for r in sorted(set(old.get("requests", {})) | set(new["requests"]))
            if old.get("requests", {}).get(r) != new["requests"].get(r)]
    return "CHANGED " + ", ".join(what + [f"request {r}" for r in reqs])


def regen(check: bool, model_filter: str | None = None, trace_filter: str | None = None) -> int:
    """Regenerate goldens (or check them); returns the process exit code."""
    import oracle
    bad, count = 0, 0
    loaded: dict[Path, object] = {}
    for mdir, tpath in pairs(model_filter, trace_filter):
        model = loaded.setdefault(mdir, oracle.load(mdir, dtype=torch.float64))
        trace = oracle.load_trace(tpath)
        if not trace_fits(trace, model.config.vocab_size):
            print(f"  skip   {mdir.name} × {tpath.stem}: trace tokens exceed vocab {model.config.vocab_size}")
            continue
        out = OUTPUTS / mdir.name / f"{tpath.stem}.json"
        old = json.loads(out.read_text()) if out.exists() else None
        new = json.loads(canonical(golden_for(model, mdir, tpath)))
        status = diff_summary(old, new)
        count += 1
        print(f"  {'ok    ' if status == 'unchanged' else 'DIFF  ' if check else 'write '}"
              f"{mdir.name} × {tpath.stem}: {status}")
        if status != "unchanged":
            bad += 1
            if not check:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(canonical(new))
    if count == 0:
        print("no (model, trace) pairs found", file=sys.stderr)
        return 2
    print(f"{count} goldens, {bad} {'differ' if check else 'written'}")
    return 1 if (check and bad) else 0


ZOO_ARCHS = ("bamba", "nemotron_h", "mamba2", "granitemoehybrid")


def write_zoo(seed: int) -> int:
    """Write goldens/models/zoo-<arch> for every architecture from oracle.zoo (deterministic in the seed)."""
    from oracle import zoo
    for arch in ZOO_ARCHS:
        folder = MODELS / f"zoo-{arch}"
        zoo.write_hf_folder(folder, arch, seed=seed)
        print(f"  wrote {folder.relative_to(ROOT)}  sha256 {model_sha256(folder)[:16]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.goldens", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("regen", help="regenerate goldens from the oracle")
    r.add_argument("--check", action="store_true", help="regenerate in memory and fail on any difference")
    r.add_argument("--model", help="only this model folder name")
    r.add_argument("--trace", help="only this trace name (file stem)")
    z = sub.add_parser("zoo", help="(re)write the shipped random zoo models, one per architecture")
    z.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "zoo":
        return write_zoo(args.seed)
    return regen(args.check, args.model, args.trace)


if __name__ == "__main__":
    sys.exit(main())
