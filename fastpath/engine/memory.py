"""The engine's own memory prediction: weights + state bank (+ KV) + the activation peak of its largest step.

The activation term counts the tensors the batched forward holds at once for a step of T packed tokens
(fastpath/model.py), per block type, and takes the largest:

    mamba:      h, u [T,D] · zxbcdt [T,in_proj] · conv out [T,conv_dim] · y [T,d_inner] · SSD scratch
                (dt, dA cumsum [H,T] fp32; C·B [chunks,G,Q,Q] fp32; chunk states [chunks,H,P,N] fp32)
    attention:  h, u · q, k, v, rotated q, k · output · o_proj output
    mlp:        h, u · gate_up [T,2F] · act(gate) [T,F] · act·up [T,F]
    residual:   old h, u, block output, new h

Logits are [S, V] for the sequences' last tokens only.  Allocator rounding and cuBLAS workspaces are small
next to these and left out; the bench prints prediction and measured peak side by side.
"""
from __future__ import annotations

import math

import torch


def activation_bytes(config, tokens: int, dtype: torch.dtype, sequences: int = 1) -> int:
    """Peak bytes of activations for one forward over `tokens` packed tokens of `sequences` pieces."""
    c, T, e = config, tokens, torch.tensor([], dtype=dtype).element_size()
    D = c.hidden_size
    peaks = [4 * T * D * e]                                                       # residual update
    if c.mamba_layer_ids:
        Q = 1 << max(4, math.ceil(math.log2(c.chunk_size)))
        chunks = math.ceil(T / c.chunk_size) + sequences
        scratch = 2 * c.mamba_n_heads * T * 4 + chunks * c.mamba_n_groups * Q * Q * 4 \
            + chunks * c.mamba_n_heads * c.mamba_head_dim * c.mamba_d_state * 4
        per_tok = 2 * D + c.in_proj_dim + c.conv_dim + c.d_inner
        peaks.append(T * per_tok * e + scratch)                                   # inside the SSD
        peaks.append(T * (per_tok + c.d_inner + D) * e)                           # gated norm + out_proj
    if c.attention_layer_ids:
        q, kv = c.n_attn_heads * c.attn_head_dim, c.n_kv_heads * c.attn_head_dim
        peaks.append(T * (2 * D + 2 * q + 4 * kv + q + D) * e)
    if any(s.ffn == "mlp" for s in c.layers):
        F = c.mlp_intermediate_size
        peaks.append(T * (2 * D + 4 * F) * e)
    return max(peaks) + sequences * c.vocab_size * 4


def weight_bytes(model) -> int:
    """Bytes of the model's tensors (tied tensors counted once)."""
    seen, total = set(), 0
    for t in model.w.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def predict(engine, step_tokens: int | None = None) -> dict[str, int]:
    """Predicted peak device bytes of `engine`: weights, bank, activations of a `step_tokens` step (default:
    the token budget), and their total."""
    T = step_tokens or engine.ec.max_tokens_per_step
    out = {"weights": weight_bytes(engine.model), "bank": engine.bank.nbytes(),
           "activations": activation_bytes(engine.config, T, engine.model.dtype)}
    out["total"] = sum(out.values())
    return out
