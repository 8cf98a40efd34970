"""llama.cpp behind hybridqual's adapter protocol: GGUF conversion (convert.py) and the in-process engine run in a
worker process of the llama venv (worker.py, adapter.py). scripts/install-llamacpp.sh makes .venv-llamacpp/;
mutant.py makes the mutated build .venv-llamacpp-mutant/ that qualify must FAIL.

Importing this package needs no llama.cpp (the worker and the converter run in the llama venv's python) and
imports its modules only when a name is used.
"""
from __future__ import annotations

_NAMES = {"ConversionError": "convert", "available": "convert", "convert": "convert", "venv_dir": "convert",
          "LlamaCppAdapter": "adapter", "WorkerError": "adapter", "Worker": "adapter",
          "LlamaCppQ8Adapter": "adapter", "Q8_0": "adapter", "LlamaCppMutantAdapter": "mutant"}


def __getattr__(name: str):
    if name in _NAMES:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(name)


__all__ = sorted(_NAMES)
