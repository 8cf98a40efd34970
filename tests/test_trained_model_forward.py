"""The shipped tiny-sort checkpoint means what training meant.

The training forward (tools/train_tiny.py, batched chunked SSD) on the shipped weights must give the same
logits as (a) a per-sequence fp64 forward composed from the oracle's literal primitives (per-token
recurrence, conv, gated norm, RoPE + attention) reading the tensors by their HF names, (b) `oracle.load`
(the oracle's own checkpoint loader and model), and (c) HF transformers' BambaForCausalLM, when installed
(the external oracle).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import oracle
from oracle.attention import attention, rope
from oracle.conv1d import causal_conv1d
from oracle.gated_norm import rms_norm, rms_norm_gated
from oracle.mamba2 import process_dt
from oracle.ssd import ssm_recurrence
from hybridqual.scenarios import task
from hybridqual.train_tiny import TinyBamba, batch_of

MODEL = Path(__file__).resolve().parents[1] / "goldens" / "models" / "tiny-sort"


def _config() -> dict:
    return json.loads((MODEL / "config.json").read_text())


def _weights() -> dict[str, torch.Tensor]:
    return load_file(str(MODEL / "model.safetensors"))


def primitive_logits(cfg: dict, W: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """fp64 logits [L, V] of one sequence, composed from oracle primitives and HF tensor names."""
    W = {k: v.to(torch.float64) for k, v in W.items()}
    eps, L = cfg["rms_norm_eps"], len(tokens)
    pos = torch.arange(L)
    H, P, G, N = cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_n_groups"], cfg["mamba_d_state"]
    di = H * P
    h = W["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        u = rms_norm(h, W[p + "input_layernorm.weight"], eps)
        if i in cfg["attn_layer_indices"]:
            Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
            d = cfg["hidden_size"] // Hq
            rot = int(d * cfg["rope_parameters"]["partial_rotary_factor"])
            theta = cfg["rope_parameters"]["rope_theta"]
            q = rope((u @ W[p + "self_attn.q_proj.weight"].T).view(L, Hq, d), pos, rot, theta)
            k = rope((u @ W[p + "self_attn.k_proj.weight"].T).view(L, Hkv, d), pos, rot, theta)
            v = (u @ W[p + "self_attn.v_proj.weight"].T).view(L, Hkv, d)
            mix = attention(q, k, v, pos, pos, d ** -0.5).reshape(L, Hq * d) @ W[p + "self_attn.o_proj.weight"].T
        else:
            m = p + "mamba."
            z, xbc, dt = (u @ W[m + "in_proj.weight"].T).split([di, di + 2 * G * N, H], dim=-1)
            xbc = F.silu(causal_conv1d(xbc, W[m + "conv1d.weight"][:, 0], W[m + "conv1d.bias"])[0])
            x, B, C = xbc.split([di, G * N, G * N], dim=-1)
            dt = process_dt(dt, W[m + "dt_bias"], tuple(cfg["time_step_limit"]))
            y, _ = ssm_recurrence(x.view(L, H, P), dt, -torch.exp(W[m + "A_log"]),
                                  B.view(L, G, N), C.view(L, G, N), W[m + "D"])
            y = rms_norm_gated(y.reshape(L, di), z, W[m + "norm.weight"], G, eps)
            mix = y @ W[m + "out_proj.weight"].T
        h = h + mix
        f = rms_norm(h, W[p + "pre_ff_layernorm.weight"], eps)
        ff = p + "feed_forward."
        gated = F.silu(f @ W[ff + "gate_proj.weight"].T) * (f @ W[ff + "up_proj.weight"].T)
        h = h + gated @ W[ff + "down_proj.weight"].T
    return rms_norm(h, W["model.final_layernorm.weight"], eps) @ W["lm_head.weight"].T


def _training_model(dtype: torch.dtype) -> TinyBamba:
    model = TinyBamba(_config())
    model.load_state_dict(_weights(), strict=True)
    return model.to(dtype).eval()


def _sequences(n: int = 2) -> list[task.Example]:
    # Held-out examples of different lengths; the fed sequence is prompt + answer minus its last token.
    return task.heldout(n)


def test_shipped_folder_is_a_small_fp32_bamba_checkpoint():
    cfg = _config()
    assert cfg["model_type"] == "bamba" and cfg["architectures"] == ["BambaForCausalLM"]
    assert len(cfg["attn_layer_indices"]) >= 1 and len(cfg["attn_layer_indices"]) < cfg["num_hidden_layers"]
    assert cfg["mamba_chunk_size"] == 8 and cfg["vocab_size"] == task.VOCAB_SIZE
    path = MODEL / "model.safetensors"
    assert path.stat().st_size <= 8 * 2**20
    assert all(t.dtype == torch.float32 for t in _weights().values())
    report = json.loads((MODEL / "train_report.json").read_text())
    assert report["model_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_training_forward_matches_oracle_primitives_on_shipped_weights():
    model, cfg, W = _training_model(torch.float64), _config(), _weights()
    exs = _sequences()
    ids, _ = batch_of(exs)
    with torch.no_grad():
        batched = model(ids)
    for i, ex in enumerate(exs):
        seq = list(ex.prompt + ex.answer)[:-1]
        ref = primitive_logits(cfg, W, seq)
        torch.testing.assert_close(batched[i, :len(seq)], ref, rtol=0, atol=1e-9)


def test_training_forward_matches_oracle_load_on_shipped_weights():
    om = oracle.load(MODEL, dtype=torch.float64)
    model = _training_model(torch.float64)
    for ex in _sequences():
        seq = list(ex.prompt + ex.answer)[:-1]
        logits, _ = om.prefill(seq)
        with torch.no_grad():
            ours = model(torch.tensor([seq]))[0]
        torch.testing.assert_close(logits.to(torch.float64), ours, rtol=0, atol=1e-9)


def test_hf_bamba_loads_the_folder_and_agrees_with_training_forward():
    transformers = pytest.importorskip("transformers")
    hf = transformers.BambaForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    model = _training_model(torch.float32)
    exs = _sequences()
    ids, _ = batch_of(exs)
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    # n_groups = 1, so HF's grouped (5.24) and ungrouped (<= 5.17) gated norms coincide.
    for i, ex in enumerate(exs):
        n = len(ex.prompt) + len(ex.answer) - 1
        torch.testing.assert_close(theirs[i, :n], ours[i, :n], rtol=0, atol=1e-4,
                                   msg=f"transformers {transformers.__version__}: logits differ")
