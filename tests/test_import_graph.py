"""The layers of docs/architecture.md hold on the import graph: oracle <- fastpath <- hybridqual, no upward import,
no cycle between modules (function-level imports count: a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"oracle": 0, "fastpath": 1, "hybridqual": 2}
# fastpath may read oracle's types and IO, never its math or scheduler (docs/architecture.md)
FASTPATH_MAY_IMPORT = {"oracle", "oracle.config", "oracle.checkpoint", "oracle.trace", "oracle.schedule_log",
                       "oracle.zoo", "oracle.speculative", "oracle.prefix_cache"}


def module_files() -> dict[str, Path]:
    """Every project module by its import name (tools/ is the package hybridqual)."""
    out = {}
    for top, name in (("oracle", "oracle"), ("fastpath", "fastpath"), ("tools", "hybridqual")):
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = [name, *f.relative_to(ROOT / top).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from p import m` counts m when it is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:          # `import a.b.c` of a non-module attribute: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                deps.add(t)
    return deps


def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def test_no_module_imports_a_higher_layer():
    bad = []
    for mod, deps in graph().items():
        for d in deps:
            if LAYERS[d.split(".")[0]] > LAYERS[mod.split(".")[0]]:
                bad.append(f"{mod} imports {d}")
            elif mod.startswith("fastpath") and d.startswith("oracle") and d not in FASTPATH_MAY_IMPORT:
                bad.append(f"{mod} imports {d} (fastpath may use only oracle's types and IO)")
    assert not bad, "\n".join(sorted(bad))


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules():
    cycles = _cycles(graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_graph_check_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a made-up cycle and the real edges are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    g = graph()
    assert "hybridqual.qualify.compare" in g["hybridqual.qualify.checks"]
    assert "oracle.trace" in g["fastpath.engine.engine"]


@pytest.mark.parametrize("package", ["qualify", "scenarios", "adapters", "goldens", "bench", "mutants"])
def test_each_harness_subpackage_says_what_it_owns(package):
    doc = ast.get_docstring(ast.parse((ROOT / "tools" / package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 25 and "import" in doc, f"hybridqual.{package}: no owner/import paragraph"
