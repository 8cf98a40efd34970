"""The bs1 decode path with small kernels folded into the one-row GEMV (act·mul, the conv step) runs the same
model: run on CPU through the interpreter (`FastModel.gemv_on_cpu`), every logits row of a bs1 trace
tracks the plain path, the act and conv folds are bitwise, and the recurrent state ends equal."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.batch_invariant import run_recording_logits  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

SMALL = dict(pattern="M*M", hidden_size=32, mamba_n_heads=4, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
FOLDS = ("fold_act", "fold_conv")


def _run(cfg, w, mode: str, row_gemv: bool, **folds):
    """(tokens, logits rows, final ssm bank) of one bs1 request (prompt 5, 6 new tokens) under the given flags."""
    model = FastModel(cfg, w, "cpu", torch.float32)
    model.gemv_on_cpu = row_gemv
    for f in FOLDS:
        setattr(model, f, folds.get(f, True))
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
