"""One fix for the Triton interpreter of older Triton releases (the GPU image's 3.6): there, a scalar loaded inside
a kernel (`tl.load(ptr + pid)`) is a 1-element array, and `range(c0, c1)` over such values calls
`int(array)`, which NumPy >= 2.5 refuses ("only 0-dimensional arrays can be converted to Python scalars").
Triton 3.9 squeezes the array first; this applies the same conversion on releases that do not. Only the
interpreter (TRITON_INTERPRET=1, the CPU path) is touched; compiled kernels never call `__index__`."""
from __future__ import annotations

import inspect


def interpreter_module():
    """Triton's interpreter module, or None when this Triton has none."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:      # pragma: no cover - no interpreter in this Triton
        return None
    return interp


def unwrapped(name: str, flag: str):
    """(the interpreter module, its function `name`) when that function exists and is not already wrapped by us
    (no attribute `flag`), else None."""
    interp = interpreter_module()
    if interp is None:
        return None
    original = getattr(interp, name, None)
    if original is None or getattr(original, flag, False):
        return None
    return interp, original


def apply() -> bool:
    """Patch the interpreter's tensor `__index__` to squeeze first when it does not already; True if patched."""
    found = unwrapped("_patch_lang_tensor", "_hq_squeezes")
    if found is None:
        return False
    interp, original = found
    try:
        if "squeeze" in inspect.getsource(original):
            return False
    except (OSError, TypeError):   # pragma: no cover - no source: patch anyway, the conversion is the same
        pass

    def index(self) -> int:
        return int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1 else int(self.handle.data)

    def patched(tensor, *args, **kwargs):
        out = original(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None and hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index
        return out

    patched._hq_squeezes = True
    interp._patch_lang_tensor = patched
    return True
