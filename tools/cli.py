"""The `hybridqual` console script: one entry point for the harness, installed or from a checkout.

    hybridqual qualify [ARGS]          # = python -m hybridqual.qualify (the main job)
    hybridqual list                    # the shipped models and traces (qualify takes their names)
    hybridqual convert FOLDER ...      # = python -m hybridqual.adapters.llamacpp.convert (HF folder to GGUF)
    hybridqual replay TRACE [ARGS]     # = python -m hybridqual.replay
    hybridqual goldens regen|zoo ...   # = python -m hybridqual.goldens
    hybridqual scenarios list|write   # = python -m hybridqual.scenarios (the corpus per model; shipped models)
    hybridqual mutants [ARGS]          # = python -m hybridqual.mutants (needs a source checkout: it mutates the sources)
    hybridqual bench NAME [ARGS]       # = python -m hybridqual.bench.NAME (NAME: engine, kernels, gemm, chain, account,
                                       #   ablation, spec, ssd_fused, invariant, tp — run tp under torchrun:
                                       #   torchrun --nproc_per_node 2 -m hybridqual.bench.tp; sass: static
                                       #   sm_90 register/spill/loop report of kernels, runs without a GPU)

`hybridqual SUBCOMMAND --help` prints that tool's own options.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys

from hybridqual import paths

TOOLS = {"qualify": "qualify.runner", "replay": "replay", "goldens": "goldens.regen", "mutants": "mutants.__main__",
         "scenarios": "scenarios.plan", "convert": "adapters.llamacpp.convert"}
BENCHES = ("engine", "kernels", "gemm", "chain", "ablation", "account", "spec", "ssd_fused", "invariant", "tp",
           "sass")


def _usage() -> str:
    return (__doc__ or "").strip() + f"\n\nversion: {_version()}"


def _version() -> str:
    from hybridqual import __version__
    return __version__


def _call(module: str, prog: str, argv: list[str]) -> int:
    """Run a tool's main(): with argv when it takes one, else through sys.argv (the benches parse sys.argv)."""
    mod = importlib.import_module(f"{__package__}.{module}")
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        rc = mod.main(argv) if inspect.signature(mod.main).parameters else mod.main()
    finally:
        sys.argv = saved
        if hasattr(mod, "finish_distributed"):   # qualify under torchrun: every rank waits, then tears down
            mod.finish_distributed()
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    """Dispatch `hybridqual SUBCOMMAND ARGS...`; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"hybridqual {_version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "list":
        print(paths.listing())
        return 0
    # as `python -m` does: modules in the current folder import (`--engine myengine:MyAdapter`)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if cmd == "mutants" and paths.checkout_root() is None:
        print("hybridqual mutants: the mutation zoo edits the project's sources and runs its test suite, so it needs a "
              "source checkout (git clone the project, then `python -m hybridqual.mutants` there); this is an installed "
              f"copy at {paths.PACKAGE}", file=sys.stderr)
        return 2
    if cmd in TOOLS:
        return _call(TOOLS[cmd], f"hybridqual {cmd}", rest)
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print(f"hybridqual bench NAME [ARGS]: NAME is one of {', '.join(BENCHES)}", file=sys.stderr)
            return 2
        return _call(f"bench.{rest[0]}", f"hybridqual bench {rest[0]}", rest[1:])
    print(f"hybridqual: unknown subcommand {cmd!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
