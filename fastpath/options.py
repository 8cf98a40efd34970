"""How the fast path runs: one frozen options object passed to FastModel (and through it to the Engine), instead
of class attributes and a module global that tests and benches used to flip.

    backend          "triton": fastpath/kernels (the default, what every token test runs); "torch": the plain-torch
                     stand-ins of engine/torch_ops.py (same contract; fast scheduler-only tests, cross-checks)
    fused            Triton backend: residual add + norm and act·mul as one kernel each (False: separate torch ops,
                     and none of the GEMV folds below). "Fused" means one thing in this package: several
                     operations in one kernel launch (docs/kernels.md, "Words")
    gemv             CUDA + Triton: one-row projections through the Triton GEMV (False: cuBLAS)
    gemv_rows        CUDA + Triton: 2..8-row projections (a bs1 speculative verify, a small batch) through the
                     few-row GEMV, one read of each weight for all rows, each row with the one-row GEMV's bits
                     (only for K a multiple of 16; other K: cuBLAS). Off by default: slower than cuBLAS from 2
                     rows (`hybridqual bench kernels --only proj`, docs/performance.md); False: cuBLAS
    gemv_on_cpu      take the one-row GEMV path (and its folds) and the few-row GEMV on CPU too, through the
                     interpreter (tests)
    fold_act         with the GEMV: the MLP's act·mul in the down GEMV's x load
    fold_conv        with the GEMV: a one-row decode step's conv step in in_proj's epilogue
    fold_gains       at load: norm gains read only by projections folded into their weight columns
    fold_norm        with the GEMV and folded gains: the one-row decode step normalises in the projections' loads
                     and adds the residual in their epilogues (no norm kernels but the final one)
    batch_invariant  fixed-tile GEMMs and request-only prefill pieces (fastpath/batch_invariant.py)
    spec_replay      speculative rollback by replaying the accepted positions' conv/SSM steps from saved inputs
                     (False, the default: per-position snapshots; fastpath/engine/verify.py, docs/engine.md)
    spec_device_drafts  ngram / draft proposals on the device inside the padded / graphed decode loop (no host
                     sync; fastpath/engine/spec_device.py). Off by default: at low acceptance every decode-loop
                     step becomes a verify step at the room's width (docs/engine.md, "Device proposals")
    state_dtype      the state bank's conv windows and SSM states (DESIGN §20): "float32" (the default), "float16"
                     or "bfloat16"; the state is rounded where it is written back, arithmetic stays in fp32. An
                     engine run so declares it and is judged with constants measured for it
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BACKENDS = ("triton", "torch")
STATE_DTYPES = ("float32", "float16", "bfloat16")


class OptionsError(TypeError, ValueError):
    """A FastOptions field has the wrong type or value; the message starts with `options.<field>`."""


@dataclass(frozen=True)
class FastOptions:
    """Frozen run options of FastModel / Engine (see the module docstring for each field)."""

    backend: str = "triton"
    fused: bool = True
    gemv: bool = True
    gemv_rows: bool = False
    gemv_on_cpu: bool = False
    fold_act: bool = True
    fold_conv: bool = True
    fold_gains: bool = True
    fold_norm: bool = True
    batch_invariant: bool = False
    spec_replay: bool = False
    spec_device_drafts: bool = False
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise OptionsError(f"options.backend: {self.backend!r} is not one of {BACKENDS}")
        if not isinstance(self.state_dtype, str) or self.state_dtype not in STATE_DTYPES:
            raise OptionsError(f"options.state_dtype: {self.state_dtype!r} is not one of {STATE_DTYPES}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name not in ("backend", "state_dtype") and not isinstance(v, bool):
                raise OptionsError(f"options.{f.name}: must be True or False, got {type(v).__name__} {v!r}")

    def replace(self, **changes) -> "FastOptions":
        """A copy with `changes` (unknown names are an OptionsError naming them)."""
        names = {f.name for f in dataclasses.fields(self)}
        for k in changes:
            if k not in names:
                raise OptionsError(f"options.{k}: no such option; expected one of {sorted(names)}")
        return dataclasses.replace(self, **changes)


def check_options(options: object) -> FastOptions:
    """None -> the defaults; a FastOptions as is; anything else is an OptionsError naming the argument."""
    if options is None:
        return FastOptions()
    if not isinstance(options, FastOptions):
        raise OptionsError(f"options: must be a fastpath.FastOptions, got {type(options).__name__} {options!r:.60}")
    return options
