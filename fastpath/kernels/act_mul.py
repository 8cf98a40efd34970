"""Gated-MLP activation in one pass: act(gate) * up over the fused gate_up GEMM output (mirrors
FastModel.mlp's `self._act(gate) * up`, with the same rounding points: act rounded to the dtype, then the product).

    gate_up [T, 2F] = [gate | up]  ->  out [T, F] = act(gate) * up,   act = silu | relu2 (squared ReLU)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, KernelInputError, check, pdl_enter, pdl_meta, sigmoid

OP = "act_mul"
ACTS = ("silu", "relu2")
BLOCK = 1024


@triton.jit
def act_mul_kernel(gu_ptr, out_ptr, F, stride_gu, stride_o, RELU2: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
    """Grid (T, cdiv(F, BLOCK)); the last dims are contiguous. PDL: programmatic dependent launch."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < F
    g = tl.load(gu_ptr + t * stride_gu + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + F + col, mask=m, other=0.0).to(tl.float32)
    if RELU2:
        a = tl.maximum(g, 0.0)
        a = a * a
    else:
        a = g * sigmoid(g)
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + col, (a * u).to(out_ptr.dtype.element_ty), mask=m)


def act_mul(gate_up: Tensor, act: str = "silu", out: Tensor | None = None) -> Tensor:
    """gate_up [T, 2F] -> act(gate_up[:, :F]) * gate_up[:, F:] as [T, F] in gate_up's dtype."""
    check(OP, "gate_up", gate_up, (None, None), FLOAT_DTYPES)
    if act not in ACTS:
        raise KernelInputError(f"{OP}: `act` is {act!r}, expected one of {ACTS}")
    T, F2 = gate_up.shape
    if F2 % 2:
        raise KernelInputError(f"{OP}: the last dim of `gate_up` ({F2}) must be even (gate | up)")
    if gate_up.stride(-1) != 1:
        raise KernelInputError(f"{OP}: the last dim of `gate_up` must be contiguous")
    F = F2 // 2
    if out is None:
        out = torch.empty(T, F, dtype=gate_up.dtype, device=gate_up.device)
    check(OP, "out", out, (T, F), (gate_up.dtype,), gate_up.device)
    if out.stride(-1) != 1:
        raise KernelInputError(f"{OP}: the last dim of `out` must be contiguous")
    if T == 0 or F == 0:
        return out
    act_mul_kernel[(T, triton.cdiv(F, BLOCK))](gate_up, out, F, gate_up.stride(0), out.stride(0),
                                                 RELU2=act == "relu2", BLOCK=BLOCK, **pdl_meta(out.device),
                                                 num_warps=4)
    return out
