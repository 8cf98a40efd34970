"""pytest plugin: point the differential suite (or your own tests) at *your* checkpoint and traces.

Installed with hybridqual (entry point `pytest11: hybridqual`), so a plain `pytest` loads it:

    pytest --hq-model PATH [--hq-model PATH2] --hq-trace T1.json [--hq-trace T2.json]

Tests that take the `hq_case` fixture are parametrised over every (model, trace) pair: by default the shipped
models and traces (pairs whose token ids fit the model's vocab). `hq_qualify(AdapterClass)` runs qualify's checks
(tokens vs the truth, schedule log, async == legacy, task accuracy) for the current pair and returns them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import paths


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hybridqual")
    g.addoption("--hq-model", action="append", type=Path, default=[],
                help="HF-format model folder to qualify (repeatable; default: the shipped models)")
    g.addoption("--hq-trace", action="append", type=Path, default=[],
                help="hybridqual.trace/1 JSON file (repeatable; default: the shipped traces)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running; not in hybridqual's default CPU tier")


def default_models() -> list[Path]:
    """The shipped models: the trained tiny model first, then the zoo."""
    models = sorted(p for p in paths.MODELS.glob("*") if (p / "config.json").exists())
    return sorted(models, key=lambda p: (not p.name.startswith("tiny"), p.name))


def _read_json(path: Path, what: str) -> dict:
    """A JSON object from a user-given file, or a usage error naming the option and the path."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise pytest.UsageError(f"{what} {path}: cannot read it as JSON ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise pytest.UsageError(f"{what} {path}: expected a JSON object")
    return obj


def hq_pairs(config: pytest.Config) -> list[tuple[Path, Path]]:
    """(model, trace) pairs to qualify, with trace token ids inside the model's vocab."""
    models = config.getoption("--hq-model") or default_models()
    traces = config.getoption("--hq-trace") or sorted(paths.TRACES.glob("*.json"))
    pairs = []
    for m in models:
        vocab = _read_json(Path(m) / "config.json", "--hq-model").get("vocab_size", 0)
        for t in traces:
            reqs = _read_json(t, "--hq-trace").get("requests", [])
            ids = [x for r in reqs if isinstance(r, dict) for x in (*r.get("prompt", []), *r.get("stop_token_ids", []))]
            if all(isinstance(x, int) and 0 <= x < vocab for x in ids):
                pairs.append((Path(m), Path(t)))
    return pairs


# Pairs of the shipped corpus that run in the CPU tier; every other shipped pair is marked `slow` (the fast path
# runs its kernels through the Triton interpreter on CPU, about a second per step). User-given pairs always run.
FAST_PAIRS = {("tiny-sort", "seed_compaction")}   # zoo models: tests/test_engine_*.py cover them


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "hq_case" in metafunc.fixturenames:
        user = bool(metafunc.config.getoption("--hq-model") or metafunc.config.getoption("--hq-trace"))
        params = [pytest.param((m, t), id=f"{m.name}-{t.stem}",
                               marks=() if user or (m.name, t.stem) in FAST_PAIRS else (pytest.mark.slow,))
                  for m, t in hq_pairs(metafunc.config)]
        metafunc.parametrize("hq_case", params)


@pytest.fixture(scope="session")
def _hq_oracles() -> dict:
    return {}


@pytest.fixture
def hq_qualify(hq_case, _hq_oracles):
    """hq_qualify(adapter_cls, modes=("legacy", "async"), device="cpu", tau=None) -> list of qualify Checks for the
    current (model, trace) (`tau` None: the engine's compute dtype's); the fp64 oracle loads once per model."""
    import torch

    import oracle

    from .qualify import check_trace

    model_dir, trace_path = hq_case

    def run(adapter_cls, modes=("legacy", "async"), device: str = "cpu", tau: float | None = None) -> list:
        if model_dir not in _hq_oracles:
            _hq_oracles[model_dir] = oracle.load(model_dir, dtype=torch.float64)
        return check_trace(adapter_cls, model_dir, trace_path, list(modes), _hq_oracles[model_dir], device, tau)
    return run
