"""Gated RMSNorm (mirrors oracle/gated_norm.py): rmsnorm over each group of D/n_groups channels of
y · silu(z), times weight; n_groups = 1 is the ungrouped form. fp32 statistics, output in y's dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, INTERPRET, KernelInputError, check, next_pow2, pdl_enter, pdl_meta, sigmoid

OP = "rms_norm_gated"
MAX_GROUP = 65536


@triton.jit
def rms_norm_gated_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, n_rows, n_groups, group_size, eps,
    stride_y_t, stride_z_t, stride_o_t,
    HAS_Z: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (cdiv(T·n_groups, BLOCK_R),): BLOCK_R (token, group) rows a program; the last dim of y, z, out is
    contiguous. PDL: programmatic dependent launch."""
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mi = i < n_rows
    t = i // n_groups
    col = (i % n_groups)[:, None] * group_size + tl.arange(0, BLOCK)[None, :]
    m = mi[:, None] & (tl.arange(0, BLOCK) < group_size)[None, :]
    g = tl.load(y_ptr + t[:, None] * stride_y_t + col, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + t[:, None] * stride_z_t + col, mask=m, other=0.0).to(tl.float32)
        g = g * (z * sigmoid(z))
    var = tl.sum(g * g, axis=1) / group_size
    normed = g * (1.0 / tl.sqrt(var + eps))[:, None]
    w = tl.load(w_ptr + col, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * stride_o_t + col, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_gated_rows(group_size: int) -> int:
    """(token, group) rows a program: 1 compiled; in the Triton interpreter (CPU), where a program costs its op
    count whatever its tile, up to 64K elements' worth."""
    return max(1, min(64, 65536 // next_pow2(group_size))) if INTERPRET else 1


def rms_norm_gated(y: Tensor, z: Tensor | None, weight: Tensor, n_groups: int, eps: float,
                   out: Tensor | None = None) -> Tensor:
    """y, z [..., D] -> per-group rmsnorm(y * silu(z)) * weight [D]; z None = plain grouped RMSNorm."""
    check(OP, "y", y, None, FLOAT_DTYPES)
    if y.dim() < 1:
        raise KernelInputError(f"{OP}: `y` must have at least one dim")
    D = y.shape[-1]
    dev = y.device
    check(OP, "z", z, tuple(y.shape), FLOAT_DTYPES, dev, optional=True)
    check(OP, "weight", weight, (D,), FLOAT_DTYPES, dev)
    if not isinstance(n_groups, int) or n_groups < 1 or D % n_groups != 0:
        raise KernelInputError(f"{OP}: D={D} is not divisible by n_groups={n_groups}")
    gs = D // n_groups
    if gs > MAX_GROUP:
        raise KernelInputError(f"{OP}: group size {gs} exceeds {MAX_GROUP}")
    if out is None:
        out = torch.empty_like(y)
    check(OP, "out", out, tuple(y.shape), FLOAT_DTYPES, dev)
    if not out.is_contiguous():
        raise KernelInputError(f"{OP}: `out` must be contiguous")
    y2 = y.reshape(-1, D)
    z2 = z.reshape(-1, D) if z is not None else y2
    if y2.stride(-1) != 1 or z2.stride(-1) != 1 or weight.stride(0) != 1:
        y2, z2, weight = y2.contiguous(), z2.contiguous(), weight.contiguous()
    o2 = out.view(-1, D)
    if y2.shape[0] == 0:
        return out
    block = next_pow2(gs)
    n_rows, br = y2.shape[0] * n_groups, rms_norm_gated_rows(gs)
    rms_norm_gated_kernel[(triton.cdiv(n_rows, br),)](
        y2, z2, weight, o2, n_rows, n_groups, gs, float(eps), y2.stride(0), z2.stride(0), o2.stride(0),
        HAS_Z=z is not None, BLOCK_R=br, BLOCK=block, **pdl_meta(out.device), num_warps=min(16, max(1, block // 256)))
    return out
