"""One saving for the Triton interpreter (TRITON_INTERPRET=1, the CPU path): the interpreter patches the
`triton.language` modules (`inspect.getmembers` over tl, tl.tensor, tl.math, then a wrapper per builtin) at
every grid launch and again at every @triton.jit helper call inside a kernel — our helpers
(`pdl_enter`, `softplus`, ...) and Triton's own (`tl.sum`, `tl.max`, `tl.cumsum`, whose module is tl.core) — once
per program of the grid, then restores the modules after the grid. Wrapped here: the first patch of a language
module is kept for the life of the process, and every later patch of a module already kept is an empty scope.
Under TRITON_INTERPRET=1 every @triton.jit function is interpreted, so nothing in the process ever needs the
unpatched modules back. Same bits (tests/test_interpreter_speed.py): the patches a repeat would install are the
ones in place. Compiled kernels never go through this code; the interpreter is only wrapped when it has the shape
this relies on.

A second saving (`drop_dead_overflow_checks`): the interpreter's options ask for integer-overflow sanitising, so
every int32 add, sub and mul of a kernel (its address arithmetic) is redone in int64 and compared with the int32
range, and the result goes to `device_assert`, which drops it unless the options' `debug` is on (it never is in the
interpreter, and a compiled kernel without debug drops it the same way). Turned off only while `debug` is off: the
work it removes is work whose result was discarded (docs/journal/qualification.md: what it saved the main job).
A kernel's values never pass through the check, so the bits are the same.

A third (`memoize_np_dtype`): the interpreter maps a Triton dtype to its NumPy dtype through a table it rebuilds on
every call (hundreds of thousands of calls an instance); the answer for a hashable dtype is kept after the first
call (block types, which are not hashable, still go through the table). A pure map: the same bits."""
from __future__ import annotations

from ._interpreter_compat import interpreter_module, unwrapped


def apply() -> bool:
    """Wrap the interpreter's `_patch_lang` so a language module is patched once per process; True if wrapped."""
    found = unwrapped("_patch_lang", "_hq_once")
    if found is None:
        return False
    interp, original = found
    import triton.language as tl
    scope_cls = getattr(interp, "_LangPatchScope", None)
    grid_call = getattr(getattr(interp, "GridExecutor", None), "__call__", None)
    nested_call = getattr(getattr(interp, "InterpretedFunction", None), "__call__", None)
    if scope_cls is None:
        return False
    # The shape relied on: launches and helper calls patch through _patch_lang and the grid restores its scope.
    if not all(f is not None and "_patch_lang" in f.__code__.co_names for f in (grid_call, nested_call)) or \
            "restore" not in grid_call.__code__.co_names or not hasattr(scope_cls(), "restore"):
        return False
    kept: set[int] = set()                  # ids of the language modules patched for good (never restored)

    def langs_of(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        langs = langs_of(fn)
        if langs and langs <= kept:
            return scope_cls()             # already patched, and kept patched: nothing to do or undo
        original(fn)                       # its scope is dropped: nothing ever restores these patches
        kept.update(langs)
        return scope_cls()

    patch_lang._hq_once, patch_lang._hq_original = True, original
    interp._patch_lang = patch_lang
    return True


def drop_dead_overflow_checks() -> bool:
    """Turn the interpreter's integer-overflow sanitiser off when its asserts are dropped anyway (`debug` off);
    True if turned off."""
    import dataclasses
    builder = getattr(interpreter_module(), "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if opts is None or getattr(opts, "debug", True) or not getattr(opts, "sanitize_overflow", False) \
            or not dataclasses.is_dataclass(opts):
        return False
    builder.options = dataclasses.replace(opts, sanitize_overflow=False)
    return True


def memoize_np_dtype() -> bool:
    """Keep the interpreter's Triton-to-NumPy dtype answers per hashable dtype; True if wrapped."""
    found = unwrapped("_get_np_dtype", "_hq_memo")
    if found is None:
        return False
    interp, original = found
    known: dict = {}

    def get_np_dtype(tt_dtype):
        try:
            return known[tt_dtype]
        except KeyError:
            known[tt_dtype] = answer = original(tt_dtype)
            return answer
        except TypeError:                  # an unhashable (block) type: the table every time
            return original(tt_dtype)

    get_np_dtype._hq_memo, get_np_dtype._hq_original = True, original
    interp._get_np_dtype = get_np_dtype
    return True
