"""The harness: qualify (main job), replay, goldens, task traces, benchmarks, mutants.

Installed, this package is `hybridqual` (goldens as package data, a `hybridqual` console script, a pytest plugin).
In a source checkout the same folder is also `tools` (`python -m tools.qualify`); see `_alias` for why both names
give the same module objects there.

On a machine without CUDA the fast path's Triton kernels can only run in the interpreter, so the tools turn it
on (before anything imports triton) unless the caller set TRITON_INTERPRET explicitly.
"""
import os

from ._alias import install as _install_alias

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("hybridqual")
except PackageNotFoundError:   # a checkout used through PYTHONPATH, never pip-installed
    __version__ = "unknown (not installed)"

_install_alias(__name__, __file__)

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
