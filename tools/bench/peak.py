"""Run a command and print its wall time, peak host RSS and peak GPU memory (benchmark bookkeeping).

    python -m hybridqual.bench.peak LABEL -- python -m hybridqual.qualify ...

The command runs in a child process; host RSS is the child's peak (`resource.getrusage(RUSAGE_CHILDREN)`), GPU
memory the device's peak used memory sampled every 0.2 s through NVML when it is importable (`pynvml` /
nvidia-ml-py), else "n/a". Prints one line: `peak LABEL: wall S s, host RSS G GiB, GPU G GiB, rc N`.
"""
from __future__ import annotations

import resource
import subprocess
import sys
import threading
import time


def _gpu_sampler(stop: threading.Event, peak: list[float]) -> None:
    """Largest used memory of GPU 0 (bytes) while the command runs, sampled through NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:   # noqa: BLE001 - no NVML: report n/a
        return
    base = pynvml.nvmlDeviceGetMemoryInfo(h).used
    peak.append(0.0)
    while not stop.wait(0.2):
        peak[0] = max(peak[0], pynvml.nvmlDeviceGetMemoryInfo(h).used - base)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if "--" not in argv or argv.index("--") != 1 or len(argv) < 3:
        print("usage: python -m hybridqual.bench.peak LABEL -- COMMAND ...", file=sys.stderr)
        return 2
    label, cmd = argv[0], argv[2:]
    stop, gpu = threading.Event(), []
    t = threading.Thread(target=_gpu_sampler, args=(stop, gpu), daemon=True)
    t.start()
    t0 = time.time()
    rc = subprocess.call(cmd)
    wall = time.time() - t0
    stop.set()
    t.join(1.0)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20      # kB -> GiB
    g = f"{gpu[0] / 2**30:.2f} GiB" if gpu else "n/a"
    print(f"peak {label}: wall {wall:.1f} s, host RSS {rss:.2f} GiB, GPU {g} (above the start), rc {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
