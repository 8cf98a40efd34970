"""One set of harness modules per process in a source checkout, whichever of its two names is imported.

In a checkout the folder tools/ is importable as `tools` (the source layout: `python -m tools.qualify`) and, through
the editable install, as `hybridqual`. Python would load each file twice, once per name, and then a class built
on `hybridqual.adapters.Adapter` would not be a subclass of `tools.adapters.Adapter`. So the name imported first
is the real one and the other becomes an alias of it: `import tools.x` returns the module `hybridqual.x` (or the
reverse). The alias applies only when the other name would load these very files: a copy of the tree on
PYTHONPATH (the mutant runner's) keeps its own modules, and an installed wheel (a folder named hybridqual, no
`tools` at all) installs no alias.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

NAMES = ("tools", "hybridqual")


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder + loader: `alias[.x]` resolves to the already-importable `canonical[.x]` module."""

    def __init__(self, alias: str, canonical: str, folder: Path) -> None:
        self.alias, self.canonical, self.folder = alias, canonical, folder

    def _same_files(self) -> bool:
        """Whether the other finders would load `alias` from this very folder."""
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(self.alias, None)
            except Exception:   # a third-party finder that cannot answer for a top-level name: not ours
                continue
            if spec is not None:
                return spec.origin is not None and Path(spec.origin).resolve().parent == self.folder
        return False

    def find_spec(self, name, path=None, target=None):
        if name == self.alias:
            return importlib.util.spec_from_loader(name, self) if self._same_files() else None
        if name.startswith(self.alias + ".") and sys.modules.get(self.alias) is sys.modules.get(self.canonical):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None   # a placeholder; exec_module swaps the real module in

    def exec_module(self, module) -> None:
        real = importlib.import_module(self.canonical + module.__name__[len(self.alias):])
        sys.modules[module.__name__] = real   # the import statement returns what sys.modules holds after exec


def install(name: str, init_file: str) -> None:
    """Called by the package's __init__ under the name it is being imported as."""
    folder = Path(init_file).resolve().parent
    if name not in NAMES or folder.name != "tools":
        return   # installed wheel: only `hybridqual` exists, and a user's own `tools` must stay theirs
    alias = NAMES[1 - NAMES.index(name)]
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder(alias, name, folder))
