"""OracleModel: the explicit hybrid Mamba2/attention language model, one request at a time.

    h = embed[tokens] * embedding_multiplier
    for each layer:  (Bamba/Granite: mixer then FFN; Nemotron-H: one of them; Mamba2: mixer only)
        h = h + residual_multiplier * mixer(rms_norm(h))          mixer = Mamba2 or attention (+ RoPE, KV cache)
        h = h + residual_multiplier * ffn(rms_norm(h))            ffn = MLP or MoE
    logits = lm_head(rms_norm(h)) / logits_scaling

A request's state (`OracleState`) holds, per layer, the conv window and SSM state (Mamba layers) or the
K/V cache (attention layers), plus `position`, the absolute position of the next token. Prefill continues
from any state (chunked prefill); chunk boundaries of the SSD scan are at absolute positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .attention import attention, rope
from .config import HybridConfig
from .gated_norm import rms_norm
from .mamba2 import mamba2_mixer, scan_dtype
from .mlp import linear, mlp, moe


@dataclass
class OracleState:
    """Per-request state: conv windows, SSM states and KV caches keyed by layer index, and the next position."""
    position: int = 0
    conv: dict[int, Tensor] = field(default_factory=dict)      # [conv_dim, d_conv-1], oldest first
    ssm: dict[int, Tensor] = field(default_factory=dict)       # [H, P, N]
    k: dict[int, Tensor] = field(default_factory=dict)         # [position, Hkv, d] (after RoPE)
    v: dict[int, Tensor] = field(default_factory=dict)         # [position, Hkv, d]

    def clone(self) -> "OracleState":
        """A deep copy (tensors cloned)."""
        cp = lambda d: {i: t.clone() for i, t in d.items()}  # noqa: E731
        return OracleState(self.position, cp(self.conv), cp(self.ssm), cp(self.k), cp(self.v))


class OracleModel:
    """The truth model. `prefill(tokens, state)` and `decode(token, state)` return logits and a new state."""

    def __init__(self, config: HybridConfig, tensors: dict[str, Tensor], dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None):
        from .checkpoint import check_tensors
        check_tensors(config, tensors)
        self.config, self.dtype = config, dtype
        self.device = torch.device(device if device is not None else "cpu")     # weights, states, logits live here
        self.weights = {k: v.to(self.device).to(dtype) for k, v in tensors.items()}
        self.stream_dtype = residual_dtype(config, dtype)
        # oracle.batched's row-wise GEMMs for this model: stacked over the segments on a GPU (one weight read for all
        # of them), segment by segment on the CPU (each segment bitwise its own forward)
        self.stack_rows = self.device.type == "cuda"

    # ------------------------------------------------------------------------------------------ state
    def new_state(self) -> OracleState:
        """An empty state (position 0, zero conv windows and SSM states, empty KV caches)."""
        return empty_state(self.config, self.dtype, self.device)

    # ---------------------------------------------------------------------------------------- public
    def prefill(self, tokens: list[int], state: OracleState | None = None, scan: str = "chunked",
                return_layers: bool = False):
        """tokens -> (logits [len, vocab], new state) [+ per-layer hidden outputs if return_layers]."""
        if len(tokens) == 0:
            raise ValueError("tokens: empty prompt")
        logits, new_state, layers = self.forward(tokens, state, scan)
        return (logits, new_state, layers) if return_layers else (logits, new_state)

    def decode(self, token: int, state: OracleState, return_layers: bool = False):
        """One token -> (logits [vocab], new state); the SSM advances by ssm_step (the recurrence)."""
        if state is None:
            raise ValueError("state: decode needs a state (use prefill or new_state())")
        logits, new_state, layers = self.forward([token], state, scan="recurrence")
        return (logits[0], new_state, layers) if return_layers else (logits[0], new_state)

    # ---------------------------------------------------------------------------------------- forward
    def forward(self, tokens: list[int], state: OracleState | None, scan: str) -> tuple[Tensor, OracleState, list]:
        """The whole model over `tokens` continuing from `state`; returns (logits, new state, layer outputs)."""
        c, w = self.config, self.weights
        ids = token_ids(tokens)
        bad = [int(t) for t in ids if not 0 <= int(t) < c.vocab_size]
        if bad:
            raise ValueError(f"tokens: ids {bad[:5]} out of range for vocab_size={c.vocab_size}")
        old = state if state is not None else self.new_state()
        new = OracleState(position=old.position)
        ids = ids.to(self.device)
        positions = torch.arange(old.position, old.position + len(ids), device=self.device)

        h = embed(c, w, ids, self.stream_dtype)
        layer_outputs = []
        for i in range(c.num_layers):
            h = layer_forward(c, w, i, h, old, new, positions, scan, self.dtype)
            layer_outputs.append(h.clone())
        logits = lm_head(c, w, h, self.dtype)
        new.position = old.position + len(ids)
        return logits, new, layer_outputs

    def attention_block(self, p: str, u: Tensor, k_cache: Tensor, v_cache: Tensor,
                        positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """u [L, D] -> (out [L, D], K cache, V cache) with the new tokens appended (keys stored after RoPE)."""
        return attention_block(self.config, self.weights, p, u, k_cache, v_cache, positions)

    # ---------------------------------------------------------------------------------------- helpers
    def generate_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Prefill then greedy decode (argmax, lowest index on ties); returns the new tokens."""
        logits, state = self.prefill(prompt)
        out = [int(torch.argmax(logits[-1]))]
        while len(out) < max_new_tokens:
            logits, state = self.decode(out[-1], state)
            out.append(int(torch.argmax(logits)))
        return out


def token_ids(tokens) -> Tensor:
    """A flat sequence of token ids as a long tensor: Python / NumPy ints or an integer tensor only (a float or a
    bool is refused, never truncated to an id); a ValueError naming `tokens` otherwise."""
    import numbers
    if isinstance(tokens, Tensor):
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"tokens: token ids must be integers, got a {tokens.dtype} tensor")
        if tokens.dim() != 1:
            raise ValueError("tokens: expected a flat list of token ids")
        return tokens.to(torch.long).cpu()
    try:
        seq = list(tokens)
    except TypeError:
        raise ValueError(f"tokens: expected a list of token ids, got {type(tokens).__name__}") from None
    for j, t in enumerate(seq):
        if isinstance(t, Tensor) and t.dim() == 0 and not (t.dtype == torch.bool or t.is_floating_point()
                                                            or t.is_complex()):
            continue
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or type(t).__name__ == "bool_":
            raise ValueError(f"tokens[{j}]: token ids must be integers, got {type(t).__name__} {t!r:.40}")
    return torch.as_tensor([int(t) for t in seq], dtype=torch.long)


# ------------------------------------------------------------------------- the layer math, one function each
# Module-level so that the in-memory model and the streamed scorer (oracle.streamed) run the same code:
# `w` holds canonical tensors in the compute dtype, either the whole model or just the layer being run.

def residual_dtype(c: HybridConfig, dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype: fp32 under residual_in_fp32 for a 16-bit model, else the model dtype."""
    return torch.float32 if (c.residual_in_fp32 and dtype in (torch.bfloat16, torch.float16)) else dtype


def empty_state(c: HybridConfig, dtype: torch.dtype, device: torch.device | str | None = None,
                layers: tuple[int, ...] | None = None) -> OracleState:
    """Position 0, zero conv windows and SSM states, empty KV caches (for `layers`, default all)."""
    s, want = OracleState(), set(range(c.num_layers) if layers is None else layers)
    for i in c.mamba_layer_ids:
        if i in want:
            s.conv[i] = torch.zeros(c.conv_dim, c.mamba_d_conv - 1, dtype=dtype, device=device)
            s.ssm[i] = torch.zeros(c.mamba_n_heads, c.mamba_head_dim, c.mamba_d_state, dtype=scan_dtype(dtype),
                                   device=device)
    for i in c.attention_layer_ids:
        if i in want:
            s.k[i] = torch.zeros(0, c.n_kv_heads, c.attn_head_dim, dtype=dtype, device=device)
            s.v[i] = torch.zeros(0, c.n_kv_heads, c.attn_head_dim, dtype=dtype, device=device)
    return s


def embed(c: HybridConfig, w: dict[str, Tensor], ids: Tensor, stream_dtype: torch.dtype) -> Tensor:
    """ids [L] -> the residual stream h [L, D] = embed[ids] * embedding_multiplier."""
    return (w["embed.weight"][ids] * c.embedding_multiplier).to(stream_dtype)


def layer_forward(c: HybridConfig, w: dict[str, Tensor], i: int, h: Tensor, old: OracleState, new: OracleState,
                  positions: Tensor, scan: str, dtype: torch.dtype) -> Tensor:
    """Layer i on the residual stream h [L, D] (mixer then FFN, each pre-normed); writes layer i's state to `new`."""
    p, spec, sd = f"layers.{i}.", c.layers[i], h.dtype
    if spec.mixer is not None:
        u = rms_norm(h.to(dtype), w[p + "mixer_norm.weight"], c.norm_eps)
        if spec.mixer == "mamba":
            out, new.conv[i], new.ssm[i] = mamba2_mixer(c, w, p + "mamba.", u, old.conv[i], old.ssm[i],
                                                        old.position, scan)
        else:
            out, new.k[i], new.v[i] = attention_block(c, w, p + "attn.", u, old.k[i], old.v[i], positions)
        h = h + (out * c.residual_multiplier).to(sd)
    if spec.ffn is not None:
        u = rms_norm(h.to(dtype), w[p + "ffn_norm.weight"], c.norm_eps)
        out = mlp(u, w, p + "mlp.", c.mlp_act) if spec.ffn == "mlp" else moe(u, c, w, p + "moe.")
        h = h + (out * c.residual_multiplier).to(sd)
    return h


def lm_head(c: HybridConfig, w: dict[str, Tensor], h: Tensor, dtype: torch.dtype) -> Tensor:
    """The residual stream h [L, D] -> logits [L, vocab] = lm_head(rms_norm(h)) / logits_scaling."""
    h = rms_norm(h.to(dtype), w["final_norm.weight"], c.norm_eps)
    return linear(h, w["lm_head.weight"]) / c.logits_scaling


def attention_block(c: HybridConfig, w: dict[str, Tensor], p: str, u: Tensor, k_cache: Tensor, v_cache: Tensor,
                    positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """u [L, D] -> (out [L, D], K cache, V cache) with the new tokens appended (keys stored after RoPE)."""
    qkv = [linear(u, w[p + f"{n}_proj.weight"], w.get(p + f"{n}_proj.bias")) for n in "qkv"]
    o, k_all, v_all = attention_sequence(c, *qkv, k_cache, v_cache, positions)
    out = linear(o, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))
    return out, k_all, v_all


def attention_sequence(c: HybridConfig, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                       positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Attention between its projections, the part that reads one sequence's keys: q [L, Hq*d], k and v
    [L, Hkv*d] -> (o [L, Hq*d], K cache, V cache) with the new tokens appended (keys stored after RoPE)."""
    L = q.shape[0]
    q = q.view(L, c.n_attn_heads, c.attn_head_dim)
    k, v = k.view(L, c.n_kv_heads, c.attn_head_dim), v.view(L, c.n_kv_heads, c.attn_head_dim)
    q, k = rope(q, positions, c.rope_dim, c.rope_theta), rope(k, positions, c.rope_dim, c.rope_theta)
    k_all, v_all = torch.cat([k_cache, k]), torch.cat([v_cache, v])
    k_positions = torch.arange(k_all.shape[0], device=positions.device)
    o = attention(q, k_all, v_all, positions, k_positions, c.attn_scale)
    return o.reshape(L, c.n_attn_heads * c.attn_head_dim), k_all, v_all
