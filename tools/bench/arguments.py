"""The benches' argument rules: each bench checks every value before any work, and a bad one is an exit 2 with one
line naming the flag (as hybridqual.qualify.arguments does for qualify).

Each helper returns the problem as one line, or None; `first` picks the first of several, `refuse` prints it.
Imports only the standard library.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path


def first(*problems: str | None) -> str | None:
    """The first problem that is not None (the checks run in the order of the flags)."""
    return next((p for p in problems if p is not None), None)


def refuse(problem: str) -> int:
    """Print `problem` to stderr; the exit code of a bad argument (2)."""
    print(problem, file=sys.stderr)
    return 2


def at_least(flag: str, value: float | None, low: float) -> str | None:
    """`flag VALUE: must be at least LOW` when a given value is below `low` (or not finite)."""
    if value is None or (math.isfinite(value) and value >= low):
        return None
    return f"{flag} {value}: must be at least {low:g}"


def in_range(flag: str, value: int | None, low: int, high: int) -> str | None:
    """`flag VALUE: must be in [LOW, HIGH]` when a given value lies outside."""
    if value is None or low <= value <= high:
        return None
    return f"{flag} {value}: must be in [{low}, {high}]"


def positive_seconds(flag: str, value: float | None) -> str | None:
    """A time budget: a finite number of seconds > 0."""
    if value is None or (math.isfinite(value) and value > 0):
        return None
    return f"{flag} {value}: must be a finite number of seconds > 0"


def int_list(flag: str, text: str, low: int = 1, high: int = 1 << 24) -> str | None:
    """A comma-separated list of integers, each in [low, high], at least one."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        return f"{flag} {text!r}: must be a comma-separated list of integers"
    for t in items:
        try:
            v = int(t)
        except ValueError:
            return f"{flag} {text}: {t!r} is not an integer"
        if not low <= v <= high:
            return f"{flag} {text}: {v} is not in [{low}, {high}]"
    return None


def known(flag: str, names: Iterable[str], choices: Iterable[str]) -> str | None:
    """`flag NAME: no such name (known: ...)` for the first name that is not one of `choices`."""
    choices = list(choices)
    bad = [n for n in names if n not in choices]
    if not bad:
        return None
    return f"{flag} {bad[0]}: not one of {', '.join(choices)}"


def comma_names(flag: str, text: str | None, choices: Iterable[str]) -> str | None:
    """A comma-separated list of names (empty items ignored), each one of `choices`."""
    if text is None:
        return None
    return known(flag, [t for t in text.split(",") if t], choices)


def writable_file(flag: str, path: str | os.PathLike | None) -> str | None:
    """Why the output file `path` of `flag` cannot be written at the end of a run (its folder missing or not
    writable, or it is a folder), or None; creates nothing."""
    if path is None:
        return None
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        return f"{flag} {path}: is a folder, not a file"
    if not folder.is_dir():
        return f"{flag} {path}: its folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{flag} {path}: its folder {folder} is not writable"
    return None
