"""The engine's own memory prediction: weights + state bank (+ KV) + the activation peak of its largest step.

The activation term counts the tensors the batched forward holds at once for a step of T packed tokens
(fastpath/model.py), per block type, and takes the largest:

    mamba:      h, u [T,D] · zxbcdt [T,in_proj] · conv out [T,conv_dim] · y [T,d_inner] · SSD scratch
                (dt, dA cumsum [H,T] fp32; C·B [chunks,G,Q,Q] fp32; chunk states [chunks,H,P,N] fp32)
    attention:  h, u · q, k, v, rotated q, k · output · o_proj output · split-key partials (fp32 acc, max, sum
                per query row, head and split of the short pieces: fastpath/kernels/attention.py)
    mlp:        h, u · gate_up [T,2F] · act(gate) [T,F] · act·up [T,F]
    residual:   old h, u, block output, new h

Logits are [S, V] for the sequences' last tokens only; a speculative verify step has R*(k+1) tokens with logits
at every one (verify_activation_bytes), and speculation allocates scratch with the engine (spec_bytes: rollback
snapshots or replay log, verify buffers, device drafts, the draft model's bank and weights). Allocator rounding
and cuBLAS workspaces are small next to these and left out; the bench prints prediction and measured peak side by
side.
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
        from fastpath.kernels.attention import SPLIT_MAX_QUERIES, SPLIT_MAX_SPLITS
        q, kv = c.n_attn_heads * c.attn_head_dim, c.n_kv_heads * c.attn_head_dim
        split = min(T, sequences * SPLIT_MAX_QUERIES) * SPLIT_MAX_SPLITS * c.n_attn_heads * (c.attn_head_dim + 2) * 4
        peaks.append(T * (2 * D + 2 * q + 4 * kv + q + D) * e + split)
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
    the token budget; with speculation at least a verify step of R*(k+1) tokens with logits at every token),
    speculation's scratch (spec_bytes: rollback snapshots or replay log, verify buffers, device drafts, the draft
    model), and their total."""
    T = step_tokens or engine.ec.max_tokens_per_step
    out = {"weights": weight_bytes(engine.model), "bank": engine.bank.nbytes(),
           "activations": activation_bytes(engine.config, T, engine.model.dtype)}
    if engine.ec.speculative is not None:
        sp = engine.spec
        parts = spec_bytes(engine.config, engine.ec, engine.bank.max_len, engine.model.dtype,
                           replay=sp.runner.replaying, padded=sp.runner.padded,
                           device_drafts=sp.device_drafts is not None, draft=sp.draft.model.config if sp.draft is not None else None)
        graphed = sp.draft.model.config if sp.draft is not None and sp.draft.graphs is not None else None
        out["activations"] = max(out["activations"], verify_activation_bytes(engine.config, engine.ec,
                                                                                engine.model.dtype, graphed))
        out["speculative"] = sum(parts.values())
    out["total"] = sum(out.values())
    return out


def _state_elems(c) -> int:
    """Conv window + SSM state elements of one slot in one Mamba layer."""
    return c.conv_dim * (c.mamba_d_conv - 1) + c.mamba_n_heads * c.mamba_head_dim * c.mamba_d_state


def verify_activation_bytes(config, ec, dtype: torch.dtype, draft=None) -> int:
    """Activations of the largest verify step: R*(k+1) tokens, logits at every one; with `draft` (its HybridConfig,
    decode graphs on) at least the draft's widest catch-up forward: R*W tokens, logits at the last position of each
    row (fastpath/engine/catch_up.py)."""
    from .draft import catch_up_width
    sp, R = ec.speculative, ec.max_requests
    T = R * (sp.k + 1)
    out = activation_bytes(config, T, dtype, sequences=T)
    if draft is not None:
        out = max(out, activation_bytes(draft, R * catch_up_width(sp.k, sp.backoff, R), dtype, sequences=R))
    return out


def spec_bytes(config, ec, max_len: int, dtype: torch.dtype, replay: bool = False, padded: bool = False,
               draft=None, device_drafts: bool = False) -> dict[str, int]:
    """Device bytes speculation (ec.speculative) allocates with the engine, computed, not allocated:
    rollback (PositionSnapshots [n_mamba, k, R, ...] fp32, or with replay the InputLog: R slots' state + xBC, dt at
    R*(k+1) tokens in `dtype`), verify_buffers (the tokens buffer + every (rows, width) shape's metadata and tokens:
    the buckets when padded, else every rows x width), device_drafts (padded with ngram/draft and FastOptions.spec_device_drafts: the token history
    [R, max_len] (ngram) or the drafts buffer [R, k] (draft), + the result buffer), draft_bank and draft_weights
    (draft: its HybridConfig; bank of max_len + k positions, its snapshot of R slots, its weights in `dtype`; its
    graphs' small buffers not counted)."""
    from .graphs import buckets
    from .verify import width_buckets
    sp, R, c = ec.speculative, ec.max_requests, config
    k, n_m, e = sp.k, len(c.mamba_layer_ids), _elem(dtype)
    if replay:
        rollback = n_m * R * _state_elems(c) * 4 + n_m * (k + 1) * R * (c.conv_dim + c.mamba_n_heads) * e
    else:
        rollback = n_m * k * R * _state_elems(c) * 4
    shapes = ([(nb, w) for nb in buckets(R) for w in width_buckets(k)] if padded else
              [(nb, w) for nb in range(1, R + 1) for w in range(2, k + 2)])
    out = {"rollback": rollback, "verify_buffers": 8 * (R * (k + 1) + sum(4 * nb * w + nb for nb, w in shapes))}
    kind = sp.proposer.kind
    if padded and device_drafts and kind in ("ngram", "draft"):
        out["device_drafts"] = 8 * ((R * max_len if kind == "ngram" else R * k) + R * (k + 1) + R * k + R)
    if draft is not None:
        from oracle.checkpoint import expected_shapes
        out["draft_bank"] = bank_bytes(draft, R, max_len + k, dtype) + len(draft.mamba_layer_ids) * R * \
            _state_elems(draft) * 4
        shapes = expected_shapes(draft)
        if draft.tie_word_embeddings:                  # lm_head is the embedding: held once
            shapes.pop("lm_head.weight", None)
        out["draft_weights"] = sum(math.prod(s) for s in shapes.values()) * e
    return out


def bank_bytes(config, max_requests: int, max_len: int, kv_dtype: torch.dtype,
               state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes StateBank(config, max_requests, max_len, kv_dtype=kv_dtype) will allocate (computed, not allocated)."""
    c, R = config, max_requests
    n_m, n_a = len(c.mamba_layer_ids), len(c.attention_layer_ids)
    es, ek = _elem(state_dtype), _elem(kv_dtype)
    state = n_m * R * (c.conv_dim * (c.mamba_d_conv - 1) + c.mamba_n_heads * c.mamba_head_dim * c.mamba_d_state)
    kv = 2 * n_a * R * max_len * c.n_kv_heads * c.attn_head_dim
    return state * es + kv * ek


def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _cgroup_free() -> int | None:
    """Bytes left under this process's cgroup (v2) memory limit, if it has one."""
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def available_bytes(device: torch.device) -> int | None:
    """Memory the engine can still allocate on `device`: CUDA free + what the caching allocator holds unused; CPU:
    MemAvailable (capped by a cgroup limit). None when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cg = _cgroup_free()
    if cg is not None:
        avail = cg if avail is None else min(avail, cg)
    return avail


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.3g} GiB"


def check_fits(config, ec, max_len: int, dtype: torch.dtype, device: torch.device, replay: bool = False,
               padded: bool = False, device_drafts: bool = False) -> None:
    """Raise a MemoryError naming max_requests / max_len / the token budget when the bank (+KV) and the activation
    peak of the largest step would not fit what `device` has free, or naming engine_config.speculative.k when
    those fit but not with speculation's scratch (spec_bytes; replay / padded: FastOptions.spec_replay, graphs or
    pad_decode); checked before anything is allocated."""
    pool = ec.prefix_cache.capacity if getattr(ec, "prefix_cache", None) is not None else 0   # checkpoint slots
    bank = bank_bytes(config, ec.max_requests + pool, max_len, dtype)
    # no step holds more tokens: every row's piece is <= prefill_chunk, and <= max_len (a longer prompt cannot fit KV)
    tokens = min(ec.max_tokens_per_step, ec.max_requests * min(ec.prefill_chunk, max_len))
    act = activation_bytes(config, tokens, dtype, sequences=min(ec.max_requests, tokens))
    have = available_bytes(device)
    if getattr(ec, "speculative", None) is not None and have is not None:
        _check_spec_fits(config, ec, max_len, dtype, device, replay, padded, bank, act, have, device_drafts)
    if have is not None and bank + act > have:
        raise MemoryError(
            f"engine_config/max_len: the state bank + KV ({_gib(bank)} for max_requests={ec.max_requests}, "
            f"max_len={max_len}) and the activations of a {tokens}-token step ({_gib(act)}) need "
            f"{_gib(bank + act)}, but {device} has {_gib(have)} free; lower max_requests, max_len or "
            f"max_tokens_per_step")


def _check_spec_fits(config, ec, max_len: int, dtype, device, replay: bool, padded: bool, bank: int, act: int,
                     have: int, device_drafts: bool = False) -> None:
    """check_fits' speculative part: bank + activations fit, the verify step's activations and the scratch do not."""
    if bank + act > have:
        return                                       # the bank / budget error below names its own fields
    draft = None
    if ec.speculative.proposer.kind == "draft":
        from oracle.config import from_hf_config
        from oracle.speculative import model_path
        draft = from_hf_config(model_path(ec.speculative))
    parts = spec_bytes(config, ec, max_len, dtype, replay, padded, draft, device_drafts)
    v_act = verify_activation_bytes(config, ec, dtype, draft if padded else None)
    need = bank + max(act, v_act) + sum(parts.values())
    if need > have:
        what = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
        raise MemoryError(
            f"engine_config.speculative.k: speculation with k={ec.speculative.k} (max_requests={ec.max_requests}, "
            f"max_len={max_len}) needs {_gib(sum(parts.values()))} of scratch ({what}) and a verify step's "
            f"activations ({_gib(v_act)}) beside the bank + KV ({_gib(bank)}) and step activations ({_gib(act)}): "
            f"{_gib(need)} in all, but {device} has {_gib(have)} free; lower engine_config.speculative.k, "
            f"max_requests or max_len")


def check_weights_fit(tensors: dict, dtype: torch.dtype, device: torch.device) -> None:
    """Raise a MemoryError before copying a checkpoint of this size in `dtype` to `device` if it cannot fit."""
    need = sum(t.numel() * (4 if t.dtype == torch.float32 and t.dim() <= 1 else _elem(dtype))
               for t in tensors.values())
    have = available_bytes(device)
    if device.type == "cuda" and have is not None and need > have:
        raise MemoryError(f"path: the weights need {_gib(need)} on {device} in {dtype}, which has {_gib(have)} free")
