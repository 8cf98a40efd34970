"""Where a bs1 decode step of anchor-3b goes: one step captured as a CUDA graph, timed, with variants.

    python3 -m hybridqual.bench.ablation [--variants NAME ...] [--pos 600] [--list]

Each variant patches one thing for its capture — a FastOptions field, a launch rule, an environment switch
(HQ_PDL), or a kernel family replaced by a no-op (`skip …`: wrong numbers, right timing) — and times 200 graph
replays × 5 (median). The `skip` rows say what a kernel family costs *in the dependent chain* of a step, which a
profiler's per-kernel durations do not (under PDL kernels overlap their neighbours). The first row is the code
as it is; the table ends with each row's difference to it and the roofline (weight bytes / copy bandwidth of
this run). Its base row tracks `tools/bench/engine.py --bs1-only` (async + graphs) within ~1%
(docs/journal/performance.md, History: the run at 5ba444b).
"""
from __future__ import annotations

import argparse
import os

import torch

import fastpath.kernels.attention_decode as ad
import fastpath.kernels.gemv as gv
import fastpath.kernels.ssm_step as sst
from fastpath.engine import ops
from fastpath.engine.bank import StateBank
from fastpath.engine.configs import n_params, named_config, random_device_weights
from fastpath.model import FastModel, StepBatch
from hybridqual.bench import arguments
from hybridqual.bench.chain import time_graph
from hybridqual.bench.engine import copy_bandwidth

DEV = torch.device("cuda")


def decode_batch(pos: int) -> StepBatch:
    """One decode row at position `pos` in slot 0."""
    z32, e32 = torch.zeros(1, dtype=torch.int32, device=DEV), torch.zeros(0, dtype=torch.int32, device=DEV)
    return StepBatch(torch.tensor([5], device=DEV), torch.tensor([pos], device=DEV), 1, z32.clone(), z32.clone(),
                     e32, torch.zeros(0, dtype=torch.int64, device=DEV), e32,
                     torch.zeros(1, dtype=torch.int64, device=DEV), [0], [])


def time_step(model: FastModel, bank: StateBank, pos: int, reps: int = 200) -> float:
    """ms per replay of a graph of one bs1 decode step + greedy sampling (median of 5 timings of `reps`)."""
    b, out = decode_batch(pos), torch.zeros(1, dtype=torch.int64, device=DEV)
    return time_graph(lambda: ops.greedy_sample(model.forward(b, bank), out), reps, warm=20) / 1e3


class Patch:
    """Attribute swaps (obj, name, value) and environment variables for the duration of a with-block."""

    def __init__(self, attrs: list, env: dict[str, str]):
        self.attrs, self.env, self.old, self.old_env = attrs, env, [], {}

    def __enter__(self):
        for obj, name, val in self.attrs:
            self.old.append((obj, name, getattr(obj, name)))
            setattr(obj, name, val)
        self.old_env = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for obj, name, val in reversed(self.old):
            setattr(obj, name, val)
        for k, v in self.old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


OPT = "options"    # a patch (OPT, field, value) is a FastOptions change (model.with_options), not a setattr


def variants() -> dict[str, tuple[dict, list]]:
    """name -> (environment, attribute patches; (OPT, field, value): a FastOptions change)."""
    F, rule0, srule0, arule0 = FastModel, gv.gemv_launch_rule, sst.ssm_step_launch_rule, ad.attention_decode_rule
    noop = lambda *a, out=None, **k: out  # noqa: E731  (a skipped kernel: its output buffer, unwritten)

    def small(**kw):      # the K < 4096 GEMV projections only
        return [(gv, "gemv_launch_rule", lambda N, K: rule0(N, K) if K >= 4096 else {**rule0(N, K), **kw})]

    def big(**kw):        # the K >= 4096 GEMV projections only
        return [(gv, "gemv_launch_rule", lambda N, K: rule0(N, K) if K < 4096 else {**rule0(N, K), **kw})]
    return {
        "code as it is": ({}, []),
        "PDL 2 (trigger, then wait)": ({"HQ_PDL": "2"}, []),
        "PDL off": ({"HQ_PDL": "0"}, []),
        "no norm folds (add_rms_norm, gated norm as kernels)": ({}, [(OPT, "fold_norm", False)]),
        "no folds (act_mul, conv step, norms as kernels)": ({}, [(OPT, "fold_act", False), (OPT, "fold_conv", False),
                                                                  (OPT, "fold_norm", False)]),
        "attention: 128-key chunks": ({}, [(ad, "attention_decode_rule", lambda L, D: {**arule0(L, D), "CHUNK": 128})]),
        "attention: 32-key chunks": ({}, [(ad, "attention_decode_rule",
                                           lambda L, D: {**arule0(L, D), "CHUNK": 32, "BLOCK_N": 32})]),
        "attention: 8 warps (no spill at sm_90)": ({}, [(ad, "attention_decode_rule",
                                                         lambda L, D: {**arule0(L, D), "num_warps": 8})]),
        "K>=4096 GEMV: x in the weight layout (XB)": ({}, big(XB=True)),
        "every GEMV: x in the weight layout (XB)": ({}, [(gv, "gemv_launch_rule",
                                                          lambda N, K: {**rule0(N, K), "XB": True})]),
        "cuBLAS instead of the GEMV": ({}, [(OPT, "gemv", False)]),
        "K<4096 GEMV: 4 rows, 4 warps": ({}, small(BLOCK_N=4, num_warps=4)),
        "K>=4096 GEMV: 512-wide tiles, 4 warps": ({}, big(BLOCK_K=512, num_warps=4)),
        "ssm_step: 16 P-rows, 4 warps": ({}, [(sst, "ssm_step_launch_rule",
                                              lambda H, P, N: {**srule0(H, P, N), "BLOCK_P": 16, "num_warps": 4})]),
        "skip add+norm (norms unfolded)": ({}, [(OPT, "fold_norm", False),
                                                (F, "_add_norm", lambda self, h, out, name, rows=None:
                                                 (h, h[:1] if rows is not None else h))]),
        "skip gated norm (norms unfolded)": ({}, [(OPT, "fold_norm", False),
                                                  (F, "_gated_norm", lambda self, y, z, w: y)]),
        "skip ssm step": ({}, [(ops, "ssm_step", noop)]),
        "skip conv step (unfolded)": ({}, [(OPT, "fold_conv", False), (ops, "conv1d_step", noop)]),
        "skip RoPE + attention": ({}, [(ops, "rope", lambda qk, *a: qk), (ops, "attention_decode", noop)]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="*", help="names to run (default: all); the first is the reference row")
    ap.add_argument("--pos", type=int, default=600, help="decode position (attention context)")
    ap.add_argument("--list", action="store_true", help="list the variants and exit")
    args = ap.parse_args(argv)
    table = variants()
    if args.list:
        print("\n".join(table))
        return 0
    problem = arguments.first(arguments.known("--variants", args.variants or [], table),
                              arguments.at_least("--pos", args.pos, 1))
    if problem:
        return arguments.refuse(problem)
    names = args.variants or list(table)
    cfg = named_config("anchor-3b")
    model = FastModel(cfg, random_device_weights(cfg, DEV, torch.bfloat16), DEV, torch.bfloat16)
    bank = StateBank(cfg, 1, max(1024, args.pos + 8), DEV, kv_dtype=torch.bfloat16)
    bw = copy_bandwidth()
    roof_ms = 1e3 * 2 * n_params(cfg) / bw
    rows = []
    for name in names:
        env, attrs = table[name]
        opts = {field: val for obj, field, val in attrs if obj is OPT}
        try:
            with Patch([a for a in attrs if a[0] is not OPT], env):
                ms = time_step(model.with_options(**opts), bank, args.pos)
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            print(f"{name}: FAILED {type(e).__name__}: {e}"[:300], flush=True)
            continue
        rows.append((name, ms))
        print(f"{name:44s} {ms * 1e3:8.1f} µs/step {1e3 / ms:7.1f} tok/s", flush=True)
    print(f"\nanchor-3b bs1 decode at position {args.pos}, copy {bw / 1e12:.2f} TB/s, roofline {roof_ms * 1e3:.0f} "
          f"µs/step ({1e3 / roof_ms:.0f} tok/s)\n| variant | µs/step | tok/s | vs first |\n|---|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms * 1e3:.1f} | {1e3 / ms:.1f} | {1e3 * (ms - rows[0][1]):+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
