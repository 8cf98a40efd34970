"""Judging constants for a reduced-precision recurrent state (DESIGN §20), measured as q8_0's were.

An engine that keeps its SSM state (and conv window) in float16 or bfloat16 while computing in fp32 declares it
(`Capabilities.state_dtype`) and is judged with these constants (`Capabilities.compute_dtype` = the
MeasuredPrecision), never with fp32's, which the rounding of the state exceeds 16-115×, and never with bf16
compute's τ 1.25, which would forgive far more than this drift. Measured with the fast path's state bank in that
dtype (FastOptions.state_dtype, the torch kernels), fp32 compute, on CPU against the fp64 oracle, every shipped
model × chunked_prefill, seed_compaction, async_drain, prefix_multi_turn, spec_accept, stop_tokens:

    python -m hybridqual.measure_tau --device cpu --state-dtype float16 --trace chunked_prefill seed_compaction \\
        async_drain prefix_multi_turn spec_accept stop_tokens
      float16 state, 1001 positions: |Δlogit| max 1.561e-02 (zoo-mamba2), p99 5.141e-03, p50 2.463e-04;
                                     scaled max 3.147e-03 (zoo-bamba), p99 1.281e-03, p50 2.256e-04
      bfloat16 state, 1115 positions: |Δlogit| max 6.125e-02, p99 3.588e-02, p50 1.957e-03;
                                      scaled max 2.307e-02, p99 9.831e-03, p50 1.883e-03

τ and c are 2.5× (compare.TAU_MIN_RATIO for a reduced precision) the largest absolute and scaled errors, rounded
up; top_k stays fp32's 5 (τ is small enough that rounding cannot reach past the first few tokens).
"""
from __future__ import annotations

import dataclasses

from hybridqual.adapters.base import Capabilities, MeasuredPrecision

STATE_PRECISION: dict[str, MeasuredPrecision] = {
    "float16": MeasuredPrecision("fp32 compute, float16 state", tau=0.04, logits_c=8e-3, top_k=5,
                                 measured_err=1.561e-2),
    "bfloat16": MeasuredPrecision("fp32 compute, bfloat16 state", tau=0.16, logits_c=0.06, top_k=5,
                                  measured_err=6.125e-2),
}


def with_state_dtype(caps: Capabilities, state_dtype: str) -> Capabilities:
    """`caps` declaring `state_dtype`: a reduced one brings its measured constants as the compute precision."""
    if state_dtype == "float32":
        return caps
    if state_dtype not in STATE_PRECISION:
        raise ValueError(f"state_dtype: {state_dtype!r} has no measured constants (known: {sorted(STATE_PRECISION)})")
    return dataclasses.replace(caps, state_dtype=state_dtype, compute_dtype=STATE_PRECISION[state_dtype])
