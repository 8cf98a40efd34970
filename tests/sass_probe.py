"""Run in a subprocess by test_kernel_static.py (Triton compiling, never interpreting): the static reports of the
few-row and one-row GEMVs and the decode path's state kernels at their launch rules, and of a probe whose K loop
must convert layouts through shared memory (a [BLOCK_M, BLOCK_N, BLOCK_K] product of a weight tile and an x tile:
the checker's positive control). JSON on stdout."""
from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridqual.bench.sass import SassError, Spec, report, specs  # noqa: E402


@triton.jit
def product_3d_kernel(x_ptr, w_ptr, y_ptr, K, stride_w_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + n[:, None] * stride_w_n + (k + k0)[None, :]).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * K + (k + k0)[None, :]).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    tl.store(y_ptr + m[:, None] * BLOCK_N + n[None, :], tl.sum(acc, axis=2))


def main() -> int:
    probe = Spec("product_3d", product_3d_kernel, dict(BLOCK_M=4, BLOCK_N=4, BLOCK_K=512), 8, 3,
                 {"y_ptr": "*fp32"}, ("K", "stride_w_n"))
    try:
        chosen = [s for s in specs({"gemv_rows", "gemv", "decode"}) if "attention" not in s.name]  # not asserted
        rows = [report(s) for s in chosen + [probe]]
    except SassError as e:
        print(json.dumps({"skip": str(e)}))
        return 0
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
