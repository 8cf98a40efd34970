"""Feed-forward blocks, literal form: gated SiLU MLP, squared-ReLU MLP, and the two MoE routers.

    gated SiLU (Bamba, Granite):   down( silu(gate x) * up x )
    squared ReLU (Nemotron-H):     down( relu(up x)^2 )
    MoE:  y = sum_{e in topk(x)} w_e(x) * expert_e(x)  +  shared(x)
      softmax_topk  (granitemoehybrid): top-k of the router logits, weights = softmax over those k logits
      sigmoid_grouped (nemotron_h):     s = sigmoid(logits); choose with s + score_bias inside the best
                                        `topk_group` of `n_group` expert groups (group score = sum of its top 2);
                                        weights = s of the chosen, normalised to sum 1 (norm_topk_prob),
                                        times routed_scaling_factor
Router arithmetic is done in at least float32 (as HF does). Weights are dicts of canonical tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import HybridConfig


def activation(x: Tensor, act: str) -> Tensor:
    """silu or relu2 (squared ReLU)."""
    if act == "silu":
        return F.silu(x)
    if act == "relu2":
        return torch.square(F.relu(x))
    raise ValueError(f"activation: unknown {act!r}")


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """x @ w.T (+ b)."""
    y = x @ w.T
    return y if b is None else y + b


def mlp(x: Tensor, w: dict[str, Tensor], prefix: str, act: str) -> Tensor:
    """x [L, D] -> [L, D]; gated when `prefix + 'gate_proj.weight'` exists (SiLU), else up -> act -> down."""
    up = linear(x, w[prefix + "up_proj.weight"], w.get(prefix + "up_proj.bias"))
    if prefix + "gate_proj.weight" in w:
        gate = linear(x, w[prefix + "gate_proj.weight"], w.get(prefix + "gate_proj.bias"))
        hidden = activation(gate, act) * up
    else:
        hidden = activation(up, act)
    return linear(hidden, w[prefix + "down_proj.weight"], w.get(prefix + "down_proj.bias"))


def _router_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def route_softmax_topk(x: Tensor, router_w: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Granite router: (weights [L, k], expert ids [L, k]) = softmax over the top-k router logits."""
    logits = linear(x, router_w).to(_router_dtype(x))
    top_logits, top_idx = logits.topk(top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1), top_idx


def route_sigmoid_grouped(x: Tensor, router_w: Tensor, score_bias: Tensor, top_k: int, n_group: int,
                          topk_group: int, norm_topk_prob: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """Nemotron-H router (DeepSeek-V3 style): sigmoid scores, bias-corrected grouped top-k choice."""
    cd = _router_dtype(x)
    scores = torch.sigmoid(linear(x.to(cd), router_w.to(cd)))                        # [L, E]
    choice = scores + score_bias.to(cd)
    L, E = choice.shape
    group_scores = choice.view(L, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)   # [L, n_group]
    best_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    expert_mask = group_mask[:, :, None].expand(L, n_group, E // n_group).reshape(L, E)
    top_idx = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, top_idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, top_idx


def moe(x: Tensor, c: HybridConfig, w: dict[str, Tensor], prefix: str) -> Tensor:
    """x [L, D] -> [L, D]: sum over chosen experts of weight * expert(x), plus the shared expert."""
    if c.moe_router == "softmax_topk":
        weights, idx = route_softmax_topk(x, w[prefix + "router.weight"], c.moe_top_k)
    elif c.moe_router == "sigmoid_grouped":
        weights, idx = route_sigmoid_grouped(x, w[prefix + "router.weight"], w[prefix + "router.score_bias"],
                                             c.moe_top_k, c.moe_n_group, c.moe_topk_group, c.moe_norm_topk_prob,
                                             c.moe_routed_scaling_factor)
    else:
        raise ValueError(f"moe_router: unknown {c.moe_router!r}")
    gate_w = w.get(prefix + "experts.gate_proj")
    up_w, down_w = w[prefix + "experts.up_proj"], w[prefix + "experts.down_proj"]
    out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
    for e in range(up_w.shape[0]):                              # expert by expert, over the tokens routed to it
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        up = xe @ up_w[e].T
        hidden = activation(xe @ gate_w[e].T, c.mlp_act) * up if gate_w is not None else activation(up, c.mlp_act)
        out.index_add_(0, tok, weights[tok, slot, None] * (hidden @ down_w[e].T).to(weights.dtype))
    out = out.to(x.dtype)
    if c.moe_shared_intermediate_size:
        out = out + mlp(x, w, prefix + "shared.", c.mlp_act)
    return out
