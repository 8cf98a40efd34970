"""Where a bs1 decode step of anchor-3b goes, kernel group by kernel group, against the bytes each group must move.

    python -m hybridqual.bench.account [--out account.json] [--summary account.summary] [--ctx 1024] [--verify-k 2]
                                       [--flip gemv_rows ...] [--layers 4]

One async + CUDA-graph bs1 decode step under torch.profiler (tools/bench/engine.kernel_table, every kernel): each
kernel is put in a group (projections, state update, conv step, attention, norms, the rest); each group's bytes
needed per step come from the config (every weight matrix read once, the SSM and conv states read and written once,
the KV cache read once), its floor is those bytes over the copy bandwidth measured in the same run. A kernel's time is
its exclusive time on the device timeline (a kernel launched early by programmatic dependent launch waits inside its
predecessor's span; that overlap is charged once). The account: group time vs floor, the device's busy time vs the
step's wall time (idle between graph nodes), and the step vs the roofline. Then the same for a speculative step
whose k drafts are all wrong (the verify of k+1 positions + rollback: the cost speculation pays at 0% acceptance),
and per group what it adds to the decode step. --flip OPTION: both steps again with that FastOptions switch
flipped, per group against the default (the A/B of a change, in one run). --layers N: the model cut to its first N
layers (same embeddings, final norm and head): the shape of bench spec's N-layer draft, so its decode step is one
draft forward.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from fastpath.engine.configs import named_config
from fastpath.options import FastOptions
from hybridqual.bench import arguments
from oracle.checkpoint import expected_shapes
from oracle.config import HybridConfig

GROUPS = (  # (group, kernel-name substrings), first match wins
    ("projections (GEMV / matmul)", ("gemv", "matmul", "split_sum", "gemm", "cutlass", "cublas", "nvjet")),
    ("SSM state update", ("ssm_step",)),
    ("conv step", ("conv1d",)),
    ("attention decode + KV write", ("attention", "kv_cache")),
    ("norms", ("norm",)),
    ("sampling", ("sample", "argmax", "max")),
)
OTHER = "the rest (act, rope, copies, elementwise)"


def group_of(kernel: str) -> str:
    """The account group of a profiled kernel name."""
    low = kernel.lower()
    for name, keys in GROUPS:
        if any(k in low for k in keys):
            return name
    return OTHER


def bytes_needed(c: HybridConfig, ctx: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one bs1 decode step must move, by group: every weight matrix once (the embedding: one row), the SSM
    state (fp32) and conv window read and written once, the KV cache of `ctx` positions read once and one written."""
    size = {n: math.prod(s) * dtype_bytes for n, s in expected_shapes(c).items()}

    def params(*keys: str) -> int:
        return sum(b for n, b in size.items() if any(k in n for k in keys))
    n_mamba, n_attn = len(c.mamba_layer_ids), len(c.attention_layer_ids)
    conv_ch = c.d_inner + 2 * c.mamba_n_groups * c.mamba_d_state
    kv_row = 2 * c.n_kv_heads * c.attn_head_dim * dtype_bytes
    return {
        "projections (GEMV / matmul)": params("proj.weight", "lm_head"),
        "SSM state update": n_mamba * 2 * c.mamba_n_heads * c.mamba_head_dim * c.mamba_d_state * 4
                            + params("dt_bias", "A_log", ".D"),
        "conv step": n_mamba * 2 * conv_ch * (c.mamba_d_conv - 1) * dtype_bytes + params("conv1d"),
        "attention decode + KV write": n_attn * (ctx + 1) * kv_row,
        "norms": params("norm"),
        "sampling": c.vocab_size * dtype_bytes,
        OTHER: c.hidden_size * dtype_bytes,
    }


PROJECTIONS = GROUPS[0][0]


def account(table: dict, need: dict[str, int], copy_bps: float, param_bytes: int) -> dict:
    """Group times (µs per step) from the kernel table beside each group's floor (bytes needed / copy bandwidth).

    A group's time is its kernels' exclusive time (`exclusive_us`: overlapped starts, as programmatic dependent
    launch makes them, charged once), so the groups add up to the device's busy time, never above the step. A
    group with bytes to move but no kernel of its own (the conv step folded into the in_proj GEMV's epilogue) has
    its bytes counted in the projections', whose kernels move them."""
    excl = table.get("exclusive_us")
    per: dict[str, dict] = {g: {"us": 0.0, "launches": 0.0, "kernels": []} for g in need}
    for name, count, us in table["top"]:
        g = per[group_of(name)]
        t = excl[name] if excl is not None else us
        g["us"] += t
        g["launches"] += count
        g["kernels"].append([name[:60], round(count, 2), round(t, 2)])
    need = dict(need)
    folded = [g for g, d in per.items() if not d["launches"] and need[g] and g != PROJECTIONS]
    for g in folded:
        need[PROJECTIONS] += need.pop(g)
        per.pop(g)
    rows = []
    for g, d in per.items():
        floor = 1e6 * need[g] / copy_bps
        rows.append({"group": g, "folded_in": folded if g == PROJECTIONS else [],
                     "us": round(d["us"], 1), "launches": round(d["launches"], 1),
                     "bytes_needed": need[g], "floor_us": round(floor, 1), "gap_us": round(d["us"] - floor, 1),
                     "TBps": round(need[g] / (d["us"] * 1e-6) / 1e12, 2) if d["us"] else None,
                     "kernels": sorted(d["kernels"], key=lambda k: -k[2])[:6]})
    wall = 1e3 * table["wall_ms_per_step"]
    ksum = sum(r["us"] for r in rows)
    floor = 1e6 * sum(need.values()) / copy_bps
    return {"rows": rows, "wall_us": round(wall, 1), "kernel_sum_us": round(ksum, 1),
            "between_kernels_us": round(wall - ksum, 1), "floor_us": round(floor, 1),
            "roofline_us": round(1e6 * param_bytes / copy_bps, 1), "copy_TBps": round(copy_bps / 1e12, 3),
            "graphs": table["graphs"]}


def missing_drafts(k: int, vocab: int, n: int, rid: str = "p"):
    """A scripted proposer for request `rid` whose k drafts after every output count are all the same high token
    id: wrong unless the model happens to emit it, so (almost) every step verifies k+1 positions and rolls back."""
    from oracle.speculative import ProposerConfig, SpecConfig
    per = tuple((i, (vocab - 1,) * k) for i in range(1, n + 1))
    return SpecConfig(k, ProposerConfig("scripted", proposals=((rid, per),)))


def versus(base: dict, other: dict) -> list[str]:
    """Per group: the other step's µs minus the base step's (where a speculative step's extra time goes)."""
    b = {r["group"]: r["us"] for r in base["rows"]}
    out = [f"{'extra over the decode step':<56}{'µs':>9}"]
    for r in sorted(other["rows"], key=lambda r: -(r["us"] - b.get(r["group"], 0.0))):
        out.append(f"{r['group']:<56}{r['us'] - b.get(r['group'], 0.0):>9.1f}")
    out.append(f"{'idle between kernels':<56}{other['between_kernels_us'] - base['between_kernels_us']:>9.1f}")
    out.append(f"{'step':<56}{other['wall_us'] - base['wall_us']:>9.1f}")
    return out


def lines_of(acc: dict) -> list[str]:
    """The printable table: one line per group, then the step's totals."""
    out = [f"{'group':<56}{'µs/step':>9}{'launches':>9}{'floor µs':>10}{'gap µs':>9}{'TB/s':>7}"]
    for r in sorted(acc["rows"], key=lambda r: -r["us"]):
        name = r["group"] + (f" (+ {', '.join(r['folded_in'])}, folded in)" if r.get("folded_in") else "")
        out.append(f"{name:<56}{r['us']:>9.1f}{r['launches']:>9.1f}{r['floor_us']:>10.1f}{r['gap_us']:>9.1f}"
                   f"{r['TBps'] if r['TBps'] is not None else '-':>7}")
    out.append(f"device busy {acc['kernel_sum_us']} µs + idle between kernels {acc['between_kernels_us']} µs = step "
               f"{acc['wall_us']} µs ({1e6 / acc['wall_us']:.1f} tok/s); bytes-needed floor {acc['floor_us']} µs "
               f"({1e6 / acc['floor_us']:.1f} tok/s); parameter-bytes roofline {acc['roofline_us']} µs; copy "
               f"{acc['copy_TBps']} TB/s; graphs {acc['graphs']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--summary")
    ap.add_argument("--ctx", type=int, default=64, help="context positions of the profiled request (default 64)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--verify-k", type=int, default=2,
                    help="also a speculative step with k drafts, all wrong (0: decode only; default 2)")
    ap.add_argument("--flip", nargs="*", default=[], metavar="OPTION",
                    help="also each step with this FastOptions switch flipped (e.g. gemv_rows): the A/B of a change "
                         "in one run")
    ap.add_argument("--layers", type=int, default=0,
                    help="cut anchor-3b to its first N layers: bench spec's N-layer draft (default 0: all layers)")
    args = ap.parse_args(argv)
    bools = {f.name for f in dataclasses.fields(FastOptions) if f.type in (bool, "bool")} - {"fold_gains"}  # at load
    cfg = named_config("anchor-3b")
    problem = arguments.first(arguments.known("--flip", args.flip, sorted(bools)),
                              arguments.at_least("--ctx", args.ctx, 1), arguments.at_least("--steps", args.steps, 1),
                              arguments.in_range("--verify-k", args.verify_k, 0, 16),
                              arguments.in_range("--layers", args.layers, 0, len(cfg.layers)),
                              arguments.writable_file("--out", args.out),
                              arguments.writable_file("--summary", args.summary))
    if problem:
        return arguments.refuse(f"bench account: {problem}")
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=cfg.layers[:args.layers])
    if not torch.cuda.is_available():
        raise SystemExit("bench account: needs a CUDA device")
    from fastpath.engine.configs import n_params, random_device_weights
    from fastpath.model import FastModel
    from hybridqual.bench.engine import DEV, copy_bandwidth, kernel_table
    model = FastModel(cfg, random_device_weights(cfg, DEV, torch.bfloat16), DEV, torch.bfloat16)
    copy_bps = copy_bandwidth()
    need = bytes_needed(cfg, args.ctx)

    def steps(m) -> tuple[dict, dict | None]:
        acc = account(kernel_table(m, steps=args.steps, top=10 ** 6, prompt_len=args.ctx), need, copy_bps,
                      n_params(cfg) * 2)
        if not args.verify_k:
            return acc, None
        spec = missing_drafts(args.verify_k, cfg.vocab_size, args.steps + 64)
        return acc, account(kernel_table(m, steps=args.steps, top=10 ** 6, prompt_len=args.ctx, spec=spec), need,
                            copy_bps, n_params(cfg) * 2)
    acc, vacc = steps(model)
    lines = [f"bs1 decode step{f' (the first {args.layers} layers: a draft forward)' if args.layers else ''}"]
    lines += lines_of(acc)
    out = {"account": acc}
    if vacc is not None:
        lines += [f"speculative step, k = {args.verify_k}, every draft wrong (verify {args.verify_k + 1} positions "
                  "+ rollback)"] + lines_of(vacc) + versus(acc, vacc)
        out["verify_account"] = vacc
    for name in args.flip:
        value = not getattr(model.options, name)
        facc, fvacc = steps(model.with_options(**{name: value}))
        out[f"{name}={value}"] = {"account": facc, "verify_account": fvacc}
        lines += [f"with {name}={value}: decode step {facc['wall_us']} µs (default {acc['wall_us']})"
                  + (f", speculative step {fvacc['wall_us']} µs (default {vacc['wall_us']})" if fvacc else "")]
        lines += [f"  {ln}" for ln in versus(acc, facc)[1:]]
        if fvacc:
            lines += [f"  speculative: {ln}" for ln in versus(vacc, fvacc)[1:]]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
