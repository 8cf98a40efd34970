"""The bs1 decode path with small kernels folded into the one-row GEMV (act·mul, the conv step, the RMSNorms and
residual adds) runs the same model: run on CPU through the interpreter (`FastOptions.gemv_on_cpu`), every logits
row of a bs1 trace tracks the plain path, the act and conv folds are bitwise, the recurrent state ends equal, and
the folded step really launches no norm kernel but the final one."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.batch_invariant import run_recording_logits  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

SMALL = dict(pattern="M*M", hidden_size=32, mamba_n_heads=4, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
FOLDS = ("fold_act", "fold_conv", "fold_norm")


def _run(cfg, w, mode: str, row_gemv: bool, **folds):
    """(tokens, logits rows, final ssm bank) of one bs1 request (prompt 5, 6 new tokens) under the given flags."""
    options = FastOptions(gemv_on_cpu=row_gemv, **{f: folds.get(f, True) for f in FOLDS})
    model = FastModel(cfg, w, "cpu", torch.float32, options)
    trace = Trace(EngineConfig(1, 16, 16, mode), (Request("q", 0, (3, 9, 27, 4, 11), 6),))
    eng = Engine(model, trace.engine, max_len=16)
    result, rows = run_recording_logits(eng, trace)
    return result.tokens, rows, eng.bank.ssm_state.clone(), eng.bank.conv_state.clone()


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_folded_row_gemv_tracks_the_plain_path(mode):
    """Every decode logits row within fp32 rounding of the unfolded path without the GEMV; same tokens, state."""
    cfg = zoo.tiny_config("bamba", **SMALL)
    w = zoo.random_weights(cfg, seed=3)
    tok0, rows0, ssm0, conv0 = _run(cfg, w, mode, row_gemv=False)
    tok1, rows1, ssm1, conv1 = _run(cfg, w, mode, row_gemv=True)
    assert rows0.keys() == rows1.keys() and len(rows0) == 6
    for k in rows0:
        assert torch.allclose(rows1[k], rows0[k], atol=2e-5, rtol=1e-5), k
    assert tok1 == tok0
    assert torch.allclose(ssm1, ssm0, atol=1e-5) and torch.equal(conv1 != 0, conv0 != 0)
    assert torch.allclose(conv1, conv0, atol=1e-5)


@pytest.mark.parametrize("fold", ["fold_act", "fold_conv"])
def test_act_and_conv_folds_are_bitwise(fold):
    """act·mul in the down GEMV's load and the conv step in in_proj's epilogue keep the unfolded rounding points."""
    cfg = zoo.tiny_config("bamba", **SMALL)
    w = zoo.random_weights(cfg, seed=4)
    tok0, rows0, ssm0, conv0 = _run(cfg, w, "legacy", row_gemv=True, **{fold: False})
    tok1, rows1, ssm1, conv1 = _run(cfg, w, "legacy", row_gemv=True, **{fold: True})
    assert tok1 == tok0
    assert all(torch.equal(rows1[k], rows0[k]) for k in rows0)
    assert torch.equal(ssm1, ssm0) and torch.equal(conv1, conv0)


def test_folded_row_step_launches_only_the_final_norm(monkeypatch):
    """With fold_norm every decode step of a bs1 request takes FastModel._forward_row, and inside it the only
    norm kernel is the final norm (add_rms_norm once, rms_norm_gated never); without it the step does not."""
    import fastpath.model as fm
    from fastpath.engine import ops
    calls = {"add_norm": 0, "gated": 0, "rows": []}
    real_add, real_gated, real_row = fm._add_rms_norm, ops.rms_norm_gated, FastModel._forward_row

    def add(*a, **k):
        calls["add_norm"] += 1
        return real_add(*a, **k)

    def gated(*a, **k):
        calls["gated"] += 1
        return real_gated(*a, **k)

    def row(self, *a):
        before = (calls["add_norm"], calls["gated"])
        out = real_row(self, *a)
        calls["rows"].append((calls["add_norm"] - before[0], calls["gated"] - before[1]))
        return out
    monkeypatch.setattr(fm, "_add_rms_norm", add)
    monkeypatch.setattr(ops, "rms_norm_gated", gated)
    monkeypatch.setattr(FastModel, "_forward_row", row)
    cfg = zoo.tiny_config("bamba", **SMALL)
    w = zoo.random_weights(cfg, seed=5)
    _run(cfg, w, "legacy", row_gemv=True)
    assert len(calls["rows"]) >= 5 and all(c == (1, 0) for c in calls["rows"]), calls["rows"]
    calls["rows"].clear()
    _run(cfg, w, "legacy", row_gemv=True, fold_norm=False)
    assert calls["rows"] == []


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h", "mamba2"])
def test_folded_norm_gains_keep_the_function(arch):
    """fold_gains (W·diag(g) at load, gains set to 1): the batched path's logits track the unfolded model's within
    fp32 rounding on a two-request trace, and the folded norms are exactly the mixer/MLP/gated ones."""
    cfg = zoo.tiny_config(arch)
    w = zoo.random_weights(cfg, seed=6)
    trace = Trace(EngineConfig(2, 16, 16, "legacy"), (Request("a", 0, (3, 9, 27, 4, 11), 4),
                                                     Request("b", 1, (5, 8, 13), 4)))
    rows = []
    for fold in (False, True):
        model = FastModel(cfg, w, "cpu", torch.float32, FastOptions(fold_gains=fold))
        eng = Engine(model, trace.engine, max_len=16)
        result, r = run_recording_logits(eng, trace)
        rows.append((result.tokens, r, model))
    (tok0, r0, m0), (tok1, r1, m1) = rows
    assert tok1 == tok0 and r0.keys() == r1.keys()
    for k in r0:
        assert torch.allclose(r1[k], r0[k], atol=2e-5, rtol=1e-5), k
    assert m0.gains_folded == set() and "final_norm.weight" not in m1.gains_folded
    for i, spec in enumerate(cfg.layers):
        p = f"layers.{i}."
        want = {p + "mixer_norm.weight"} if spec.mixer else set()
        want |= {p + "mamba.norm.weight"} if spec.mixer == "mamba" else set()
        want |= {p + "ffn_norm.weight"} if spec.ffn == "mlp" else set()
        assert {n for n in m1.gains_folded if n.startswith(p)} == want, i
        assert all(torch.equal(m1.w[n], torch.ones_like(m1.w[n])) for n in want)
        assert all(not torch.equal(m0.w[n], torch.ones_like(m0.w[n])) for n in want)


def test_folded_row_step_on_the_dense_granite_follows_the_oracle(monkeypatch):
    """The shipped zoo-granite_dense (every FFN a dense MLP, residual multiplier 0.7, hidden 48, rms eps 0.05) is
    the model on which the folded one-row step meets a residual multiplier, a row narrower than its GEMV tile (48 in
    64) and an eps that matters: every decode step takes _forward_row, the RMS and residual folds run with those
    values, and every logits row of a bs1 request is within the fp32 logits bound of the fp64 oracle's."""
    import fastpath.model as fm
    import oracle
    from hybridqual.paths import MODELS
    from hybridqual.qualify.compare import LOGITS_C, logit_scale, teacher_forced_logits
    folder = MODELS / "zoo-granite_dense"
    seen = {"rows": 0, "rms_k": set(), "mult": set()}
    real_gemv, real_row = fm._gemv, FastModel._forward_row

    def gemv(x, w, b=None, **k):
        if k.get("rms_eps") is not None:
            seen["rms_k"].add(w.shape[1])
        if k.get("residual") is not None:
            seen["mult"].add(k["residual"].multiplier)
        return real_gemv(x, w, b, **k)

    def row(self, *a):
        seen["rows"] += 1
        return real_row(self, *a)
    monkeypatch.setattr(fm, "_gemv", gemv)
    monkeypatch.setattr(FastModel, "_forward_row", row)
    prompt = (3, 9, 27, 4, 11, 40, 7, 55, 13)
    trace = Trace(EngineConfig(1, 16, 8, "legacy"), (Request("q", 0, prompt, 8),))
    eng = Engine.from_pretrained(folder, trace.engine, device="cpu", max_len=32,
                                 options=FastOptions(gemv_on_cpu=True))
    result, rows = run_recording_logits(eng, trace)
    assert seen == {"rows": 7, "rms_k": {48}, "mult": {0.7}}, seen
    model = oracle.load(folder)
    toks = result.tokens["q"]
    assert toks == oracle.run_trace(model, trace, mode="legacy").tokens["q"]
    want = teacher_forced_logits(model, prompt, toks)
    assert len(rows) == len(toks) == 8
    for (_, key), got in rows.items():
        ref = want[key - len(prompt)]
        assert (got.double() - ref).abs().max().item() <= LOGITS_C[torch.float32] * logit_scale(ref), key
