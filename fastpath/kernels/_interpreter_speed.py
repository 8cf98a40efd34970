"""One saving for the Triton interpreter (TRITON_INTERPRET=1, the CPU path): a call to a @triton.jit helper inside a
kernel (`pdl_enter`, `softplus`, `sigmoid`, ... once per program of the grid) re-patches the `triton.language`
modules (`inspect.getmembers` over tl, tl.tensor, tl.math: about 0.7 ms a call, ~15% of a tiny model's engine
time) although the launching grid has patched exactly those modules already and keeps them patched until it
returns (the helper's own patch scope is never restored; the grid's restore undoes both). Wrapped here: while a
grid runs, a helper call whose `triton.language` modules that grid patched gets an empty scope; the grid's own
call, a helper that sees a module the grid did not patch, and any call outside a grid run the interpreter's code.
Same bits (tests/test_interpreter_speed.py): the patches the repeat would install are the ones in place. Compiled
kernels never go through this code; the interpreter is only wrapped when it has the shape this relies on."""
from __future__ import annotations


def apply() -> bool:
    """Wrap the interpreter's `_patch_lang` and grid launch so a helper call skips a repeat patch; True if wrapped."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:      # pragma: no cover - no interpreter in this Triton
        return False
    original = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    grid_call = getattr(getattr(interp, "GridExecutor", None), "__call__", None)
    nested_call = getattr(getattr(interp, "InterpretedFunction", None), "__call__", None)
    if original is None or scope_cls is None or getattr(original, "_hq_once", False):
        return False
    # The shape relied on: the grid restores the scope _patch_lang returns; a helper call discards its own.
    if not all(f is not None and "_patch_lang" in f.__code__.co_names for f in (grid_call, nested_call)) or \
            "restore" not in grid_call.__code__.co_names or not hasattr(scope_cls(), "restore"):
        return False
    state = {"grid": False, "live": None}   # in a grid's launch; the language modules that grid patched

    def langs_of(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang(fn):
        langs, live = langs_of(fn), state["live"]
        if live is not None and langs <= live:
            return scope_cls()             # already patched by the running grid: an empty scope
        scope = original(fn)
        if state["grid"] and live is None:     # the grid's own call: what stays patched until it restores
            state["live"] = langs
        return scope

    def run_grid(self, *args, **kwargs):
        if state["grid"]:                  # pragma: no cover - a grid inside a grid: the interpreter's own way
            return grid_call(self, *args, **kwargs)
        state["grid"], state["live"] = True, None
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["grid"], state["live"] = False, None

    patch_lang._hq_once, patch_lang._hq_original, run_grid._hq_original = True, original, grid_call
    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = run_grid
    return True
