"""Print the kernel rows of benchmark JSON files as the markdown table docs/performance.md keeps.

    python -m hybridqual.bench.table OUT/bench_kernels.json [...]      # or: python tools/bench/table.py FILE ...

Reads the files `hybridqual bench kernels --out F` writes (`device`, `date`, `ceilings`, `rows` of name / ms / floor_ms /
peer_ms); needs no GPU. A file without those fields is refused by name, never printed as a partial table.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

HEADER = ("| kernel | card | figure | floor | peer (same run) | when (UTC), command |\n"
          "|---|---|---|---|---|---|")


@dataclass(frozen=True)
class KernelRow:
    """One timed kernel of one run."""
    name: str
    ms: float
    floor_ms: float
    peer_ms: float | None


@dataclass(frozen=True)
class KernelRun:
    """One `bench kernels` JSON file: where and when it ran, and its rows."""
    path: str
    device: str
    date: str
    copy_tbps: float
    rows: tuple[KernelRow, ...]


def _field(obj: dict, key: str, where: str, kind: type | tuple[type, ...]):
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: field {key!r} is {type(value).__name__}, expected {kind}")
    return value


def load_run(path: str) -> KernelRun:
    """Parse one kernels JSON file; ValueError names the file and the field that is missing or mistyped."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    number = (int, float)
    rows = []
    for i, r in enumerate(_field(data, "rows", path, list)):
        where = f"{path}: rows[{i}]"
        peer = r.get("peer_ms") if isinstance(r, dict) else None
        if peer is not None and (not isinstance(peer, number) or isinstance(peer, bool)):
            raise ValueError(f"{where}: field 'peer_ms' is {type(peer).__name__}, expected a number or null")
        rows.append(KernelRow(_field(r, "name", where, str), float(_field(r, "ms", where, number)),
                              float(_field(r, "floor_ms", where, number)), None if peer is None else float(peer)))
    ceilings = _field(data, "ceilings", path, dict)
    return KernelRun(path, _field(data, "device", path, str), _field(data, "date", path, str),
                     float(_field(ceilings, "copy_TBps", f"{path}: ceilings", number)), tuple(rows))


def markdown(runs: list[KernelRun], command: str) -> str:
    """The table: one line per row of every run, its card, floor, peer ratio and the run's date and command."""
    lines = [HEADER]
    for run in runs:
        for r in run.rows:
            peer = "—" if r.peer_ms is None else f"{r.peer_ms:.3f} ms ({r.peer_ms / r.ms:.2f}×)"
            lines.append(f"| {r.name} | {run.device} | {r.ms:.3f} ms | {r.floor_ms:.3f} ms "
                         f"(copy {run.copy_tbps:.2f} TB/s) | {peer} | {run.date}, `{command}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table; exit 2 naming the file and field when an input is not a kernels JSON file."""
    ap = argparse.ArgumentParser(prog="hybridqual bench table", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSON files written by `hybridqual bench kernels --out F`")
    ap.add_argument("--command", default="bash tools/bench/gpu_run.sh",
                    help="the command that produced the files, printed in the last column")
    args = ap.parse_args(argv)
    try:
        runs = [load_run(p) for p in args.files]
    except ValueError as e:
        print(f"bench table: {e}", file=sys.stderr)
        return 2
    print(markdown(runs, args.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
