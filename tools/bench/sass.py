"""Static inspection of the fast path's kernels, no GPU needed: each kernel compiled for sm_90 by Triton (its own
ptxas) at its launch rule, reporting registers, spill stack, and what its loops execute per iteration (barriers,
shared-memory and local-memory ops). A spill or a shared-memory round trip in a streaming loop is a cost the GPU
figures show later; this finds it on a CPU machine.

    hybridqual bench sass [--kernels gemv,gemv_rows,ssd_scan,ssd_state,decode,prefill_attention] [--arch 90]
        [--out sass.json]

The figures depend on the Triton version that compiles (the GPU image's may differ from this machine's: a venv
with that version's wheel first on PYTHONPATH compiles with it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace

import triton

from hybridqual.bench import arguments

ARCHS = (80, 86, 89, 90)      # what Triton's NVIDIA backend lowers these kernels for (older GPUs lack their ops)
OPS = ("BAR", "STS", "LDS", "LDSM", "STSM", "LDL", "STL", "LDG", "SHFL", "HGMMA", "HMMA")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")


class SassError(RuntimeError):
    """The kernel could not be compiled or disassembled here (no NVIDIA backend, no ptxas/cuobjdump)."""


@dataclass(frozen=True)
class Spec:
    """One kernel at one launch rule: `types` names pointer dtypes (default *bf16) and non-i32 scalars,
    `div16` the integer arguments the launcher sees divisible by 16 (pointers always are), `ones` those it passes
    as 1 (a unit stride: Triton compiles such an argument as the constant 1)."""
    name: str
    fn: object
    constexprs: dict
    num_warps: int
    num_stages: int
    types: dict = field(default_factory=dict)
    div16: tuple = ()
    ones: tuple = ()


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise SassError(f"{name} not found in this Triton ({triton.__version__}): no NVIDIA backend")
    return path


def compile_sass(spec: Spec, arch: int = 90) -> tuple[str, str]:
    """(SASS text, cuobjdump -res-usage text) of `spec` compiled for sm_<arch>."""
    k = compile_spec(spec, arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        dump = _tool("cuobjdump")
        sass = subprocess.run([dump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([dump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, res


def compile_spec(spec: Spec, arch: int = 90):
    """Triton's compiled kernel of `spec` for sm_<arch> (its `asm` holds ttgir, ptx and cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = spec.fn
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise SassError(f"{spec.name}: {type(fn).__name__} is not compilable (imported under TRITON_INTERPRET=1; "
                        "run with TRITON_INTERPRET=0)")
    params = fn.params
    sig, attrs = {}, {}
    for i, p in enumerate(params):
        if p.is_constexpr or p.name in spec.ones:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = spec.types.get(p.name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = spec.types.get(p.name, "i32")
            if p.name in spec.div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    ce = {p.name: spec.constexprs.get(p.name, p.default) for p in params if p.is_constexpr}
    ce.update({name: 1 for name in spec.ones})
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    except Exception as e:                     # a Triton without the NVIDIA backend, or a kernel that fails to lower
        raise SassError(f"{spec.name}: compile for sm_{arch} failed: {type(e).__name__}: {e}"[:400]) from e
    return k


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction."""
    return [(int(m.group(1), 16), m.group(3), m.group(5)) for m in _INSTR.finditer(sass)]


def loops(sass: str) -> list[dict]:
    """Each loop (a backward branch: body = [target, branch]) with the count of each OPS opcode in its body,
    innermost first (shortest body)."""
    ins = _instructions(sass)
    out = []
    for addr, op, args in ins:
        if op != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", args)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo = int(m.group(1), 16)
        body = [o for a, o, _ in ins if lo <= a <= addr]
        out.append({"start": lo, "end": addr, "instructions": len(body), **{o: body.count(o) for o in OPS}})
    return sorted(out, key=lambda r: r["instructions"])


def compute_loop(lps: list[dict]) -> dict | None:
    """The innermost loop that issues a matrix instruction (else the innermost loop): a TMA kernel's shortest loops
    are its barrier waits, not its work."""
    mma = [lp for lp in lps if lp["HGMMA"] or lp["HMMA"]]
    return (mma or lps or [None])[0]


def report(spec: Spec, arch: int = 90) -> dict:
    """Registers, spill stack (bytes a thread), opcode totals and per-loop counts of `spec` on sm_<arch>."""
    sass, res = compile_sass(spec, arch)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    ops = [o for _, o, _ in _instructions(sass)]
    return {"kernel": spec.name, "triton": triton.__version__, "arch": arch, "num_warps": spec.num_warps,
            "registers": int(usage.get("REG", 0)), "spill_stack": int(usage.get("STACK", 0)),
            "totals": {o: ops.count(o) for o in OPS}, "loops": loops(sass)}


def specs(names: set[str] | None = None) -> list[Spec]:
    """The inspected kernels at anchor-3b's shapes (bf16 inputs): the decode GEMV and the few-row GEMV at both
    launch rules (K < 4096: in_proj, K >= 4096: down_proj), the SSD chunk scan and chunk state at their rules."""
    from fastpath.kernels.gemv import gemv_kernel, gemv_launch_rule
    from fastpath.kernels.gemv_rows import ROWS_PER_PROGRAM, gemv_rows_kernel, gemv_rows_launch_rule
    from fastpath.kernels.ssd import ssd_launch_rule
    from fastpath.kernels.ssd_chunk_scan import ssd_chunk_scan_rec_kernel
    from fastpath.kernels.ssd_chunk_state import ssd_chunk_state_kernel
    out: list[Spec] = []
    for N, K in ((10576, 2560), (2560, 6144)):
        r = gemv_launch_rule(N, K)
        for xb, rms in ((False, False), (True, False), (False, True), (True, True)):
            out.append(Spec(f"gemv K{K}{' rms' if rms else ''}{' XB' if xb else ''}", gemv_kernel,
                            dict(BLOCK_N=r["BLOCK_N"], BLOCK_K=r["BLOCK_K"], EVEN_K=True, HAS_BIAS=False,
                                 PARTIAL=False, ACT=0, CONV=False, KC=1, KW=1, HAS_CBIAS=False, RMS=rms, RES=rms,
                                 HAS_MULT=False, PDL=0, XB=xb), r["num_warps"], r["num_stages"],
                            {"eps": "fp32", "mult": "fp32", "rs_ptr": "*fp32"}, ("K", "K_SPLIT", "stride_w_n")))
        for rows in range(1, ROWS_PER_PROGRAM + 1):
            rr = gemv_rows_launch_rule(N, K, rows)
            out.append(Spec(f"gemv_rows K{K} ROWS{rows}", gemv_rows_kernel,
                            dict(HAS_BIAS=False, ROWS=rr["ROWS"], BLOCK_N=rr["BLOCK_N"], BLOCK_K=rr["BLOCK_K"],
                                 EVEN_K=True, PDL=0), rr["num_warps"], rr["num_stages"],
                            div16=("K", "stride_x_m", "stride_w_n", "stride_y_m")))
    rule = ssd_launch_rule(128, 1, 64, 128, 256, None)
    f32 = {"dt_ptr": "*fp32", "dacs_ptr": "*fp32", "D_ptr": "*fp32", "bank_ptr": "*fp32", "prev_ptr": "*bf16",
           "chunk_start_ptr": "*i32", "chunk_len_ptr": "*i32", "seq_chunk_ptr": "*i64", "slot_ptr": "*i32",
           "has_init_ptr": "*i8", "ckpt_ptr": "*i32"}
    strides = lambda fn: tuple(n for n in fn.arg_names if n.startswith("stride") and not n.endswith(("_p", "_n")))
    out.append(Spec("ssd_chunk_scan_rec", ssd_chunk_scan_rec_kernel,
                    dict(HAS_D=True, BLOCK_S=rule.scan_block_s, BLOCK_P=rule.scan_block_p, BLOCK_N=rule.scan_block_n,
                         DOT_PREC="tf32", MASK_PN=False), rule.scan_warps, rule.scan_stages, f32,
                    strides(ssd_chunk_scan_rec_kernel) + ("H", "P", "N")))
    out.append(Spec("ssd_chunk_state", ssd_chunk_state_kernel,
                    dict(BLOCK_K=rule.state_block_k, BLOCK_P=rule.state_block_p, BLOCK_N=rule.state_block_n,
                         DOT_PREC="tf32"), rule.state_warps, rule.state_stages, f32,
                    strides(ssd_chunk_state_kernel) + ("P", "N")))
    unit = ("stride_x_p", "stride_b_n", "stride_c_n", "stride_y_p")     # x, B, C, y rows are contiguous at launch
    out = [replace(sp, ones=tuple(n for n in sp.fn.arg_names if n in unit)) if sp.name.startswith("ssd") else sp
           for sp in out]
    out += _decode_specs() + _prefill_attention_specs()
    groups = {"gemv": "gemv K", "gemv_rows": "gemv_rows", "ssd_scan": "ssd_chunk_scan", "ssd_state": "ssd_chunk_state",
              "decode": "decode ", "prefill_attention": "prefill attention"}
    if names is None:
        return out
    unknown = names - set(groups)
    if unknown:
        raise ValueError(f"--kernels: unknown {sorted(unknown)}; choose from {sorted(groups)}")
    return [s for s in out if any(s.name.startswith(groups[n]) for n in names)]


def prefill_attention_spec(name: str, head_dim: int = 80, dtype: str = "bf16", **over) -> Spec:
    """The prefill attention kernel at its launch rule for `head_dim` and `dtype` inputs ("bf16" or "fp32") at
    anchor-3b's heads, compiled as a launch specializes it (its dot precision, strides divisible by 16), `over`
    replacing constexprs (and num_warps)."""
    import torch

    from fastpath.kernels._common import dot_precision
    from fastpath.kernels.attention import attention_kernel, attention_launch_rule
    r = attention_launch_rule(head_dim, 2 if dtype == "bf16" else 4)
    consts = dict(BLOCK_M=r["BLOCK_M"], BLOCK_N=r["BLOCK_N"], BLOCK_D=r["BLOCK_DQ"], BLOCK_D2=r["BLOCK_D2"],
                  DOT_PREC=dot_precision(torch.bfloat16 if dtype == "bf16" else torch.float32),
                  UNMASKED_FULL=r["UNMASKED_FULL"], EXP2=r["EXP2"], PDL=0)
    warps = over.pop("num_warps", r["num_warps"])
    types = {"meta_ptr": "*i32", "cu_ptr": "*i64", "slot_ptr": "*i64", "start_ptr": "*i64", "acc_ptr": "*fp32",
             "ml_ptr": "*fp32", "scale": "fp32", **{p: "*" + dtype for p in ("q_ptr", "kc_ptr", "vc_ptr", "o_ptr")}}
    return Spec(name, attention_kernel, {**consts, **over}, warps, 3, types,
                ("D", "Hq", "stride_q_t", "stride_q_h", "stride_kc_s", "stride_kc_p", "stride_kc_h", "stride_vc_s",
                 "stride_vc_p", "stride_vc_h", "stride_o_t", "stride_o_h"))


def _prefill_attention_specs() -> list[Spec]:
    """The prefill attention at anchor-3b's heads (Hq32 Hkv8 d80): its rule (128 × 128 blocks at 8 warps, unmasked
    full key blocks, the head dim in chunks 64 + 16, base-2 exponentials), the same with natural exponentials
    (EXP2 off, the rule before 8c6749f), 64 × 64 blocks at 4 warps, the kernel before the chunks (64 × 64,
    one 128-wide chunk, every block masked), and the rule at head dim 128 (Bamba's, Nemotron-H's)."""
    n = "prefill attention "
    return [prefill_attention_spec(n + "rule"),
            prefill_attention_spec(n + "rule, natural exp", EXP2=False),
            prefill_attention_spec(n + "M64 N64 w4", BLOCK_M=64, BLOCK_N=64, num_warps=4),
            prefill_attention_spec(n + "before (M64 N64 w4, d 128, masked)", BLOCK_M=64, BLOCK_N=64, BLOCK_D=128,
                                   BLOCK_D2=0, UNMASKED_FULL=False, num_warps=4),
            prefill_attention_spec(n + "rule at head dim 128", 128)]


def _decode_specs() -> list[Spec]:
    """The decode and verify steps' state kernels at anchor-3b's shapes (H80 P64 N128, Hq32 Hkv8 d80, a 4096-key
    cache, conv channels 5376): the Mamba state update (gated, as the folded decode step runs it), its W-position
    form with snapshots, the W-position conv step, the one-launch decode attention."""
    from fastpath.kernels.attention_decode import attention_decode_kernel, attention_decode_rule
    from fastpath.kernels.conv1d import conv1d_launch_rule
    from fastpath.kernels.conv1d_steps import conv1d_steps_kernel
    from fastpath.kernels.ssm_step import ssm_step_kernel, ssm_step_launch_rule
    from fastpath.kernels.ssm_steps import ssm_steps_kernel
    r = ssm_step_launch_rule(80, 64, 128)
    ssm_types = {"bank_ptr": "*fp32", "A_ptr": "*fp32", "D_ptr": "*fp32", "dt_bias_ptr": "*fp32", "slot_ptr": "*i32",
                 "snap_ptr": "*fp32", "dt_lo": "fp32", "dt_hi": "fp32"}
    tiles = dict(HAS_D=True, HAS_BIAS=True, BLOCK_H=r.get("BLOCK_H", 1), BLOCK_P=r["BLOCK_P"], BLOCK_N=r["BLOCK_N"],
                 PDL=0)
    a, cr = attention_decode_rule(4096, 80), conv1d_launch_rule(5376)
    n_split = -(-4096 // a["CHUNK"])
    return [
        Spec("decode ssm_step (z gate)", ssm_step_kernel, dict(tiles, HAS_Z=True, SNAP=False), r["num_warps"], 3,
             ssm_types),
        Spec("decode ssm_steps (snapshots)", ssm_steps_kernel, dict(tiles, SNAP=True), r["num_warps"], 3,
             {**ssm_types, "slot_ptr": "*i32"}),
        Spec("decode conv1d_steps", conv1d_steps_kernel, dict(K=4, KW=4, HAS_BIAS=True, SILU=True,
             BLOCK_D=cr["BLOCK_D"], SNAP=True, PDL=0), cr["num_warps"], 3,
             {"bias_ptr": "*fp32", "w_ptr": "*fp32", "bank_ptr": "*fp32", "slot_ptr": "*i32", "snap_ptr": "*fp32"}),
        Spec("decode attention_decode", attention_decode_kernel,
             dict(CHUNK=a["CHUNK"], BLOCK_N=a["BLOCK_N"], BLOCK_Q=16, QC=4, BLOCK_D=a["BLOCK_D"],
                  BLOCK_S=max(1, min(triton.next_power_of_2(n_split), 16, 8192 // (4 * a["BLOCK_D"]))), ROPE=True,
                  DOT_PREC="tf32", PDL=0), a["num_warps"], 3,
             {"slot_ptr": "*i32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32",
              "scale": "fp32"}),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridqual bench sass", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=None,
                    help="comma list: gemv, gemv_rows, ssd_scan, ssd_state, decode, prefill_attention "
                         "(default all)")
    ap.add_argument("--arch", type=int, default=90, choices=ARCHS,
                    help="compute capability: 90 (Hopper), 89 (Ada), 86, 80 (Ampere)")
    ap.add_argument("--out", default=None, help="write the reports as JSON here")
    a = ap.parse_args(argv)
    problem = arguments.writable_file("--out", a.out)     # --kernels: checked by specs(), before any compile
    if problem:
        return arguments.refuse(problem)
    if os.environ.get("TRITON_INTERPRET") != "0":
        # kernels imported under the interpreter cannot be compiled: run again in a process that compiles
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        args = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "hybridqual.bench.sass", *args], env=env).returncode
    try:
        chosen = specs(set(a.kernels.split(",")) if a.kernels else None)
    except ValueError as e:
        ap.error(str(e))
    rows = []
    print(f"triton {triton.__version__}, sm_{a.arch}")
    print(f"{'kernel':28s} {'warps':>5s} {'regs':>5s} {'spill B':>7s}  compute loop: instr BAR STS LDS LDL STL"
          "  | kernel: HGMMA HMMA")
    for s in chosen:
        try:
            r = report(s, a.arch)
        except SassError as e:
            print(f"{s.name:28s} {e}")
            return 2
        rows.append(r)
        lp = compute_loop(r["loops"])
        loop = (f"{lp['instructions']:5d} {lp['BAR']:3d} {lp['STS'] + lp['STSM']:3d} {lp['LDS'] + lp['LDSM']:3d} "
                f"{lp['LDL']:3d} {lp['STL']:3d}") if lp else "no loop"
        mma = f"{r['totals']['HGMMA']:5d} {r['totals']['HMMA']:4d}"     # warp-group (Hopper) vs warp-level MMAs
        print(f"{s.name:28s} {s.num_warps:5d} {r['registers']:5d} {r['spill_stack']:7d}  {loop:27s} | {mma:>13s}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
