"""The oracle's two scan forms agree, and its per-request state makes every split of a sequence equivalent.

All in float64 with tolerance 1e-10: recurrence vs chunked SSD (random lengths, not multiples of the chunk,
nonzero initial state, continuation pieces starting mid-chunk), prefill-then-decode vs token-by-token,
and chunked prefill (arbitrary piece boundaries) vs one prefill.
"""
from __future__ import annotations

import random

import pytest
import torch

from oracle.config import HybridConfig
from oracle.mamba2 import mamba2_mixer
from oracle.zoo import build, random_weights, tiny_config

ARCHS = ["bamba", "nemotron_h", "mamba2", "granitemoehybrid"]
TOL = 1e-10


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(vocab), k=n)


@pytest.fixture(scope="module")
def models():
    return {arch: build(arch, seed=7, dtype=torch.float64) for arch in ARCHS}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("seed", range(6))
def test_mixer_recurrence_equals_chunked_ssd_with_nonzero_state(seed):
    """One Mamba2 mixer: scan='recurrence' == scan='chunked' (fp64), random length/start, nonzero h0 and window."""
    rng = random.Random(seed)
    cfg: HybridConfig = tiny_config("bamba", mamba_n_groups=rng.choice([1, 2, 4]), chunk_size=rng.choice([4, 8]))
    w = {k: v.double() for k, v in random_weights(cfg, seed=seed).items()}
    g = torch.Generator().manual_seed(seed)
    L = rng.randint(1, 5 * cfg.chunk_size + 3)
    while L % cfg.chunk_size == 0:
        L += 1
    start = rng.randint(0, 3 * cfg.chunk_size)
    u = torch.randn(L, cfg.hidden_size, generator=g, dtype=torch.float64)
    window = torch.randn(cfg.conv_dim, cfg.mamba_d_conv - 1, generator=g, dtype=torch.float64)
    h0 = torch.randn(cfg.mamba_n_heads, cfg.mamba_head_dim, cfg.mamba_d_state, generator=g, dtype=torch.float64)
    p = "layers.0.mamba."
    y_r, win_r, h_r = mamba2_mixer(cfg, w, p, u, window, h0, start, scan="recurrence")
    y_c, win_c, h_c = mamba2_mixer(cfg, w, p, u, window, h0, start, scan="chunked")
    assert torch.equal(win_r, win_c)
    assert _max_diff(y_r, y_c) <= TOL * max(1.0, y_r.abs().max().item())
    assert _max_diff(h_r, h_c) <= TOL * max(1.0, h_r.abs().max().item())
    assert h0.abs().max() > 0 and _max_diff(h_r, h0) > 1e-3     # the state really moved


@pytest.mark.parametrize("arch", ARCHS)
def test_model_recurrence_equals_chunked_prefill(models, arch):
    """Whole model, continuation prefill (nonzero state, mid-chunk start): recurrence == chunked SSD (fp64)."""
    m = models[arch]
    first = _tokens(5, m.config.vocab_size, seed=1)                  # leaves position 5: mid-chunk
    rest = _tokens(29, m.config.vocab_size, seed=2)                  # 29: not a multiple of chunk 8
    _, state = m.prefill(first)
    a, sa = m.prefill(rest, state, scan="recurrence")
    b, sb = m.prefill(rest, state, scan="chunked")
    assert _max_diff(a, b) <= TOL
    for i in sa.ssm:
        assert _max_diff(sa.ssm[i], sb.ssm[i]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_prefill", [1, 8, 13])
def test_prefill_then_decode_equals_token_by_token(models, arch, n_prefill):
    """prefill(N) then decode the rest == decode every token from an empty state (fp64, <= 1e-10)."""
    m = models[arch]
    tokens = _tokens(24, m.config.vocab_size, seed=n_prefill)
    state, by_token = m.new_state(), []
    for t in tokens:
        logits, state = m.decode(t, state)
        by_token.append(logits)
    logits, s2 = m.prefill(tokens[:n_prefill])
    mixed = list(logits)
    for t in tokens[n_prefill:]:
        logits, s2 = m.decode(t, s2)
        mixed.append(logits)
    assert s2.position == state.position == len(tokens)
    assert _max_diff(torch.stack(mixed), torch.stack(by_token)) <= TOL
    for i in state.ssm:
        assert _max_diff(state.ssm[i], s2.ssm[i]) <= TOL
        assert _max_diff(state.conv[i], s2.conv[i]) <= TOL
    for i in state.k:
        assert _max_diff(state.k[i], s2.k[i]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_pieces_equal_one_prefill(models, arch):
    """Prefill split at arbitrary boundaries (continuing from the returned state) == one prefill (fp64)."""
    m = models[arch]
    tokens = _tokens(37, m.config.vocab_size, seed=3)
    whole, s_whole = m.prefill(tokens)
    pieces, state, lo = [], None, 0
    for hi in (3, 11, 16, 30, 37):
        logits, state = m.prefill(tokens[lo:hi], state)
        pieces.append(logits)
        lo = hi
    assert _max_diff(torch.cat(pieces), whole) <= TOL
    assert state.position == s_whole.position == 37


def test_prefill_does_not_mutate_the_state_it_continues_from(models):
    """prefill/decode return a new state; the one passed in is unchanged (so a caller may branch from it)."""
    m = models["bamba"]
    _, state = m.prefill(_tokens(6, m.config.vocab_size, seed=4))
    snapshot = state.clone()
    m.prefill([1, 2, 3], state)
    m.decode(5, state)
    assert state.position == snapshot.position
    for d_old, d_new in ((snapshot.ssm, state.ssm), (snapshot.conv, state.conv), (snapshot.k, state.k)):
        for i in d_old:
            assert torch.equal(d_old[i], d_new[i])


def test_return_layers_gives_one_hidden_per_layer_ending_in_the_logits(models):
    """prefill(return_layers=True): one output per layer; the last one, normed and projected, gives the logits."""
    from oracle.gated_norm import rms_norm
    m = models["nemotron_h"]
    tokens = _tokens(10, m.config.vocab_size, seed=6)
    logits, _, layers = m.prefill(tokens, return_layers=True)
    assert len(layers) == m.config.num_layers and all(h.shape == (10, m.config.hidden_size) for h in layers)
    w = m.weights
    again = rms_norm(layers[-1], w["final_norm.weight"], m.config.norm_eps) @ w["lm_head.weight"].T
    assert _max_diff(again / m.config.logits_scaling, logits) <= TOL
    assert all(_max_diff(a, b) > 0 for a, b in zip(layers, layers[1:]))


def test_model_rejects_bad_tokens_and_empty_prompt(models):
    """Out-of-range token ids and an empty prompt raise a ValueError naming `tokens`."""
    m = models["mamba2"]
    with pytest.raises(ValueError, match="tokens"):
        m.prefill([])
    with pytest.raises(ValueError, match="tokens.*out of range"):
        m.prefill([1, m.config.vocab_size])
    with pytest.raises(ValueError, match="tokens.*out of range"):
        m.decode(-1, m.new_state())


@pytest.mark.parametrize("arch", ARCHS)
def test_low_precision_models_run_and_stay_near_fp64(arch):
    """fp32 and bf16 (emulation) models: logits in the model dtype, fp32 SSM state, close to the fp64 truth."""
    tokens = _tokens(9, 96, seed=8)
    truth, _ = build(arch, seed=7, dtype=torch.float64).prefill(tokens)
    scale = truth.abs().max().item()
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        m = build(arch, seed=7, dtype=dtype)
        logits, state = m.prefill(tokens)
        step, state = m.decode(tokens[0], state)
        assert logits.dtype == step.dtype == dtype
        assert all(s.dtype == torch.float32 for s in state.ssm.values())
        assert _max_diff(logits.double(), truth) <= rel * scale, dtype


def test_import_oracle_exposes_trace_entry_points_lazily():
    """`import oracle` does not import oracle.trace / oracle.scheduler; the attributes resolve on first use."""
    import subprocess
    import sys
    code = ("import sys, oracle; assert 'oracle.trace' not in sys.modules and 'oracle.scheduler' not in sys.modules;"
            "assert callable(oracle.load_trace) and callable(oracle.run_trace)")
    subprocess.run([sys.executable, "-c", code], check=True)
