"""The trace corpus as scenarios in a model's units (DESIGN §15): each scenario instantiates per model, or is a
skip with its reason. (First cut: the interface; scenarios are being filled in.)"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "goldens" / "traces"
MODELS = ROOT / "goldens" / "models"


@dataclass(frozen=True)
class Instance:
    """One scenario instantiated for one model: its concrete trace, or why it was skipped."""
    scenario: str
    family: str
    trace: "object | None"          # oracle.trace.Trace
    skip_reason: str | None
    concrete: dict | None


def instantiate(model_dir: Path, config, names: list[str] | None = None) -> list[Instance]:
    """Every scenario (or those in `names`) for the model in `model_dir` with `config` (an oracle HybridConfig)."""
    from oracle.trace import TraceError, check_against_model, load_trace
    out = []
    for path in sorted(TRACES.glob("*.json")):
        if names is not None and path.stem not in names:
            continue
        trace = load_trace(path)
        try:
            check_against_model(trace, config.vocab_size, config.chunk_size)
        except TraceError as e:
            out.append(Instance(path.stem, path.stem, None, f"does not fit the model: {e}", None))
            continue
        out.append(Instance(path.stem, path.stem, trace, None, trace.to_json()))
    return out


def default_plan() -> list[tuple[Path, list[str] | None]]:
    """The qualify main job's default: (model folder, scenario names)."""
    return [(MODELS / "tiny-sort", ["seed_compaction", "task_burst", "task_staggered"])]
