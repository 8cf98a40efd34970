"""The CPU path runs on Triton interpreters that convert a loaded scalar with int(array) (Triton 3.6, the GPU
image's), which NumPy >= 2.5 refuses: fastpath.kernels._interpreter_compat makes loop bounds loaded inside a kernel
work there too. Simulated here by planting 3.6's conversion and turning NumPy's deprecation into the error."""
from __future__ import annotations

import warnings

import pytest
import torch

from kernel_tiers import skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)


def test_loop_bounds_loaded_in_a_kernel_work_under_an_interpreter_that_does_not_squeeze(monkeypatch):
    skip_cpu_without_interpreter("cpu")
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp
    from fastpath.kernels import _interpreter_compat

    current = interp._patch_lang_tensor

    def triton_3_6(tensor, scope):          # 3.6's conversions, planted over whatever is installed
        current(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    @triton.jit
    def sum_ranges(bounds_ptr, out_ptr):
        s = tl.program_id(0)
        acc = 0
        for c in range(tl.load(bounds_ptr + s), tl.load(bounds_ptr + s + 1)):
            acc += c
        tl.store(out_ptr + s, acc)

    bounds, out = torch.tensor([0, 3, 7], dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    if hasattr(interp._patch_lang, "_hq_original"):   # a patch per launch again, so the planted one is installed
        monkeypatch.setattr(interp, "_patch_lang", interp._patch_lang._hq_original)
    monkeypatch.setattr(interp, "_patch_lang_tensor", triton_3_6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)     # NumPy 2.5's behaviour on NumPy < 2.5
        with pytest.raises(Exception, match="0-dimensional"):
            sum_ranges[(2,)](bounds, out)                        # the defect, reproduced
        assert _interpreter_compat.apply()
        sum_ranges[(2,)](bounds, out)
    assert out.tolist() == [0 + 1 + 2, 3 + 4 + 5 + 6]
