"""pytest plugin: point the differential suite at *your* checkpoint and traces.

    python -m pytest -p tools.pytest_hq --hq-model PATH [--hq-model PATH2] --hq-trace T1.json [--hq-trace T2.json]

Tests that take the `hq_case` fixture are parametrised over every (model, trace) pair: by default the shipped
models in goldens/models and the traces in goldens/traces (pairs whose token ids fit the model's vocab).
"""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hybridqual")
    g.addoption("--hq-model", action="append", type=Path, default=[],
                help="HF-format model folder to qualify (repeatable; default: the shipped models)")
    g.addoption("--hq-trace", action="append", type=Path, default=[],
                help="hybridqual.trace/1 JSON file (repeatable; default: goldens/traces/*.json)")


def default_models() -> list[Path]:
    """The shipped models: the trained tiny model first, then the zoo."""
    models = sorted(p for p in (ROOT / "goldens" / "models").glob("*") if (p / "config.json").exists())
    return sorted(models, key=lambda p: (not p.name.startswith("tiny"), p.name))


def hq_pairs(config: pytest.Config) -> list[tuple[Path, Path]]:
    """(model, trace) pairs to qualify, with trace token ids inside the model's vocab."""
    import json
    models = config.getoption("--hq-model") or default_models()
    traces = config.getoption("--hq-trace") or sorted((ROOT / "goldens" / "traces").glob("*.json"))
    pairs = []
    for m in models:
        vocab = json.loads((m / "config.json").read_text()).get("vocab_size", 0)
        for t in traces:
            reqs = json.loads(Path(t).read_text()).get("requests", [])
            ids = [x for r in reqs for x in (*r.get("prompt", []), *r.get("stop_token_ids", []))]
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
