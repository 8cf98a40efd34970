"""Speculation under tensor parallelism (TP=2, two gloo processes, plain-torch kernel stand-ins): with pad_decode
(the graphs' bucket shapes, so ngram and draft take device drafts in the decode loop) every speculative corpus
trace gives the same tokens as the same trace without speculation, on both ranks; TP=2's schedule log == TP=1's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from fastpath.tp import load_spec_model, run_tp_cpu  # noqa: E402
from oracle.model import OracleModel  # noqa: E402
from oracle.trace import dump_trace, load_trace  # noqa: E402
from tests.test_tp import _assert_near_ties  # noqa: E402
from hybridqual.qualify.spec_checks import without_speculation  # noqa: E402

ROOT = Path(__file__).parent.parent
SPEC = ["spec_ngram", "spec_draft", "spec_scripted"]
TRAINED = {"path": str(ROOT / "goldens" / "models" / "tiny-sort")}
ZOO_BAMBA = {"zoo": "bamba", "seed": 3, "pattern": "M*", "hidden_size": 16, "mamba_n_heads": 4,
             "mamba_n_groups": 2, "n_attn_heads": 4, "n_kv_heads": 2}


def _model_for(trace) -> dict:
    """The model test_tp.py runs this trace on (vocab-16 traces: the trained model; wider: a zoo Bamba)."""
    top = max(max(r.prompt + r.stop_token_ids) for r in trace.requests)
    return TRAINED if top < 16 else ZOO_BAMBA


def _tokens_agree(spec: dict, got: dict, want: dict, trace) -> None:
    """got == want, or every differing greedy request is a near tie of the fp64 oracle (never a seeded one)."""
    if got != want:
        cfg, tensors = load_spec_model(spec)
        _assert_near_ties(OracleModel(cfg, tensors, dtype=torch.float64), trace, got, want)


@pytest.mark.tp
def test_tp2_speculative_equals_non_speculative_and_tp1_logs(tmp_path):
    """One gloo job per model: each speculative trace and its copy without engine.speculative, legacy and async."""
    by_model: dict[str, list[tuple[str, Path, Path]]] = {}
    for name in SPEC:
        path = ROOT / "goldens" / "traces" / f"{name}.json"
        trace = load_trace(path)
        plain = tmp_path / f"{name}_plain.json"
        plain.write_text(dump_trace(without_speculation(trace)))
        by_model.setdefault(json.dumps(_model_for(trace), sort_keys=True), []).append((name, path, plain))
    for key, items in by_model.items():
        spec = json.loads(key)
        paths = [str(p) for _, s, pl in items for p in (s, pl)]
        job = {"model": spec, "traces": paths, "modes": ["legacy", "async"], "backend": "torch", "pad_decode": True,
               "device_drafts": True}
        ranks = run_tp_cpu(job, 2, str(tmp_path / ("trained" if "path" in spec else "zoo")))
        assert ranks[0] == ranks[1], "TP ranks disagree (tokens or schedule logs)"
        cfg, tensors = load_spec_model(spec)
        fast = FastModel(cfg, tensors, "cpu", torch.float32, FastOptions(backend="torch", spec_device_drafts=True))
        for name, s, pl in items:
            trace = load_trace(s)
            eng = Engine(fast, trace.engine, max_len=max(len(r.prompt) + r.max_new_tokens for r in trace.requests),
                         pad_decode=True)
            for mode in ("legacy", "async"):
                got, plain = ranks[0][str(s)][mode], ranks[0][str(pl)][mode]
                if trace.engine.speculative.proposer.kind != "scripted":
                    assert got["device_draft_steps"] > 0, f"{name}/{mode}: no device-draft step under TP"
                _tokens_agree(spec, got["tokens"], plain["tokens"], trace)
                tp1 = eng.run_trace(trace, mode)
                if tp1.tokens == got["tokens"]:
                    assert got["log"] == tp1.schedule_log.to_json(), f"{name}/{mode}: TP=2 log differs from TP=1"
                else:
                    _tokens_agree(spec, got["tokens"], tp1.tokens, trace)
