"""hybridqual, the harness: qualify an engine against the oracle, replay a trace, regenerate goldens, benchmarks,
and the mutation zoo.

Subpackages, one per responsibility (docs/architecture.md draws who may import whom): `qualify` (the main job and
its checks), `scenarios` (the corpus in a model's units, the default plan), `adapters` (how an engine is driven),
`goldens`, `bench`, `mutants`; single-purpose modules: `cli`, `paths`, `pytest_hq` (the pytest plugin), `replay`,
`train_tiny`, `anchor`, `measure_tau`. The source folder is tools/; installed or in a checkout it is imported as
`hybridqual` only.

On a machine without a GPU the fast path's Triton kernels can only run in the interpreter, so importing the
harness turns it on, through `import fastpath` (before anything imports triton), unless the caller set
TRITON_INTERPRET explicitly; that import loads no torch, so `hybridqual --help` stays fast.
"""
try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("hybridqual")
except PackageNotFoundError:   # a checkout used through PYTHONPATH, never pip-installed
    __version__ = "unknown (not installed)"

import fastpath  # noqa: E402,F401  (turns Triton's interpreter on where there is no GPU)
