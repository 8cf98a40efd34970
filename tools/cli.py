"""The `hybridqual` console script: one entry point for the harness, installed or from a checkout.

    hybridqual TOOL [ARGS]          # = python -m hybridqual.TOOL (qualify, replay, goldens, scenarios, mutants, ...)
    hybridqual list                 # the shipped models and traces (qualify takes their names)
    hybridqual bench NAME [ARGS]    # = python -m hybridqual.bench.NAME (a GPU benchmark; `sass` needs no GPU;
                                    #   run `tp` under torchrun: torchrun --nproc_per_node 2 -m hybridqual.bench.tp)

The registry is derived from the package, never kept by hand: a tool is a module of `hybridqual` that defines a
top-level `main` (for a package, the module whose `main` its `__main__.py` runs), plus `convert` (=
hybridqual.adapters.llamacpp.convert, HF folder to GGUF); a bench is a module of `hybridqual.bench` that defines a
top-level `main`. Every such `main` is `main(argv: list[str] | None = None) -> int`, checks every argument before any
work (a bad value: exit 2, one line naming the flag), and is called here one way. `mutants` needs a source checkout
(it mutates the sources). `hybridqual TOOL --help` prints that tool's own options; the lists below are generated.
"""
from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridqual import paths

# A tool whose module sits below a package that is not itself a tool: subcommand -> module under hybridqual.
NESTED = {"convert": "adapters.llamacpp.convert"}
NOT_TOOLS = frozenset({"cli", "bench"})     # this dispatcher, and the bench group (its own registry)
_MAIN = re.compile(r"^def main\(", re.M)
PACKAGE_DIR = Path(__file__).resolve().parent      # hybridqual's folder (tools/ in a checkout)


@dataclass(frozen=True)
class Command:
    """One reachable entry point: its subcommand name, the module (under hybridqual) whose main() runs it, and
    the first line of that module's docstring."""
    name: str
    module: str
    summary: str



def _source(module: str) -> str | None:
    """The source text of hybridqual.<module>, read without importing it or its packages (None when absent)."""
    path = PACKAGE_DIR.joinpath(*module.split(".")).with_suffix(".py")
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _summary(src: str) -> str:
    """The first line of a module's docstring (the listing's one-line description)."""
    doc = ast.get_docstring(ast.parse(src)) or ""
    return doc.strip().split("\n")[0]


def _main_module_of_package(name: str) -> str | None:
    """The module whose main() `python -m hybridqual.<name>` runs: its __main__ when that defines main, else the
    module __main__ imports main from; None for a package without __main__.py."""
    src = _source(f"{name}.__main__")
    if src is None:
        return None
    if _MAIN.search(src):
        return f"{name}.__main__"
    for node in ast.parse(src).body:
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == "main" for a in node.names):
            return f"{name}.{node.module}" if node.level else node.module.removeprefix(f"{__package__}.")
    return None


def tools() -> dict[str, Command]:
    """Every tool subcommand, by name: derived from the modules of the package (see the module docstring)."""
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules([str(PACKAGE_DIR)]):
        if info.name in NOT_TOOLS or info.name.startswith("_"):
            continue
        if info.ispkg:
            module = _main_module_of_package(info.name)
        else:
            src = _source(info.name)
            module = info.name if src is not None and _MAIN.search(src) else None
        if module is not None:
            found[info.name] = module
    found.update(NESTED)
    return {n: Command(n, m, _summary(_source(m) or "")) for n, m in sorted(found.items())}


def benches() -> dict[str, Command]:
    """Every bench, by name: each module of hybridqual.bench that defines a top-level main."""
    out = {}
    for info in sorted(pkgutil.iter_modules([str(PACKAGE_DIR / "bench")]), key=lambda i: i.name):
        src = None if info.ispkg else _source(f"bench.{info.name}")
        if src is not None and _MAIN.search(src):
            out[info.name] = Command(info.name, f"bench.{info.name}", _summary(src))
    return out


def _clip(text: str, room: int) -> str:
    """`text` cut at a word boundary to fit `room` characters (an ellipsis where cut)."""
    return text if len(text) <= room else text[:room - 1].rsplit(" ", 1)[0] + " …"


def _listing(title: str, commands: dict[str, Command]) -> str:
    width = max((len(n) for n in commands), default=0)
    rows = [f"  {c.name:{width}s}  {_clip(c.summary, 114 - width)}" for c in commands.values()]
    return "\n".join([title, *rows])


def _usage() -> str:
    return "\n\n".join([(__doc__ or "").strip(), _listing("tools:", tools()),
                        _listing("benches (hybridqual bench NAME):", benches()), f"version: {_version()}"])


def _version() -> str:
    from hybridqual import __version__
    return __version__


def _call(command: Command, prog: str, argv: list[str]) -> int:
    """Run a command's main(argv) with `prog` as sys.argv[0] (its usage line); an exit it raises (argparse's
    --help and usage errors) is returned as its code, as the process would exit with it."""
    mod = importlib.import_module(f"{__package__}.{command.module}")
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        rc = mod.main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    finally:
        sys.argv = saved
        if hasattr(mod, "finish_distributed"):   # qualify under torchrun: every rank waits, then tears down
            mod.finish_distributed()
    return int(rc or 0)


def _dispatch_bench(rest: list[str]) -> int:
    table = benches()
    if not rest or rest[0] not in table:
        if rest and rest[0] in ("-h", "--help"):
            print(_listing("hybridqual bench NAME [ARGS]; NAME is one of:", table))
            return 0
        got = f"{rest[0]!r} is not a bench; " if rest else ""
        print(f"hybridqual bench NAME [ARGS]: NAME: {got}one of {', '.join(table)}", file=sys.stderr)
        return 2
    return _call(table[rest[0]], f"hybridqual bench {rest[0]}", rest[1:])


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
    if cmd == "bench":
        return _dispatch_bench(rest)
    table = tools()
    if cmd in table:
        return _call(table[cmd], f"hybridqual {cmd}", rest)
    print(f"hybridqual: unknown subcommand {cmd!r}; one of {', '.join([*table, 'list', 'bench'])} "
          "(hybridqual --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
