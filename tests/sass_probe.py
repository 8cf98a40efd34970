"""Run in a subprocess by test_kernel_static.py (Triton compiling, never interpreting): the static reports of the
few-row and one-row GEMVs and the decode path's state kernels at their launch rules, and of a probe whose K loop
must convert layouts through shared memory (a [BLOCK_M, BLOCK_N, BLOCK_K] product of a weight tile and an x tile:
the checker's positive control); the shared memory of the prefill attention's and the SSD chunk-state walk's
rules. JSON on stdout."""
from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridqual.bench.sass import SassError, Spec, compile_spec, prefill_attention_spec, report, specs  # noqa: E402


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
        rows += attention_shared_memory()
        rows += ssd_state_shared_memory()
        rows += matmul_shared_memory()
    except SassError as e:
        print(json.dumps({"skip": str(e)}))
        return 0
    print(json.dumps(rows))
    return 0


def attention_shared_memory() -> list[dict]:
    """The prefill attention's dynamic shared memory at its launch rule for bf16 and fp32 inputs (head dims 80 and
    128), and at 128 × 128 blocks with fp32 inputs (the control: what the rule must not pick, over the limit)."""
    out = []
    for dt, d, force in (("bf16", 80, {}), ("bf16", 128, {}), ("fp32", 80, {}), ("fp32", 128, {}),
                         ("fp32", 80, dict(BLOCK_M=128, BLOCK_N=128, num_warps=8))):
        name = f"prefill attention {dt} d{d}{' M128 N128 w8' if force else ''}"
        k = compile_spec(prefill_attention_spec(name, d, dt, **force))
        out.append({"kernel": name, "shared": k.metadata.shared})
    return out


def ssd_state_shared_memory() -> list[dict]:
    """The chunk-state walk's shared memory on sm_86 (99 KB a block: the smallest of the lowered archs) at its launch
    rule for bf16 and fp32 inputs (anchor-3b's SSD shape), and fp32 at the bf16 rule's 4 stages (the control)."""
    import torch

    from fastpath.kernels.ssd import ssd_launch_rule
    [base] = [s for s in specs({"ssd_state"}) if s.name == "ssd_chunk_state"]
    out = []
    for name, dtype, stages in (("ssd_chunk_state bf16", torch.bfloat16, None),
                                ("ssd_chunk_state fp32", torch.float32, None),
                                ("ssd_chunk_state fp32 4 stages", torch.float32, 4)):
        r = ssd_launch_rule(128, 1, 64, 128, 256, dtype)
        dt = "bf16" if dtype == torch.bfloat16 else "fp32"
        types = {**base.types, "x_ptr": f"*{dt}", "B_ptr": f"*{dt}", "prev_ptr": f"*{dt}"}
        spec = Spec(name, base.fn, dict(base.constexprs, BLOCK_K=r.state_block_k, BLOCK_P=r.state_block_p,
                                        BLOCK_N=r.state_block_n, DOT_PREC="ieee" if dt == "fp32" else "tf32"),
                    r.state_warps, stages or r.state_stages, types, base.div16, base.ones)
        out.append({"kernel": name, "shared": compile_spec(spec, 86).metadata.shared})
    return out


def matmul_shared_memory() -> list[dict]:
    """The batch-invariant matmul's shared memory at each branch of its launch rule for bf16 and fp32 inputs, and
    fp32 at the wide tiles' 4 stages (the control: what the rule must not pick, over sm_90's limit)."""
    from fastpath.kernels.matmul import BLOCK_M, matmul_kernel, matmul_launch_rule
    out = []
    for N, K, dt, stages in ((20000, 64, "bf16", None), (8192, 64, "bf16", None), (2560, 8192, "bf16", None),
                             (64, 64, "bf16", None), (20000, 64, "fp32", None), (8192, 64, "fp32", None),
                             (2560, 8192, "fp32", None), (64, 64, "fp32", None), (8192, 64, "fp32", 4)):
        r = matmul_launch_rule(N, K, 2 if dt == "bf16" else 4)
        types = {p: f"*{dt}" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
        name = f"matmul {dt} N{N} K{K}{f' {stages} stages' if stages else ''}"
        spec = Spec(name, matmul_kernel, dict(HAS_BIAS=False, USE_DOT=True, PARTIAL=r["SPLIT"] > 1, BM=BLOCK_M,
                                              BN=r["BN"], BK=r["BK"]), r["num_warps"], stages or r["num_stages"],
                    types, ("K", "K_SPLIT", "stride_xm", "stride_wn", "stride_ym", "stride_ys"))
        out.append({"kernel": name, "shared": compile_spec(spec).metadata.shared})
    return out


if __name__ == "__main__":
    sys.exit(main())
