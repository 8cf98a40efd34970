"""hybridqual, the harness: qualify an engine against the oracle, replay a trace, regenerate goldens, benchmarks,
and the mutation zoo.

Subpackages, one per responsibility (docs/architecture.md draws who may import whom): `qualify` (the main job and
its checks), `scenarios` (the corpus in a model's units, the default plan), `adapters` (how an engine is driven),
`goldens`, `bench`, `mutants`; single-purpose modules: `cli`, `paths`, `pytest_hq` (the pytest plugin), `replay`,
`train_tiny`, `anchor`, `measure_tau`. The source folder is tools/; installed or in a checkout it is imported as
`hybridqual` only.

On a machine without a GPU the fast path's Triton kernels can only run in the interpreter, so importing the
harness turns it on (before anything imports triton) unless the caller set TRITON_INTERPRET explicitly. The test
is the GPU's device files, so that importing the package (and `hybridqual --help`) does not import torch.
"""
import os

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("hybridqual")
except PackageNotFoundError:   # a checkout used through PYTHONPATH, never pip-installed
    __version__ = "unknown (not installed)"


def _has_gpu_device() -> bool:
    """Whether this machine exposes an NVIDIA or AMD GPU device (what torch.cuda would find), without torch."""
    if os.path.exists("/dev/kfd"):
        return True
    try:
        return any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev"))
    except OSError:
        return False


if "TRITON_INTERPRET" not in os.environ and not _has_gpu_device():
    os.environ["TRITON_INTERPRET"] = "1"
