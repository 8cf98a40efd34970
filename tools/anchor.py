"""Write anchor-3b (DESIGN §8), or a shape people serve, as a real HF folder: config.json + sharded bf16
safetensors, seeded random weights.

    python -m hybridqual.anchor write /work/tmp_anchor/anchor-3b           # 2,865,483,840 params, ~5.7 GB
    python -m hybridqual.anchor write /tmp/anchor-s16 --scale 16 --layers 8   # a small variant with the same layout
    python -m hybridqual.anchor write /work/tmp_anchor/bamba-9b --shape bamba-9b          # 9,778,138,240 params
    python -m hybridqual.anchor write /work/tmp_anchor/nano-30b --shape nemotron-3-nano-30b-a3b   # 31,577,940,288
    python -m hybridqual.anchor score /work/tmp_anchor/anchor-3b --prompt 64 --tokens 16 [--in-memory]

`score` runs the fp64 oracle teacher-forced over one request (seeded prompt + seeded tokens: the cost does
not depend on the token values) with the streamed oracle (default) or oracle.load, and prints the wall time
and the process's peak RSS (run each in a fresh process: docs/performance.md).

`--shape` names the config in fastpath.engine.configs: "anchor-3b" (the default; Bamba layout, chunk 256, the one
tools/bench/engine.py runs), "bamba-9b" (Bamba-9B's shape) or "nemotron-3-nano-30b-a3b" (Nemotron-3-Nano-30B-A3B's
layer pattern, MoE and widths). `--scale k` divides every width by k (hidden, Mamba and attention heads, FFN,
expert and shared-expert widths, vocab; head dims, state, chunk, expert count and top-k kept; KV heads and SSM
groups divided too, at least 1); `--layers n` keeps the first n layers of the shape's pattern.
The model is written part by part (the top tensors, then `--layers-per-shard` layers per shard), each tensor
from its own generator seeded by (seed, name), so memory holds one shard and the bytes do not depend on the
sharding. The folder is written under a temporary name and renamed at the end; an existing one needs --force.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import zlib

import torch
from safetensors.torch import save_file
from torch import Tensor

from fastpath.engine.configs import named_config, n_params
from oracle.checkpoint import expected_shapes, part_names, to_hf, write_hf_config
from oracle.config import HybridConfig


SHAPES = ("anchor-3b", "bamba-9b", "nemotron-3-nano-30b-a3b")     # what `write --shape` takes
_WIDTHS = ("hidden_size", "mamba_n_heads", "n_attn_heads", "mlp_intermediate_size", "vocab_size",
           "moe_intermediate_size", "moe_shared_intermediate_size")


def shape_config(shape: str = "anchor-3b", scale: int = 1, layers: int | None = None) -> HybridConfig:
    """Shape `shape` (SHAPES) with widths divided by `scale` and its first `layers` layers (None: all of them)."""
    if shape not in SHAPES:
        raise ValueError(f"--shape: {shape!r} is not one of {', '.join(SHAPES)}")
    base = named_config(shape)
    widths = {k: getattr(base, k) for k in _WIDTHS if getattr(base, k)}
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1 or any(v % scale for v in widths.values()):
        raise ValueError(f"--scale: {scale!r} must be a positive integer dividing {widths}")
    layers = base.num_layers if layers is None else layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= base.num_layers:
        raise ValueError(f"--layers: {layers!r} must be an integer in [1, {base.num_layers}]")
    if scale == 1 and layers == base.num_layers:
        return base
    kv, groups = max(1, base.n_kv_heads // scale), max(1, base.mamba_n_groups // scale)
    if base.n_attn_heads and (base.n_attn_heads // scale) % kv:
        raise ValueError(f"--scale: {scale} leaves {base.n_attn_heads // scale} attention heads for {kv} KV heads")
    if (base.mamba_n_heads // scale) % groups:
        raise ValueError(f"--scale: {scale} leaves {base.mamba_n_heads // scale} Mamba heads for {groups} groups")
    return dataclasses.replace(base, layers=base.layers[:layers], n_kv_heads=kv, mamba_n_groups=groups,
                               **{k: v // scale for k, v in widths.items()})


def anchor_config(scale: int = 1, layers: int = 32) -> HybridConfig:
    """anchor-3b with widths divided by `scale` and the first `layers` layers (scale 1, 32 layers: anchor-3b)."""
    return shape_config("anchor-3b", scale, layers)


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """The seeded init of one canonical tensor (fastpath.engine.configs.random_device_weights' roles)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if leaf == "A_log":
        return torch.log(1.0 + 7.0 * torch.rand(shape, generator=g))
    if leaf == "dt_bias":
        return -3.0 + 3.0 * torch.rand(shape, generator=g)
    if leaf == "D":
        return 0.5 + torch.rand(shape, generator=g)
    if leaf == "bias":
        return torch.zeros(shape)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])


def part_tensors(c: HybridConfig, part: int | str, seed: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """HF-named tensors of one part ("top" or layer i), in `dtype`."""
    shapes, names = expected_shapes(c), part_names(c, part)
    canon = {n: _tensor(n, shapes[n], seed) for n in sorted(names) if not (n == "lm_head.weight" and
                                                                             c.tie_word_embeddings)}
    if c.tie_word_embeddings and "embed.weight" in canon:
        canon["lm_head.weight"] = canon["embed.weight"]
    return {k: v.to(dtype).contiguous() for k, v in to_hf(c, canon, part).items()}


def write_anchor(path: str, config: HybridConfig, seed: int = 0, layers_per_shard: int = 4,
                 dtype: torch.dtype = torch.bfloat16, force: bool = False) -> dict:
    """Write the folder part by part (see module docstring); returns {"params", "bytes", "shards"}."""
    if os.path.exists(path) and not force:
        raise FileExistsError(f"{path}: exists (use --force to replace it)")
    tmp = path.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    groups = [["top"]] + [list(range(i, min(i + layers_per_shard, config.num_layers)))
                          for i in range(0, config.num_layers, layers_per_shard)]
    weight_map, total = {}, 0
    for k, parts in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: dict[str, Tensor] = {}
        for part in parts:
            tensors.update(part_tensors(config, part, seed, dtype))
        save_file(tensors, os.path.join(tmp, shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: shard for n in tensors})
        del tensors
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
    write_hf_config(tmp, config, dtype)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    return {"params": n_params(config), "bytes": total, "shards": len(groups)}


def score(folder: str, prompt_len: int, n_tokens: int, in_memory: bool, seed: int = 0, device: str = "cpu") -> dict:
    """Time one teacher-forced fp64 scoring of a seeded request; returns wall seconds, peak RSS, margins."""
    import resource
    import time

    import oracle
    from oracle.streamed import StreamedOracle, token_scores
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if in_memory:
        if device != "cpu":
            raise ValueError("--device: the in-memory oracle runs on the CPU")
        model = oracle.load(folder, dtype=torch.float64)
        vocab = model.config.vocab_size
    else:
        so = StreamedOracle(folder, device=device)
        vocab = so.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    tokens = torch.randint(0, vocab, (n_tokens,), generator=g).tolist()
    rows = model.prefill(prompt + tokens)[0][prompt_len - 1:] if in_memory else so.score([(prompt, tokens)])[0]
    if device != "cpu":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s = token_scores(rows, tokens)
    gpu = torch.cuda.max_memory_allocated() if device != "cpu" else 0
    return {"wall_s": wall, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "gpu_peak": gpu, "rss_before_bytes": rss0, "min_margin": min(s.margins),
            "finite": bool(torch.isfinite(rows).all())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.anchor", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write an anchor folder")
    w.add_argument("out", help="folder to write")
    w.add_argument("--shape", default="anchor-3b", help=f"the shape: {' | '.join(SHAPES)} (default anchor-3b)")
    w.add_argument("--scale", type=int, default=1, help="divide every width by this (default 1: the real size)")
    w.add_argument("--layers", type=int, default=None, help="number of layers (default: all of the shape's)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--layers-per-shard", type=int, default=4)
    w.add_argument("--force", action="store_true", help="replace an existing folder")
    sc = sub.add_parser("score", help="time the fp64 oracle scoring one request (peak RSS)")
    sc.add_argument("folder")
    sc.add_argument("--prompt", type=int, default=64)
    sc.add_argument("--tokens", type=int, default=16)
    sc.add_argument("--in-memory", action="store_true", help="oracle.load instead of the streamed oracle")
    sc.add_argument("--device", default="cpu", help="streamed oracle's device (cpu, cuda): fp64 either way")
    args = ap.parse_args(argv)
    if args.cmd == "score":
        try:
            if args.prompt < 1 or args.tokens < 0:
                raise ValueError("--prompt must be >= 1 and --tokens >= 0")
            r = score(args.folder, args.prompt, args.tokens, args.in_memory, device=args.device)
        except ValueError as e:                       # ConfigError / CheckpointError are ValueErrors too
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{'in-memory' if args.in_memory else 'streamed'} fp64 score of {args.prompt}+{args.tokens} tokens: "
              f"{r['wall_s']:.1f} s wall, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB (after imports "
              f"{r['rss_before_bytes'] / 2**30:.2f} GiB), GPU peak {r['gpu_peak'] / 2**30:.2f} GiB, logits finite "
              f"{r['finite']}, min margin {r['min_margin']:.4f}")
        return 0
    try:
        cfg = shape_config(args.shape, args.scale, args.layers)
        if args.layers_per_shard < 1:
            raise ValueError("--layers-per-shard: must be >= 1")
        info = write_anchor(args.out, cfg, args.seed, args.layers_per_shard, force=args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {info['params']:,} params, {info['bytes'] / 1e9:.2f} GB bf16 in {info['shards']} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
