"""Golden outputs (DESIGN §6): regenerate them from the oracle, or check that the shipped ones still hold.

    python -m tools.goldens regen   [--model NAME] [--trace NAME] [--force]   # rewrite, print a diff summary
    python -m tools.goldens regen --check                             # regenerate in memory, fail on any difference
    python -m tools.goldens zoo [--force]                             # write the random zoo models (one per arch)

Goldens come only from the oracle (fp64) — never from the fast path — and are never edited by hand. Writes are
all-or-nothing: every golden (every zoo model) is computed first, then the changed files are moved into place; a
shipped file that would change is overwritten only with --force (new files, and unreadable goldens, need none).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from .paths import MODELS, OUTPUTS, ROOT, TRACES  # noqa: F401  (module globals: tests point them at a copy)
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
    return golden_for_trace(model, model_dir, oracle.load_trace(trace_path), trace_path.stem)


def trace_sha256(trace) -> str:
    """sha256 of the canonical dump of a Trace: what a golden's "trace_sha256" is."""
    from oracle.trace import dump_trace
    return hashlib.sha256(dump_trace(trace).encode()).hexdigest()


def golden_for_trace(model, model_dir: Path, trace, name: str) -> dict:
    """The golden record of golden_for for a Trace object (e.g. a scenario instance) named `name`."""
    import oracle
    from oracle.trace import dump_trace
    from .compare import teacher_forced_logits, top2_margin

    trace_path = Path(f"{name}.json")
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


def read_golden(path: Path) -> tuple[dict | None, str | None]:
    """(record, None) for a readable golden, (None, None) when there is none, (None, "CORRUPT ...") when the file
    cannot be read as a golden record (it is then regenerated, never a reason to stop)."""
    if not path.exists():
        return None, None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"CORRUPT ({type(e).__name__}: {str(e)[:80]})"
    if not (isinstance(old, dict) and isinstance(old.get("requests", {}), dict)):
        return None, "CORRUPT (not a golden record object)"
    return old, None


def write_all(files: dict[Path, str]) -> None:
    """Write every file or none: stage them all in a temp folder beside OUTPUTS (same filesystem), then move each
    into place with os.replace (atomic per file), so an error while computing or staging leaves the goldens as
    they were."""
    OUTPUTS.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".regen-", dir=OUTPUTS.parent) as tmp:
        staged = []
        for i, (dest, text) in enumerate(files.items()):
            p = Path(tmp) / f"{i}.json"
            p.write_text(text, encoding="utf-8")
            staged.append((p, dest))
        for p, dest in staged:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dest)


def regen(check: bool, model_filter: str | None = None, trace_filter: str | None = None,
          force: bool = False) -> int:
    """Regenerate goldens (or check them); returns the process exit code.

    Computes every golden first; writes only if no readable shipped golden would change, or with `force`."""
    import oracle
    loaded: dict[Path, object] = {}
    changed: dict[Path, str] = {}
    refused, count = [], 0
    for mdir, tpath in pairs(model_filter, trace_filter):
        model = loaded.setdefault(mdir, oracle.load(mdir, dtype=torch.float64))
        trace = oracle.load_trace(tpath)
        if not trace_fits(trace, model.config.vocab_size):
            print(f"  skip   {mdir.name} × {tpath.stem}: trace tokens exceed vocab {model.config.vocab_size}")
            continue
        out = OUTPUTS / mdir.name / f"{tpath.stem}.json"
        old, corrupt = read_golden(out)
        new = json.loads(canonical(golden_for(model, mdir, tpath)))
        status = corrupt or diff_summary(old, new)
        count += 1
        print(f"  {'ok    ' if status == 'unchanged' else 'DIFF  ' if check else 'write '}"
              f"{mdir.name} × {tpath.stem}: {status}", flush=True)
        if status != "unchanged":
            changed[out] = canonical(new)
            if status.startswith("CHANGED"):
                refused.append(f"{mdir.name} × {tpath.stem}")
    if count == 0:
        print("no (model, trace) pairs found", file=sys.stderr)
        return 2
    if check:
        print(f"{count} goldens, {len(changed)} differ")
        return 1 if changed else 0
    if refused and not force:
        print(f"refusing to overwrite {len(refused)} shipped golden(s) that would change ({', '.join(refused)}); "
              f"nothing written. Rerun with --force to write them.", file=sys.stderr)
        return 1
    write_all(changed)
    print(f"{count} goldens, {len(changed)} written")
    return 0


ZOO_ARCHS = ("bamba", "nemotron_h", "mamba2", "granitemoehybrid")


def _model_status(dest: Path, new_sha: str) -> str:
    """'new', 'unchanged', 'CHANGED sha256 a -> b' or 'CORRUPT (...)' for an existing zoo folder."""
    if not dest.exists():
        return "new"
    try:
        old_sha = model_sha256(dest)
    except OSError as e:
        return f"CORRUPT ({type(e).__name__}: {str(e)[:80]})"
    return "unchanged" if old_sha == new_sha else f"CHANGED sha256 {old_sha[:16]} -> {new_sha[:16]}"


def _swap_folder(new: Path, dest: Path, trash: Path) -> None:
    """Put folder `new` at `dest`: the old folder is renamed aside first and put back if the second rename fails."""
    if dest.exists():
        os.replace(dest, trash)
    try:
        os.replace(new, dest)
    except OSError:
        if trash.exists():
            os.replace(trash, dest)
        raise


def write_zoo(seed: int, force: bool = False) -> int:
    """Write goldens/models/zoo-<arch> for every architecture from oracle.zoo (deterministic in the seed).

    All are built in a temp folder first; an existing model that would change is replaced only with `force`."""
    from oracle import zoo
    MODELS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".zoo-", dir=MODELS.parent) as tmp:
        plan, refused = [], []
        for arch in ZOO_ARCHS:
            staged, dest = Path(tmp) / f"zoo-{arch}", MODELS / f"zoo-{arch}"
            zoo.write_hf_folder(staged, arch, seed=seed)
            status = _model_status(dest, model_sha256(staged))
            print(f"  {dest.name}: {status}")
            plan.append((staged, dest, status))
            if status.startswith("CHANGED"):
                refused.append(dest.name)
        if refused and not force:
            print(f"refusing to overwrite {len(refused)} shipped zoo model(s) that would change ({', '.join(refused)}); "
                  f"nothing written. Rerun with --force to write them.", file=sys.stderr)
            return 1
        written = [dest.name for staged, dest, status in plan if status != "unchanged"]
        for staged, dest, status in plan:
            if status != "unchanged":
                _swap_folder(staged, dest, Path(tmp) / f"old-{dest.name}")
    print(f"{len(ZOO_ARCHS)} zoo models, {len(written)} written")
    if written:
        print(f"goldens of {', '.join(written)} no longer match their model: run `goldens regen --force --model NAME`")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.goldens", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("regen", help="regenerate goldens from the oracle")
    r.add_argument("--check", action="store_true", help="regenerate in memory and fail on any difference")
    r.add_argument("--model", help="only this model folder name")
    r.add_argument("--trace", help="only this trace name (file stem)")
    r.add_argument("--force", action="store_true", help="also overwrite shipped goldens that would change")
    z = sub.add_parser("zoo", help="(re)write the shipped random zoo models, one per architecture")
    z.add_argument("--seed", type=int, default=0)
    z.add_argument("--force", action="store_true", help="also overwrite shipped zoo models that would change")
    args = ap.parse_args(argv)
    if args.cmd == "zoo":
        return write_zoo(args.seed, args.force)
    return regen(args.check, args.model, args.trace, args.force)


if __name__ == "__main__":
    sys.exit(main())
