"""Where the harness finds its shipped data: one place, so a checkout and an installed wheel agree.

Installed (`pip install hybridqual`), the goldens are package data at `hybridqual/data/` (models/, traces/,
outputs/). In a source checkout they are the repository's top-level `goldens/` folder next to `tools/`. The installed
copy wins when both exist.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def checkout_root() -> Path | None:
    """The source checkout this package runs from (the folder holding tools/, oracle/, fastpath/, goldens/), or
    None for an installed wheel, which has no tests/ or sources to mutate."""
    root = PACKAGE.parent
    if PACKAGE.name == "tools" and all((root / d).is_dir() for d in ("oracle", "fastpath", "goldens", "tests")):
        return root
    return None


def goldens_dir() -> Path:
    """The goldens tree: installed package data, else the checkout's goldens/."""
    installed = PACKAGE / "data"
    if (installed / "models").is_dir():
        return installed
    return PACKAGE.parent / "goldens"


GOLDENS = goldens_dir()
ROOT = GOLDENS.parent   # golden paths are printed relative to this (e.g. goldens/outputs/tiny-sort/x.json)
MODELS, TRACES, OUTPUTS = GOLDENS / "models", GOLDENS / "traces", GOLDENS / "outputs"


def shipped_models() -> list[str]:
    """Names of the shipped model folders (goldens/models/<name>, or hybridqual/data/models/<name> installed)."""
    return sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file()) if MODELS.is_dir() else []


def shipped_traces() -> list[str]:
    """Names of the shipped trace files (goldens/traces/<name>.json)."""
    return sorted(p.stem for p in TRACES.glob("*.json")) if TRACES.is_dir() else []


def model_arg(value: str) -> Path:
    """A --model value: a folder, else the name of a shipped model (`--model tiny-sort`)."""
    path = Path(value)
    if not path.exists() and "/" not in value and (MODELS / value / "config.json").is_file():
        return MODELS / value
    return path


def trace_arg(value: str) -> Path:
    """A --trace value: a file, else the name of a shipped trace (`--trace chunked_prefill`)."""
    path = Path(value)
    if not path.exists() and "/" not in value:
        name = value.removesuffix(".json")
        if (TRACES / f"{name}.json").is_file():
            return TRACES / f"{name}.json"
    return path


def listing() -> str:
    """What ships: the model folders and trace files, with where they are on this machine."""
    lines = [f"shipped models ({MODELS}):"]
    lines += [f"  {name}" for name in shipped_models()]
    lines += [f"shipped traces ({TRACES}):"]
    lines += [f"  {name}" for name in shipped_traces()]
    lines.append("use a name or a path: hybridqual qualify --model tiny-sort --trace chunked_prefill")
    return "\n".join(lines)
