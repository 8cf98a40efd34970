"""Prefill attention launch-rule variants on one GPU, beside torch's SDPA (its flash kernel) where it can run the
same shape, in one run.

    python -m hybridqual.bench.attention [--only NAME,NAME] [--head-dim D] [--out a.json]

Shapes: anchor-3b's attention (32 query heads, 8 KV heads, head dim 80 or --head-dim, bf16): one 8,192-token piece from position
0; the first and the last 16,384-token piece of a 131,072-token prompt (the long prefill's pieces, the last over a
131k-key cache); a prefix-cache hit's 100-token suffix over 32,768 cached keys (split over the keys, then merged).
Per shape and variant: median ms (triton.testing.do_bench), causal TFLOP/s (4·Hq·d per visible query-key pair),
and the output against the launch rule's: bitwise or the largest |Δ|. SDPA is the peer where its causal mask is
this one's (pieces from position 0; `enable_gqa`).
"""
from __future__ import annotations

import argparse
import json

import torch

import fastpath.kernels.attention as attn
from hybridqual.bench import arguments

HQ, HKV, HD = 32, 8, 80
# name -> updates of attention_launch_rule(80); "rule": the rule as it is
VARIANTS: dict[str, dict] = {
    "rule": {},
    "m64_n64_w4": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "COMBINE_H": None},   # the rule before 381bea7
    "combine_all": {"COMBINE_H": None},
    "masked": {"UNMASKED_FULL": False},
    "one_chunk": {"BLOCK_DQ": 128, "BLOCK_D2": 0},
    "one_chunk_masked": {"BLOCK_DQ": 128, "BLOCK_D2": 0, "UNMASKED_FULL": False},
    "m128_w8_one_chunk": {"BLOCK_M": 128, "num_warps": 8, "BLOCK_DQ": 128, "BLOCK_D2": 0},
    "nofuse": {"fp_fusion": False},
    "masked_nofuse": {"UNMASKED_FULL": False, "fp_fusion": False},
    "m128_w8": {"BLOCK_M": 128, "num_warps": 8},
    "m128_w8_s2": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
    "m128_w8_s4": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 4},
    "m128_n32_w4": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4},
    "m128_w4": {"BLOCK_M": 128, "num_warps": 4},
    "m64_w4_s2": {"num_stages": 2},
    "m64_w4_s4": {"num_stages": 4},
    "m64_n128_w4": {"BLOCK_N": 128},
    "m64_n128_w8": {"BLOCK_N": 128, "num_warps": 8},
    "m128_n128_w8": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8},
    "combine_h4": {"COMBINE_H": 4},
    "combine_h1": {"COMBINE_H": 1},
    "natural_exp": {"EXP2": False},                                                   # the rule before 8c6749f
}
SHAPES = (("L8192", 0, 8192, 8192), ("131k first piece", 0, 16384, 16384),
          ("131k last piece", 131072 - 16384, 16384, 131072),
          ("hit 100 over 32k", 32768, 100, 32868))     # a prefix-cache hit's suffix: split over the keys, merged


def _flops(start: int, n: int, hd: int = HD) -> float:
    """4·Hq·d per visible (query, key) pair of a causal piece of n queries from `start`."""
    return 4.0 * HQ * hd * (n * start + n * (n + 1) / 2)


def run(only: list[str] | None = None, hd: int = HD) -> list[dict]:
    """Every shape × variant (or `only` those variants) at head dim hd, the rule first, then SDPA."""
    from triton.testing import do_bench
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    rule0, rows = attn.attention_launch_rule, []
    names = [n for n in VARIANTS if only is None or n in only or n == "rule"]
    try:
        for label, start, n, ctx in SHAPES:
            q = torch.randn(n, HQ, hd, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(n, HKV, hd, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn_like(k)
            kc = torch.randn(1, ctx, HKV, hd, device=dev, dtype=torch.bfloat16, generator=g)
            vc = torch.randn_like(kc)
            host = ([0, n], [0], [start])
            args = tuple(torch.tensor(x, device=dev) for x in host)
            ref = None
            for name in names:
                attn.attention_launch_rule = lambda hd, eb=2, u=VARIANTS[name]: {**rule0(hd, eb), **u}
                out = torch.empty_like(q)
                call = lambda: attn.attention_prefill_varlen(q, k, v, kc, vc, *args, hd ** -0.5, out=out,  # noqa
                                                             host=host)
                try:
                    ms = do_bench(call, warmup=5, rep=40)
                except Exception as e:  # noqa: BLE001 - a shape the compiler refuses is a row, not a stop
                    rows.append({"shape": label, "variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                ref = out.clone() if ref is None else ref
                diff = (out.float() - ref.float()).abs().max().item()
                rows.append({"shape": label, "variant": name, "ms": ms, "tflops": _flops(start, n, hd) / ms / 1e9,
                             "bitwise": bool(torch.equal(out, ref)), "max_abs_diff": diff})
            if start == 0:
                qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                f = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,  # noqa
                                                                             enable_gqa=True)
                ms = do_bench(f, warmup=5, rep=40)
                rows.append({"shape": label, "variant": "torch SDPA (peer)", "ms": ms,
                             "tflops": _flops(start, n, hd) / ms / 1e9})
            del q, k, v, kc, vc
            torch.cuda.empty_cache()
    finally:
        attn.attention_launch_rule = rule0
    return rows


def lines(rows: list[dict]) -> list[str]:
    """One line per row: shape, variant, ms, TFLOP/s, bits against the rule."""
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['shape']:18s} {r['variant']:18s} FAILED {r['error']}")
            continue
        bits = "" if "bitwise" not in r else ("bitwise" if r["bitwise"] else f"max|Δ| {r['max_abs_diff']:.2e}")
        out.append(f"{r['shape']:18s} {r['variant']:18s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s  {bits}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma list of variants (the rule always runs)")
    ap.add_argument("--head-dim", type=int, default=HD, help=f"the heads' dim (default {HD}, anchor-3b's)")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if not 16 <= a.head_dim <= 256 or a.head_dim % 8:
        return arguments.refuse(f"bench attention: --head-dim {a.head_dim}: must be a multiple of 8 in [16, 256]")
    only = a.only.split(",") if a.only else None
    problem = arguments.first(arguments.known("--only", only or [], VARIANTS), arguments.writable_file("--out", a.out))
    if problem:
        return arguments.refuse(f"bench attention: {problem}")
    if not torch.cuda.is_available():
        print("bench attention: needs CUDA")
        return 2
    rows = run(only, a.head_dim)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | Hq {HQ} Hkv {HKV} d {a.head_dim}")
    print("\n".join(lines(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
