"""Tensor parallel (Megatron-style) over torch.distributed: gloo on CPU, NCCL on GPU.

Every rank holds its shard of the weights and builds its own StateBank from the *per-rank* config
(`shard_config`), so the ONE bank is split by heads across ranks with the same slots on every rank.  Each rank
runs the same deterministic scheduler on the same trace (no rank sends tokens to another: greedy argmax and
seeded sampling of replicated logits give the same token everywhere), so row/slot mappings and schedule logs
are identical — `tests/test_tp.py` checks the logs and tokens across ranks.

    Mamba2     heads split: in_proj rows [z | x | B | C | dt] -> each rank's z/x/dt heads; B/C groups split when
               n_groups % tp == 0, else (tp % n_groups == 0) each rank keeps the one group its heads read, and
               the gated RMSNorm over a group spanning ranks all-reduces the per-group sum of squares;
               conv1d channels, A_log/D/dt_bias, norm.weight split the same way; out_proj row-parallel
    attention  q heads and KV heads split (n_kv_heads % tp == 0 required); o_proj row-parallel
    MLP        gate/up column-parallel, down row-parallel
    MoE        every expert's FFN split (experts.* along the intermediate dim), router replicated; the shared
               expert split like an MLP; one all-reduce of routed + shared
    embed, lm_head, norms: replicated
Row-parallel outputs are summed by `all_reduce`; a row-parallel bias is kept on rank 0 only.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fastpath.model import FastModel
from fastpath.options import FastOptions, check_options
from oracle.config import ConfigError, HybridConfig


def _check(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {msg}")


def shard_config(config: HybridConfig, tp: int) -> HybridConfig:
    """The per-rank config (head/group/intermediate counts divided by tp); clear errors for unsupported splits."""
    c = config
    _check(tp >= 1, "tp", f"must be >= 1, got {tp}")
    if c.mamba_layer_ids:
        _check(c.mamba_n_heads % tp == 0, "mamba_n_heads", f"{c.mamba_n_heads} heads do not split over tp={tp}")
        G = c.mamba_n_groups
        _check(G % tp == 0 or tp % G == 0, "mamba_n_groups",
               f"{G} groups: need n_groups % tp == 0 or tp % n_groups == 0 (tp={tp})")
    if c.attention_layer_ids:
        _check(c.n_attn_heads % tp == 0, "n_attn_heads", f"{c.n_attn_heads} heads do not split over tp={tp}")
        _check(c.n_kv_heads % tp == 0, "n_kv_heads",
               f"{c.n_kv_heads} KV heads do not split over tp={tp} (KV-head replication is not supported)")
    if any(s.ffn == "mlp" for s in c.layers):
        _check(c.mlp_intermediate_size % tp == 0, "mlp_intermediate_size", f"does not split over tp={tp}")
    if any(s.ffn == "moe" for s in c.layers):
        _check(c.moe_intermediate_size % tp == 0, "moe_intermediate_size", f"does not split over tp={tp}")
        _check(c.moe_shared_intermediate_size % tp == 0, "moe_shared_intermediate_size",
               f"does not split over tp={tp}")
    return dataclasses.replace(
        c, mamba_n_heads=c.mamba_n_heads // tp, mamba_n_groups=max(c.mamba_n_groups // tp, 1),
        n_attn_heads=c.n_attn_heads // tp, n_kv_heads=c.n_kv_heads // tp,
        mlp_intermediate_size=c.mlp_intermediate_size // tp, moe_intermediate_size=c.moe_intermediate_size // tp,
        moe_shared_intermediate_size=c.moe_shared_intermediate_size // tp)


def _part(t: Tensor, dim: int, rank: int, tp: int) -> Tensor:
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def shard_tensors(config: HybridConfig, tensors: dict[str, Tensor], rank: int, tp: int) -> dict[str, Tensor]:
    """Rank `rank`'s canonical tensors (same names, per-rank shapes) of the full canonical `tensors`."""
    c = config
    shard_config(c, tp)
    H, G, N = c.mamba_n_heads, c.mamba_n_groups, c.mamba_d_state
    di = c.d_inner
    Hl, dil = H // tp, di // tp
    if G % tp == 0:
        g0, Gl = rank * (G // tp), G // tp
    else:
        g0, Gl = rank // (tp // G), 1
    col = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
           "shared.gate_proj", "shared.up_proj")
    row = ("mamba.out_proj", "attn.o_proj", "mlp.down_proj", "shared.down_proj")
    out = {}
    for k, t in tensors.items():
        base, leaf = k.rsplit(".", 1)
        mod = ".".join(base.split(".")[-2:])
        if ".mamba." in k and leaf in ("weight", "bias") and mod == "mamba.in_proj":
            z, xs, B, C, dt = torch.split(t, [di, di, G * N, G * N, H], dim=0)
            t = torch.cat([_part(z, 0, rank, tp), _part(xs, 0, rank, tp), B[g0 * N:(g0 + Gl) * N],
                           C[g0 * N:(g0 + Gl) * N], _part(dt, 0, rank, tp)])
        elif mod == "mamba.conv1d":
            xs, B, C = torch.split(t, [di, G * N, G * N], dim=0)
            t = torch.cat([_part(xs, 0, rank, tp), B[g0 * N:(g0 + Gl) * N], C[g0 * N:(g0 + Gl) * N]])
        elif k.endswith(("mamba.A_log", "mamba.D", "mamba.dt_bias")):
            t = t[rank * Hl:(rank + 1) * Hl]
        elif mod == "mamba.norm":
            t = t[rank * dil:(rank + 1) * dil]
        elif mod in col:
            t = _part(t, 0, rank, tp)
        elif mod in row:
            if leaf == "bias":
                if rank != 0:
                    continue
            else:
                t = _part(t, 1, rank, tp)
        elif k.endswith(("experts.gate_proj", "experts.up_proj")):
            t = _part(t, 1, rank, tp)
        elif k.endswith("experts.down_proj"):
            t = _part(t, 2, rank, tp)
        out[k] = t.contiguous()
    return out


class TPModel(FastModel):
    """FastModel over this rank's shard; row-parallel outputs all-reduced over `group`."""

    def __init__(self, config: HybridConfig, tensors: dict[str, Tensor], device="cpu", dtype=torch.float32,
                 rank: int | None = None, tp: int | None = None, group=None, options: FastOptions | None = None):
        """config/tensors: the FULL model; rank/tp default to torch.distributed's rank and world size; options as
        FastModel's, but never fold_norm (the residual add follows the all-reduce, not a GEMV epilogue)."""
        self.rank = dist.get_rank(group) if rank is None else rank
        self.tp = dist.get_world_size(group) if tp is None else tp
        self.group, self.full_config = group, config
        super().__init__(shard_config(config, self.tp), shard_tensors(config, tensors, self.rank, self.tp),
                         device, dtype, check_options(options).replace(fold_norm=False))
        G = config.mamba_n_groups
        self.span_group = None if G % self.tp == 0 else self.rank // (self.tp // G)   # group spanning ranks
        self._reduce = {f"layers.{i}.mamba.out_proj" for i in config.mamba_layer_ids}
        self._reduce |= {f"layers.{i}.attn.o_proj" for i in config.attention_layer_ids}
        self._reduce |= {f"layers.{i}.mlp.down_proj" for i, s in enumerate(config.layers) if s.ffn == "mlp"}

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum over the TP group, in place."""
        if self.tp > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def _linear(self, x, name: str, act: str | None = None, conv=None, rms_eps=None, residual=None) -> Tensor:
        if residual is not None and name in self._reduce:
            raise ValueError(f"TPModel: {name} is row-parallel; its residual add follows the all-reduce")
        y = super()._linear(x, name, act, conv, rms_eps, residual)
        return self.all_reduce(y) if name in self._reduce else y

    def moe(self, x: Tensor, p: str) -> Tensor:
        """Routed (expert FFNs split) + shared expert partial sums, then one all-reduce."""
        return self.all_reduce(super().moe(x, p).contiguous())

    def _gated_norm(self, y: Tensor, z: Tensor, weight: Tensor) -> Tensor:
        """Gated RMSNorm; a group spanning ranks reduces its sum of squares over the TP group."""
        c = self.config
        if self.span_group is None:
            return super()._gated_norm(y, z, weight)
        fc = self.full_config
        g = y.float() * F.silu(z.float())
        ss = torch.zeros(g.shape[0], fc.mamba_n_groups, dtype=torch.float32, device=g.device)
        ss[:, self.span_group] = g.pow(2).sum(-1)
        ss = self.all_reduce(ss)[:, self.span_group:self.span_group + 1]
        inv = torch.rsqrt(ss / (fc.d_inner // fc.mamba_n_groups) + c.norm_eps)
        return (weight.float() * (g * inv)).to(y.dtype)


def tp_model(config: HybridConfig, tensors: dict[str, Tensor], device="cpu", dtype=torch.float32,
             options: FastOptions | None = None) -> FastModel:
    """This process's TPModel (rank/world from torch.distributed); options.batch_invariant: fixed-tile GEMMs
    inside the TP reduce."""
    return TPModel(config, tensors, device, dtype, options=options)


def engine_from_pretrained(path, engine_config, device=None, dtype=None, max_len: int = 2048, tp: int = 1,
                           batch_invariant: bool = False, graphs: bool = False, options: FastOptions | None = None):
    """Engine.from_pretrained with `--tp N` / `--batch-invariant`: under torchrun each rank gets its shard.

    tp > 1 needs torch.distributed's env (torchrun --nproc_per_node N); every rank must run the same traces,
    and only rank 0 should write reports (`torch.distributed.get_rank() == 0`).
    """
    from fastpath.batch_invariant import engine_class, make_model
    from oracle.checkpoint import load_checkpoint
    options = check_options(options)
    if batch_invariant:
        options = options.replace(batch_invariant=True)
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    cfg, tensors = load_checkpoint(path)
    if tp > 1:
        rank, world = init_from_env("cuda" if cuda else "cpu")
        if world != tp:
            raise ConfigError(f"tp: --tp {tp} but torch.distributed has {world} processes (use torchrun "
                              f"--nproc_per_node {tp})")
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device = torch.device(device or ("cuda" if cuda else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = (tp_model(cfg, tensors, device, dtype, options) if tp > 1
             else make_model(cfg, tensors, device, dtype, options))
    return engine_class(options)(model, engine_config, max_len=max_len, graphs=graphs)


def init_from_env(device_type: str = "cpu") -> tuple[int, int]:
    """init_process_group from torchrun's env (gloo on CPU, NCCL on CUDA); returns (rank, world size)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank = dist.get_rank()
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return rank, dist.get_world_size()


def load_spec_model(spec: dict) -> tuple[HybridConfig, dict[str, Tensor]]:
    """(config, full tensors) of a JSON model spec: {"path": hf_folder} or {"zoo": arch, "seed": s, **overrides}."""
    if "path" in spec:
        from oracle.checkpoint import load_checkpoint
        return load_checkpoint(spec["path"])
    from oracle import zoo
    kw = {k: v for k, v in spec.items() if k not in ("zoo", "seed")}
    cfg = zoo.tiny_config(spec["zoo"], **kw)
    return cfg, zoo.random_weights(cfg, seed=spec.get("seed", 0))


def run_traces_worker(rank: int, world: int, init_file: str, job: dict, out_dir: str) -> None:
    """One TP rank (torch.multiprocessing.spawn target): run job's traces, write rank<r>.json (tokens, logs).

    job: {"model": spec, "traces": [paths], "modes": [...], "backend": "triton"|"torch", "batch_invariant": bool,
    "pad_decode": bool (the graphs' bucket shapes, eager), "device_drafts": bool (FastOptions.spec_device_drafts:
    speculative traces' drafts on the device, reported per run)}.
    """
    import json
    import os

    from fastpath.engine.engine import Engine
    from oracle.trace import load_trace
    torch.set_num_threads(1)
    import datetime
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cfg, tensors = load_spec_model(job["model"])
        options = FastOptions(backend=job.get("backend", "triton"), batch_invariant=job.get("batch_invariant", False),
                              spec_device_drafts=job.get("device_drafts", False))
        model = tp_model(cfg, tensors, "cpu", torch.float32, options)
        out = {}
        for path in job["traces"]:
            trace = load_trace(path)
            pad = job.get("pad_decode", False)
            engine = Engine(model, trace.engine, max_len=max(len(r.prompt) + r.max_new_tokens for r in trace.requests),
                            pad_decode=pad)
            out[path] = {}
            for mode in job["modes"]:
                dev = getattr(engine.spec, "device_drafts", None)
                before = dev.steps if dev is not None else 0
                r = engine.run_trace(trace, mode=mode)
                out[path][mode] = {"tokens": r.tokens, "log": r.schedule_log.to_json(), "digest": r.digest}
                if pad:
                    out[path][mode]["device_draft_steps"] = (dev.steps if dev is not None else 0) - before
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()            # no rank tears gloo down while another is still in a collective
    finally:
        dist.destroy_process_group()


def run_tp_cpu(job: dict, world: int, work_dir: str) -> list[dict]:
    """Run `job` on `world` gloo processes (spawned); returns each rank's results."""
    import json
    import os

    import torch.multiprocessing as mp
    os.makedirs(work_dir, exist_ok=True)
    init = os.path.join(work_dir, "tp_init")
    if os.path.exists(init):
        os.remove(init)
    mp.spawn(run_traces_worker, args=(world, init, job, work_dir), nprocs=world, join=True)
    out = []
    for r in range(world):
        with open(os.path.join(work_dir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out
