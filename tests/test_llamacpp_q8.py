"""q8_0 judged with its own measured constants (adapter.Q8_0, a MeasuredPrecision; measured by
`python -m hybridqual.adapters.llamacpp.measure_tau`, docs/findings.md "q8_0"): the q8_0 GGUF qualifies with them,
and float32's constants would call the same correct run a failure."""
from __future__ import annotations

import torch
import pytest

from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp.adapter import Q8_0, LlamaCppQ8Adapter
from hybridqual.qualify.compare import LOGITS_C, MEASURED_ERR, TAU, TOP_K, tau_for, tie_bound, top_k_for
from hybridqual.qualify.checks import dtype_name

TRACES = ["seed_compaction", "task_staggered", "piece_chunk", "prefix_eviction"]    # each has a q8_0 flip


class Q8JudgedAsFloat32(LlamaCppQ8Adapter):
    """The q8_0 GGUF declared as float32 compute: what judging it with f32's τ and c would say."""

    @classmethod
    def capabilities(cls, device: str, options=None):
        import dataclasses
        return dataclasses.replace(super().capabilities(device), compute_dtype=torch.float32)


def test_the_q8_0_constants_reach_every_judging_rule():
    assert LlamaCppQ8Adapter.capabilities("cpu").compute_dtype is Q8_0
    assert (tau_for(Q8_0), LOGITS_C[Q8_0], top_k_for(Q8_0), MEASURED_ERR.get(Q8_0)) == \
        (Q8_0.tau, Q8_0.logits_c, Q8_0.top_k, Q8_0.measured_err)
    assert Q8_0.tau >= 2 * Q8_0.measured_err                     # a flip needs a gap <= 2x the error
    assert tie_bound(100, Q8_0, Q8_0.tau) > tie_bound(100, torch.float32, TAU[torch.float32])
    assert dtype_name(Q8_0) == "q8_0" and TOP_K.get(object()) is None
    with pytest.raises(KeyError):
        TAU[object()]


def _q(engine: str, tmp_path):
    from test_llamacpp_prefix_cache import _qualify
    return _qualify(engine, "zoo-granitemoehybrid", tmp_path, TRACES)


@pytest.mark.llamacpp
@pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))
def test_q8_0_qualifies_with_its_measured_constants_and_fails_with_float32s(tmp_path):
    rc, checks = _q("hybridqual.adapters.llamacpp.adapter:LlamaCppQ8Adapter", tmp_path / "q8")
    assert rc == 0 and len(checks) == len(TRACES)
    for trace, lines in checks.items():
        tokens = lines["legacy: tokens match the truth"]
        assert tokens["status"] == "PASS" and "near tie" in tokens["detail"], (trace, tokens["detail"])
        assert lines["legacy: logits match the oracle's"]["status"] == "PASS", trace
    rc, checks = _q("tests.test_llamacpp_q8:Q8JudgedAsFloat32", tmp_path / "f32")
    assert rc == 1
    for trace, lines in checks.items():
        assert lines["legacy: logits match the oracle's"]["status"] == "FAIL", trace
    failed = [t for t, lines in checks.items() if lines["legacy: tokens match the truth"]["status"] == "FAIL"]
    assert len(failed) >= 3, failed          # the flips across gaps of 2e-3..2.8e-2 exceed f32's τ = 1e-3
