"""Goldens for a model whose fp64 weights do not fit in memory (DESIGN §6, §15): the oracle's own generation by
repeated streamed passes.

    record = golden_streamed(StreamedTruth(folder), folder, trace, "name")     # the same record golden_for_trace makes

Slow by design: one streamed pass over every weight (oracle.streamed: one layer in memory at a time) per generated
position, all live requests of the trace batched into each pass, plus one pass for the margins; a trace whose
longest output is n tokens costs n + 1 reads of the checkpoint (anchor-3b: ≈ 5 min per pass on this 2-core CPU,
seconds with --oracle-device cuda). Each request's tokens are its own (DESIGN: never a function of the batch), so
generating them request-alone is the truth for every engine mode; the schedule digests come from the oracle
scheduler replayed with those tokens (hybridqual.qualify.truth.ScheduleOnly: no model math). The record equals the
in-memory oracle's on the zoo models (tests/test_goldens_streamed.py): the sequences' logits differ from
prefill + decode only in the last bits of fp64.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from hybridqual.qualify.truth import ScheduleOnly, StreamedTruth


def generate(truth: StreamedTruth, trace) -> dict[str, list[int]]:
    """Every request's output under the oracle's sampler (greedy or seeded at absolute positions), request-alone:
    one streamed pass per generated position over all requests still generating."""
    from oracle.sampling import sample
    out = {r.id: [] for r in trace.requests}
    live = [r for r in trace.requests if r.max_new_tokens > 0]
    while live:
        logits = truth.so.sequence_logits([list(r.prompt) + out[r.id] for r in live])
        still = []
        for r, lg in zip(live, logits):
            tok = sample(lg[-1].cpu(), r.sampling, len(r.prompt) + len(out[r.id]))
            out[r.id].append(tok)
            if tok not in r.stop_token_ids and len(out[r.id]) < r.max_new_tokens:
                still.append(r)
        live = still
    return out


def golden_streamed(truth: StreamedTruth, model_dir: Path, trace, name: str) -> dict:
    """goldens.golden_for_trace's record for `trace`, computed with the streamed fp64 oracle."""
    import oracle
    from oracle.trace import dump_trace
    from hybridqual.goldens import record as goldens
    from hybridqual.qualify.compare import top2_margin
    tokens = generate(truth, trace)
    results = {mode: oracle.run_trace(ScheduleOnly(truth.config), trace, mode=mode, forced_tokens=tokens)
               for mode in ("legacy", "async")}
    for mode, r in results.items():
        if r.tokens != tokens:
            raise RuntimeError(f"{name}: the {mode} schedule replay does not reproduce the generated outputs")
    truth.prefetch([(r.prompt, tokens[r.id]) for r in trace.requests])       # one more pass: the margins
    requests = {}
    for req in trace.requests:
        rows = truth.teacher_forced_logits(req.prompt, tokens[req.id])
        requests[req.id] = {"tokens": tokens[req.id], "finish_reason": results["legacy"].finish_reasons[req.id],
                            "margins": [round(top2_margin(row), goldens.MARGIN_DECIMALS) for row in rows]}
    truth.clear()
    return goldens.seal({"schema": goldens.SCHEMA, "model": model_dir.name, "model_sha256": goldens.model_sha256(model_dir),
            "trace": name, "trace_sha256": hashlib.sha256(dump_trace(trace).encode()).hexdigest(),
            "oracle_dtype": "float64", "requests": requests,
            "schedule_digest": {mode: r.digest for mode, r in results.items()}})
