"""Train the tiny Bamba-style sorting model on CPU: `python -m hybridqual.train_tiny --seed S [--out DIR]`.

A compact batched, differentiable PyTorch Bamba forward (Mamba2 mixers + one attention layer, gated
SiLU MLP, partial RoPE), written for training only; the oracle is the truth it is checked against.
Every module is named as in HF's BambaForCausalLM, so `state_dict()` *is* the HF checkpoint.
Batches are right-padded and all sequences start at position 0, so SSD chunks line up across the batch
(chunk boundaries at multiples of `mamba_chunk_size`, as in oracle/ssd.py) and padding never reaches a
real position (everything is causal).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from hybridqual.scenarios import task

DEFAULT_OUT = Path("goldens/models/tiny-sort")


def tiny_sort_config() -> dict:
    """The HF config.json of the shipped model (model_type bamba)."""
    return {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba", "dtype": "float32",
        "vocab_size": task.VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "attn_layer_indices": [2],
        "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "max_position_embeddings": 256,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "time_step_limit": [0.0, float("inf")],
        "pad_token_id": task.PAD, "bos_token_id": task.BOS, "eos_token_id": task.EOS,
        "use_cache": True,
    }


def rms(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Plain RMSNorm with a weight (HF name: `weight`)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * rms(x, self.eps)


class GatedNorm(RMSNorm):
    """rmsnorm_per_group(y * silu(z)) * weight, groups of d / n_groups channels."""

    def __init__(self, d: int, n_groups: int, eps: float):
        super().__init__(d, eps)
        self.n_groups = n_groups

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        g = y * F.silu(z)
        g = rms(g.unflatten(-1, (self.n_groups, -1)), self.eps).flatten(-2)
        return self.weight * g


def ssd_batched(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, Q: int) -> Tensor:
    """Chunked SSD over a batch from a zero state: x [b,L,H,P], dt [b,L,H], B/C [b,L,H,N] -> y [b,L,H,P]."""
    b, L, H, P = x.shape
    pad = (-L) % Q
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    nc = (L + pad) // Q
    x, dt, B, C = (t.unflatten(1, (nc, Q)) for t in (x, dt, B, C))      # [b, c, Q, ...]
    a = torch.cumsum(dt * A, dim=2)                                     # [b,c,Q,H] log-decay from chunk start
    seg = a[:, :, :, None, :] - a[:, :, None, :, :]                     # [b,c,i,j,H] sum over (j, i]
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool))[None, None, :, :, None]
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))
    scores = torch.einsum("bcihn,bcjhn->bcijh", C, B) * decay
    y = torch.einsum("bcijh,bcjh,bcjhp->bcihp", scores, dt, x)         # within-chunk
    to_end = torch.exp(a[:, :, -1:, :] - a)                            # [b,c,Q,H]
    chunk_state = torch.einsum("bcjh,bcjh,bcjhp,bcjhn->bchpn", to_end, dt, x, B)
    h = x.new_zeros(b, H, P, B.shape[-1])
    carried = []
    for c in range(nc):                                                 # state passing between chunks
        carried.append(h)
        h = torch.exp(a[:, c, -1])[:, :, None, None] * h + chunk_state[:, c]
    carried = torch.stack(carried, dim=1)                               # [b,c,H,P,N] state entering chunk c
    y = y + torch.einsum("bcihn,bchpn,bcih->bcihp", C, carried, torch.exp(a))
    y = y + D[:, None] * x
    return y.flatten(1, 2)[:, :L]


class Conv(nn.Module):
    """Depthwise causal conv weights in HF's nn.Conv1d layout: weight [D, 1, K], bias [D]."""

    def __init__(self, d: int, k: int):
        super().__init__()
        bound = 1.0 / math.sqrt(k)
        self.weight = nn.Parameter(torch.empty(d, 1, k).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(d).uniform_(-bound, bound))

    def forward(self, u: Tensor) -> Tensor:
        """u [b, L, D] -> causal conv [b, L, D] (zero history)."""
        k = self.weight.shape[-1]
        y = F.conv1d(F.pad(u.transpose(1, 2), (k - 1, 0)), self.weight, self.bias, groups=u.shape[-1])
        return y.transpose(1, 2)


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; conv + SiLU; SSD; gated norm; out_proj (HF names)."""

    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["hidden_size"]
        self.H, self.P = cfg["mamba_n_heads"], cfg["mamba_d_head"]
        self.G, self.N = cfg["mamba_n_groups"], cfg["mamba_d_state"]
        self.Q = cfg["mamba_chunk_size"]
        self.d_inner = self.H * self.P
        self.conv_dim = self.d_inner + 2 * self.G * self.N
        self.limit = tuple(cfg["time_step_limit"])
        self.in_proj = nn.Linear(d, self.d_inner + self.conv_dim + self.H, bias=False)
        self.conv1d = Conv(self.conv_dim, cfg["mamba_d_conv"])
        dt0 = torch.exp(torch.empty(self.H).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt0 + torch.log(-torch.expm1(-dt0)))   # softplus^-1(dt0)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.H).uniform_(1.0, 16.0)))
        self.D = nn.Parameter(torch.ones(self.H))
        self.norm = GatedNorm(self.d_inner, self.G, cfg["rms_norm_eps"])
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)

    def forward(self, u: Tensor) -> Tensor:
        b, L, _ = u.shape
        z, xbc, dt = self.in_proj(u).split([self.d_inner, self.conv_dim, self.H], dim=-1)
        xbc = F.silu(self.conv1d(xbc))
        x, Bm, Cm = xbc.split([self.d_inner, self.G * self.N, self.G * self.N], dim=-1)
        dt = torch.clamp(F.softplus(dt + self.dt_bias), *self.limit)
        rep = self.H // self.G
        Bh = Bm.unflatten(-1, (self.G, self.N)).repeat_interleave(rep, dim=2)
        Ch = Cm.unflatten(-1, (self.G, self.N)).repeat_interleave(rep, dim=2)
        y = ssd_batched(x.unflatten(-1, (self.H, self.P)), dt, -torch.exp(self.A_log), Bh, Ch, self.D, self.Q)
        return self.out_proj(self.norm(y.flatten(2), z))


def rope_partial(x: Tensor, rot: int, theta: float) -> Tensor:
    """Rotate-half RoPE on the first `rot` dims of x [b, L, heads, d], positions 0..L-1."""
    L = x.shape[1]
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.int64).to(x.dtype) / rot)
    ang = torch.arange(L, dtype=x.dtype)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)[None, :, None, :]
    xr, xp = x[..., :rot], x[..., rot:]
    half = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    return torch.cat([xr * emb.cos() + half * emb.sin(), xp], -1)


class Attention(nn.Module):
    """Causal GQA with partial RoPE (HF names q/k/v/o_proj)."""

    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["hidden_size"]
        self.Hq, self.Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = d // self.Hq
        rp = cfg["rope_parameters"]
        self.rot = int(self.hd * rp.get("partial_rotary_factor", 1.0))
        self.theta = rp["rope_theta"]
        self.q_proj = nn.Linear(d, self.Hq * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.Hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.Hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.Hq * self.hd, d, bias=False)

    def forward(self, u: Tensor) -> Tensor:
        q = rope_partial(self.q_proj(u).unflatten(-1, (self.Hq, self.hd)), self.rot, self.theta)
        k = rope_partial(self.k_proj(u).unflatten(-1, (self.Hkv, self.hd)), self.rot, self.theta)
        v = self.v_proj(u).unflatten(-1, (self.Hkv, self.hd))
        rep = self.Hq // self.Hkv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """Gated SiLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """Pre-norm (mixer, FFN) pair; the mixer is `mamba` or `self_attn`."""

    def __init__(self, cfg: dict, attention: bool):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.pre_ff_layernorm = RMSNorm(cfg["hidden_size"], eps)
        if attention:
            self.self_attn = Attention(cfg)
        else:
            self.mamba = Mamba2Mixer(cfg)
        self.feed_forward = MLP(cfg)

    def forward(self, h: Tensor) -> Tensor:
        mixer = self.self_attn if hasattr(self, "self_attn") else self.mamba
        h = h + mixer(self.input_layernorm(h))
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class Body(nn.Module):
    """HF `model.`: embeddings, layers, final norm."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        attn = set(cfg["attn_layer_indices"])
        self.layers = nn.ModuleList(Layer(cfg, i in attn) for i in range(cfg["num_hidden_layers"]))
        self.final_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class TinyBamba(nn.Module):
    """The training model; `state_dict()` keys are HF BambaForCausalLM tensor names."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        """ids [b, L] (positions 0..L-1) -> logits [b, L, vocab]."""
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.final_layernorm(h))


def batch_of(examples: list[task.Example]) -> tuple[Tensor, Tensor]:
    """Right-padded inputs [b, L] and targets [b, L] (-100 except on answer positions)."""
    seqs = [e.prompt + e.answer for e in examples]
    L = max(len(s) for s in seqs) - 1
    ids = torch.full((len(seqs), L), task.PAD, dtype=torch.long)
    tgt = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        ids[i, :len(s) - 1] = torch.tensor(s[:-1])
        p = len(e.prompt)
        tgt[i, p - 1:len(s) - 1] = torch.tensor(e.answer)
    return ids, tgt


@torch.no_grad()
def greedy_batch(model: TinyBamba, examples: list[task.Example]) -> tuple[list[list[int]], list[float]]:
    """Greedy outputs and per-token margins, recomputing the full forward each step (grouped by prompt length)."""
    outputs: list[list[int]] = [[] for _ in examples]
    margins: list[float] = []
    by_len: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        by_len.setdefault(len(e.prompt), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([examples[i].prompt for i in idx])
        live = torch.ones(len(idx), dtype=torch.bool)
        for _ in range(max(task.max_new_tokens(examples[i]) for i in idx)):
            last = model(ids)[:, -1]
            tok = last.argmax(-1)
            marg = task.top2_margin(last)
            for r, i in enumerate(idx):
                if live[r]:
                    outputs[i].append(int(tok[r]))
                    margins.append(float(marg[r]))
                    if int(tok[r]) == task.EOS or len(outputs[i]) >= task.max_new_tokens(examples[i]):
                        live[r] = False
            if not live.any():
                break
            ids = torch.cat([ids, tok[:, None]], dim=1)
    return outputs, margins


def evaluate(model: TinyBamba, examples: list[task.Example]) -> dict:
    """Held-out exact-answer accuracy and margin statistics with the training forward (fp32)."""
    model.eval()
    outputs, margins = greedy_batch(model, examples)
    model.train()
    return {"n": len(examples), "accuracy": task.accuracy(examples, outputs),
            "margins": task.margin_stats(margins)}


def save(model: TinyBamba, out: Path, report: dict) -> str:
    """Write config.json, model.safetensors (fp32, HF names) and train_report.json; returns the weights' sha256."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.cfg, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    report = {**report, "model_sha256": sha, "n_parameters": sum(t.numel() for t in tensors.values())}
    (out / "train_report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return sha


def train(seed: int, steps: int, batch: int, lr: float, threads: int, n_eval: int,
          log_every: int = 250, n_probe: int = 200) -> tuple[TinyBamba, dict]:
    """Train from `seed` (weights and data) for `steps` AdamW steps; returns the model and a report."""
    if seed == task.HELDOUT_SEED:
        raise ValueError(f"--seed must differ from the held-out seed {task.HELDOUT_SEED}")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = TinyBamba(tiny_sort_config())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    warm = max(1, steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rng = random.Random(seed)
    probe = task.make_examples(task.HELDOUT_SEED + 1, n_probe)  # a small monitor set, distinct from held-out
    t0, c0, log = time.time(), time.process_time(), []
    for step in range(1, steps + 1):
        ids, tgt = batch_of([task.make_example(rng) for _ in range(batch)])
        loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps:
            entry = {"step": step, "loss": round(loss.item(), 6), "seconds": round(time.time() - t0, 1)}
            if probe and (step % (4 * log_every) == 0 or step == steps):
                ev = evaluate(model, probe)
                entry["probe_accuracy"] = ev["accuracy"]
                entry["probe_median_margin"] = round(ev["margins"]["median"], 3)
            log.append(entry)
            print(json.dumps(entry), flush=True)
    train_s, cpu_s = time.time() - t0, time.process_time() - c0
    ev = evaluate(model, task.heldout(n_eval))
    report = {"seed": seed, "steps": steps, "batch": batch, "lr": lr, "threads": threads,
              "train_seconds": round(train_s, 1), "train_cpu_seconds": round(cpu_s, 1),
              "task": "sort 16-20 digits (tools/scenarios/task.py)",
              "heldout": {"seed": task.HELDOUT_SEED, "n": ev["n"], "accuracy": ev["accuracy"],
                          "margins": {k: round(v, 4) for k, v in ev["margins"].items()},
                          "evaluated_with": "hybridqual.train_tiny forward, float32"},
              "log": log}
    return model, report


def oracle_evaluate(out: Path, n: int) -> dict:
    """Greedy held-out evaluation of the folder via `oracle.load` (fp64 prefill + decode); updates the report."""
    import oracle                                    # the truth side; training itself never needs it
    t0 = time.time()
    ev = task.evaluate(oracle.load(out, dtype=torch.float64), task.heldout(n))
    result = {"seed": task.HELDOUT_SEED, "n": ev["n"], "accuracy": ev["accuracy"],
              "margins": {k: round(v, 4) for k, v in ev["margins"].items()},
              "evaluated_with": "oracle.load(dtype=float64) prefill + decode", "seconds": round(time.time() - t0, 1)}
    path = out / "train_report.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report["heldout_oracle"] = result
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    ap = argparse.ArgumentParser(prog="python -m hybridqual.train_tiny",
                                 description="Train the tiny Bamba-style sorting model (goldens/models/tiny-sort).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-eval", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--oracle-eval", type=int, default=0, metavar="N",
                    help="evaluate the folder --out through the oracle on N held-out examples (no training)")
    a = ap.parse_args(argv)
    if a.seed == task.HELDOUT_SEED:
        ap.error(f"--seed must differ from the held-out seed {task.HELDOUT_SEED}")
    for name in ("steps", "batch", "threads", "n_eval"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.oracle_eval:
        torch.set_num_threads(a.threads)
        r = oracle_evaluate(a.out, a.oracle_eval)
        print(f"oracle held-out accuracy {r['accuracy']:.4f} over {r['n']}, median margin "
              f"{r['margins']['median']:.2f}, min {r['margins']['min']:.2f} ({r['seconds']} s)")
        return 0
    model, report = train(a.seed, a.steps, a.batch, a.lr, a.threads, a.n_eval)
    sha = save(model, a.out, report)
    h = report["heldout"]
    print(f"held-out accuracy {h['accuracy']:.4f} over {h['n']}, median margin {h['margins']['median']:.2f}, "
          f"train {report['train_seconds']} s, wrote {a.out} (sha256 {sha[:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
