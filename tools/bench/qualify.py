"""Where a real-size qualification goes: one qualify run timed by phase beside the bytes floor of the same run.

    hybridqual bench qualify --model FOLDER [--engine fastpath] [--device cpu|cuda] [--oracle-device D]
        [--scenario NAME ...] [--mode legacy async] [--graphs] [--dtype bfloat16|float32] [--oracle auto|memory|streamed]
        [--truth now|golden] [--probe-mib N] [--qualify-out DIR] [--out F.json] [--summary F.txt]

Runs qualify in this process (`--jobs 1 --in-process`, the plan of `qualify --model FOLDER` or its --scenario /
--mode subset) under tools/bench/timeline.py and reports the truth and the judging, each split into fp64 passes
over the weights (how many, the sequences they served, their time), compute, host work and idle; the engine's
time; loading the oracle; the rest. Beside each: its bytes floor, the model's weights in fp64 bytes × the passes
that phase made ÷ the copy bandwidth measured in the same run where the oracle computes (CPU: a memcpy of
--probe-mib MiB; CUDA: a device copy; bytes read + written over the best time). Peak host RSS of this process and
peak GPU memory (torch's allocator). --truth now (default): every instance's truth computed by the oracle, as at
a model with no shipped goldens; golden: qualify's own rule (a matching shipped golden is read). The timing
changes no result: the verdicts are qualify's own (tests/test_bench_qualify.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridqual.bench import arguments
from hybridqual.bench.timeline import PHASES, Timeline, instrument

GIB = 2 ** 30


@dataclass(frozen=True)
class Copy:
    """The copy bandwidth the floor uses: where, how many bytes were copied, (read + written bytes) / seconds."""
    where: str
    bytes: int
    gb_per_s: float


@dataclass
class PhaseFigures:
    """One phase's wall time split, its passes and its bytes floor (seconds)."""
    wall_s: float
    passes: int
    passes_s: float
    compute_s: float
    host_s: float
    idle_s: float
    floor_s: float
    sequences: int = 0
    tokens: int = 0
    passes_by_kind: dict[str, int] = field(default_factory=dict)


@dataclass
class QualifyBench:
    """What `bench qualify` writes (--out)."""
    date: str                           # when the run began
    commit: str | None
    command: str
    model: str
    parameters: int
    weights_fp64_bytes: int
    engine: str
    device: str
    oracle_device: str
    truth: str
    copy: Copy
    wall_s: float
    truth_phase: PhaseFigures
    judging: PhaseFigures
    engine_s: float
    engine_runs: int
    load_s: float
    other_s: float
    parts_sum_s: float
    peak_host_rss_gib: float
    peak_gpu_allocated_gib: float | None
    peak_gpu_reserved_gib: float | None
    instances: list[dict]               # per instance and phase: label, wall_s, engine_s, passes (timeline)
    verdicts: dict[str, int]
    qualify_status: str                 # report.json's status ("finished", or "aborted: <why>" when cut short)
    qualify_rc: int
    qualify_out: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridqual bench qualify", description=__doc__.split("\n")[0],
                                 epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the model folder (config.json + safetensors)")
    ap.add_argument("--engine", default="fastpath", help="qualify's --engine")
    ap.add_argument("--device", default="cpu", help="qualify's --device: cpu or cuda")
    ap.add_argument("--oracle-device", default=None, help="where the fp64 oracle computes (default: --device)")
    ap.add_argument("--scenario", nargs="+", help="only these scenarios (qualify's --scenario)")
    ap.add_argument("--mode", nargs="+", choices=["legacy", "async"], help="qualify's --mode (default: both)")
    ap.add_argument("--graphs", action="store_true", help="qualify's --graphs")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="qualify's --dtype")
    ap.add_argument("--oracle", choices=["auto", "memory", "streamed"], default="auto", help="qualify's --oracle")
    ap.add_argument("--truth", choices=["now", "golden"], default="now",
                    help="now: the oracle computes every truth; golden: a matching shipped golden is read")
    ap.add_argument("--probe-mib", type=int, default=256, help="MiB copied by the bandwidth probe (default 256)")
    ap.add_argument("--qualify-out", type=Path, default=Path("out/bench_qualify"), help="qualify's --out")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--summary", help="write the summary table here")
    return ap.parse_args(argv)


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first bad argument as one line naming its flag, or None (checked before any work)."""
    def device(flag: str, value: str) -> str | None:
        try:
            kind = torch.device(value).type
        except (RuntimeError, TypeError):
            return f"{flag} {value!r}: not a torch device"
        if kind not in ("cpu", "cuda"):
            return f"{flag} {value}: only cpu and cuda are supported"
        if kind == "cuda" and not torch.cuda.is_available():
            return f"{flag} {value}: CUDA is not available on this machine"
        return None
    return arguments.first(
        None if (args.model / "config.json").is_file() else f"--model {args.model}: no config.json there",
        device("--device", args.device), device("--oracle-device", args.oracle_device),
        arguments.in_range("--probe-mib", args.probe_mib, 1, 1 << 16),
        None if not args.qualify_out.is_file() else f"--qualify-out {args.qualify_out}: is a file, not a folder",
        arguments.writable_file("--out", args.out), arguments.writable_file("--summary", args.summary))


def copy_bandwidth(device: str, mib: int) -> Copy:
    """(read + written bytes) / best time of copying `mib` MiB where the oracle computes: a memcpy on the CPU
    (torch's copy of a byte tensor), a device-to-device copy on CUDA (timed by events, after a warm-up)."""
    dev = torch.device(device)
    n = mib * 2 ** 20
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3 if dev.type == "cpu" else 2):
        dst.copy_(src)                                  # warm-up: pages touched, kernels loaded
    for _ in range(7 if dev.type == "cpu" else 20):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    where = f"{'device copy on ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU memcpy'}"
    return Copy(where, n, 2 * n / best / 1e9)


def qualify_argv(args: argparse.Namespace) -> list[str]:
    """qualify's arguments for this bench: the subset asked for, in this process, one instance at a time."""
    argv = ["--model", str(args.model), "--engine", args.engine, "--device", args.device,
            "--oracle-device", args.oracle_device, "--oracle", args.oracle, "--jobs", "1", "--in-process",
            "--out", str(args.qualify_out), "--quiet"]
    argv += (["--scenario", *args.scenario] if args.scenario else []) + (["--mode", *args.mode] if args.mode else [])
    return argv + (["--graphs"] if args.graphs else []) + (["--dtype", args.dtype] if args.dtype else [])


def _sync_for(devices: set[str]):
    cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    return (lambda: [torch.cuda.synchronize(d) for d in cuda]) if cuda else (lambda: None)


def _phase(tl: Timeline, name: str, weight_bytes: int, copy: Copy) -> PhaseFigures:
    split, p = tl.phase(name), tl.passes[name]
    return PhaseFigures(split["wall_s"] - split["engine_s"], p.count, split["passes_s"], split["compute_s"],
                        split["host_s"], split["idle_s"], weight_bytes * p.count / (copy.gb_per_s * 1e9),
                        p.sequences, p.tokens, dict(p.by_kind))


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def measure(args: argparse.Namespace, command: str) -> QualifyBench:
    """Probe the copy bandwidth, run qualify timed, and gather the figures."""
    from hybridqual.qualify import runner
    from oracle.checkpoint import from_hf_config
    from oracle.streamed import in_memory_bytes
    began = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    weight_bytes = in_memory_bytes(from_hf_config(str(args.model)), torch.float64)
    copy = copy_bandwidth(args.oracle_device, args.probe_mib)
    cuda = torch.cuda.is_available() and "cuda" in (torch.device(args.device).type,
                                                    torch.device(args.oracle_device).type)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    report = args.qualify_out / "report.json"
    report.unlink(missing_ok=True)           # as qualify does at its start: no earlier run's counts read back
    tl = Timeline(_sync_for({args.device, args.oracle_device}))
    with instrument(tl, recompute_truth=args.truth == "now"):
        t0 = time.perf_counter()
        tl.start()
        rc = runner.main(qualify_argv(args))
        tl.close()
        wall = time.perf_counter() - t0
    engine = sum(tl.phase(p)["engine_s"] for p in PHASES)
    truth, judging = _phase(tl, "truth", weight_bytes, copy), _phase(tl, "judging", weight_bytes, copy)
    load, other = tl.phase("load")["wall_s"], tl.phase("other")["wall_s"] - tl.phase("other")["engine_s"]
    counts = json.loads(report.read_text()) if report.is_file() else {}
    return QualifyBench(
        began, _commit(), command,
        str(args.model), weight_bytes // 8, weight_bytes, args.engine, args.device, args.oracle_device, args.truth,
        copy, wall, truth, judging, engine, tl.engine_runs, load, other,
        truth.wall_s + judging.wall_s + engine + load + other,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
        torch.cuda.max_memory_allocated() / GIB if cuda else None,
        torch.cuda.max_memory_reserved() / GIB if cuda else None, [asdict(i) for i in tl.instances],
        {k: int(counts.get(k, 0)) for k in ("passed", "failed", "skipped")}, str(counts.get("status", "no report")),
        rc, str(args.qualify_out))


def _size(n: float) -> str:
    """Bytes in decimal units (kB, MB, GB), three significant figures."""
    unit = next((u for u in ((1e9, "GB"), (1e6, "MB")) if n >= u[0]), (1e3, "kB"))
    return f"{n / unit[0]:.3g} {unit[1]}"


def _slowest(b: QualifyBench, phase: str, n: int = 3) -> str:
    """The `n` slowest instances of a phase, each with its passes (and its engine time, judging)."""
    rows = sorted((i for i in b.instances if i["phase"] == phase), key=lambda i: -i["wall_s"])[:n]
    return f"slowest {phase}: " + ("; ".join(
        f"{i['label']} {i['wall_s']:.2f} s ({i['passes']} passes"
        + (f", engine {i['engine_s']:.2f} s)" if phase == "judging" else ")") for i in rows) or "none")


def summary(b: QualifyBench) -> str:
    """The short table: truth and judging split, the floor beside each, the engine, memory and verdicts."""
    def row(name: str, p: PhaseFigures) -> str:
        ratio = f"{p.wall_s / p.floor_s:.0f}×" if p.floor_s > 0 else "—"
        return (f"| {name} | {p.wall_s:.2f} | {p.passes} ({p.sequences} seq, {p.tokens} tok): {p.passes_s:.2f} | "
                f"{p.compute_s:.2f} | {p.host_s:.2f} | {p.idle_s:.2f} | {p.floor_s:.4g} | {ratio} |")
    gpu = "n/a" if b.peak_gpu_allocated_gib is None else \
        f"{b.peak_gpu_allocated_gib:.2f} GiB allocated ({b.peak_gpu_reserved_gib:.2f} reserved)"
    return "\n".join([
        f"bench qualify: {b.model} ({b.parameters:,} parameters, fp64 {_size(b.weights_fp64_bytes)}), "
        f"engine {b.engine} on {b.device}, oracle on {b.oracle_device}, truth {b.truth}; {b.date}, "
        f"commit {b.commit or 'unknown'}",
        f"copy bandwidth {b.copy.gb_per_s:.1f} GB/s ({b.copy.where}, {b.copy.bytes / 2 ** 20:.0f} MiB)",
        "| part | wall s | fp64 passes: s | compute s | host s | idle s | bytes floor s | wall / floor |",
        "|---|---|---|---|---|---|---|---|",
        row("truth", b.truth_phase), row("judging", b.judging),
        f"| engine ({b.engine_runs} runs) | {b.engine_s:.2f} | | | | | | |",
        f"| oracle load | {b.load_s:.2f} | | | | | | |",
        f"| other (plan, report) | {b.other_s:.2f} | | | | | | |",
        f"| **total** | {b.wall_s:.2f} (parts {b.parts_sum_s:.2f}) | | | | | "
        f"{b.truth_phase.floor_s + b.judging.floor_s:.4g} | |",
        *(_slowest(b, phase) for phase in ("truth", "judging")),
        f"peak host RSS {b.peak_host_rss_gib:.2f} GiB (this process); peak GPU {gpu}",
        f"verdicts: {b.verdicts['passed']} PASS, {b.verdicts['failed']} FAIL, {b.verdicts['skipped']} SKIP; "
        f"qualify {b.qualify_status}, exit {b.qualify_rc}; report in {b.qualify_out}/report.json"])


def main(argv: list[str] | None = None) -> int:
    """Run the bench; qualify's exit code (2 for a bad argument, before any work)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.oracle_device = args.oracle_device or args.device
    problem = argument_problem(args)
    if problem:
        return arguments.refuse(problem)
    b = measure(args, "hybridqual bench qualify " + shlex.join(argv))
    text = summary(b)
    print(text, flush=True)
    if args.summary:
        Path(args.summary).write_text(text + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(b), indent=1) + "\n")
    return b.qualify_rc


if __name__ == "__main__":
    sys.exit(main())
