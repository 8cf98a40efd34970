"""Where the harness finds its shipped data: one place, so a checkout and an installed wheel agree.

Installed (`pip install hybridqual`), the goldens are package data at `hybridqual/data/` (models/, traces/,
outputs/). In a source checkout they are the card's top-level `goldens/` folder next to `tools/`. The installed
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
