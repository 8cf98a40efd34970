"""Device drafts (fastpath/engine/spec_device.py): with graphs / pad_decode the ngram proposer runs on the device in
the decode loop and the verify step reads its drafts there; the log and tokens are exactly the host proposer's and
the oracle's. GPU: the decode loop (every step after the last prefill) runs under
torch.cuda.set_sync_debug_mode("error") with CUDA graphs, and speculative == non-speculative tokens bitwise in
batch-invariant mode (default mode: tie-aware vs the oracle, the arithmetic differs by GEMM shapes)."""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.batch_invariant import engine_class, make_model  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.model import OracleModel  # noqa: E402
from oracle.scheduler import run_trace as oracle_run  # noqa: E402
from oracle.trace import parse_trace  # noqa: E402
from hybridqual.qualify.spec_checks import log_consistency, recompute_accepted, without_speculation  # noqa: E402

MODEL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
NGRAM = {"kind": "ngram", "min_n": 1, "max_n": 2}
TRACE = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 24, "prefill_chunk": 16,
                                                     "speculative": {"k": 3, "proposer": NGRAM}},
         "requests": [
             {"id": "a", "arrival_step": 0, "prompt": [1, 2, 3, 4, 1, 2, 3], "max_new_tokens": 9},
             {"id": "b", "arrival_step": 0, "prompt": [5, 6, 7], "max_new_tokens": 4,
              "sampling": {"kind": "seeded", "temperature": 0.9, "seed": 3}},
             {"id": "c", "arrival_step": 1, "prompt": [8, 9, 8, 9, 8], "max_new_tokens": 6}]}


DRAFT = {"kind": "draft", "model": "goldens/models/zoo-mamba2"}


def _trace(proposer: dict):
    t = json.loads(json.dumps(TRACE))
    t["engine"]["speculative"]["proposer"] = proposer
    return parse_trace(t)


@pytest.fixture(scope="module")
def models():
    cfg = zoo.tiny_config("bamba", **MODEL)
    w = zoo.random_weights(cfg, seed=3)
    return cfg, w, OracleModel(cfg, w, dtype=torch.float64)


def _loop_steps(log: dict) -> int:
    """Logged steps with rows and no prefill piece (the steps device drafts take)."""
    return sum(1 for s in log["steps"] if s["batch"] and all(b["kind"] != "prefill" for b in s["batch"]))


@pytest.mark.parametrize("proposer,replay", [(NGRAM, False), (DRAFT, False), (NGRAM, True)],
                         ids=["ngram", "draft", "ngram-replay"])
def test_device_drafts_keep_the_host_proposers_log_and_the_oracles(models, proposer, replay):
    """pad_decode (the graphs' shapes, eager on CPU): every decode-loop step takes device drafts (ngram: zero-draft
    rows logged as decode rows, a step without drafts as a plain decode step), prefill steps the host proposer;
    tokens and log == the host proposer's run and == the oracle's, legacy and async; a seeded row is among them;
    also with the replay rollback (FastOptions.spec_replay)."""
    cfg, w, oracle_model = models
    fast = FastModel(cfg, w, "cpu", torch.float32, FastOptions(backend="torch", spec_replay=replay, spec_device_drafts=True))
    trace = _trace(proposer)
    for mode in ("legacy", "async"):
        eng = Engine(fast, trace.engine, max_len=32, pad_decode=True)
        got = eng.run_trace(trace, mode)
        log = got.schedule_log.to_json()
        assert eng.spec.device_drafts.steps == _loop_steps(log) >= 4
        assert any(b["kind"] == "verify" for s in log["steps"] for b in s["batch"]
                   if all(x["kind"] != "prefill" for x in s["batch"]))
        want = oracle_run(oracle_model, trace, mode)
        assert got.tokens == want.tokens and log == want.schedule_log.to_json()
        eng.spec.device_drafts = None                       # the host proposer, same engine
        host = eng.run_trace(trace, mode)
        assert host.tokens == got.tokens and host.schedule_log.to_json() == log


def test_device_draft_seeded_rows_key_every_position_by_the_position_it_predicts(models):
    """DESIGN §13: each verify position of a seeded row is sampled with the key of the absolute position its logits
    predict (its input's position + 1, read back from the verify batch's own metadata), positions past the first
    included, so seeded requests are speculation-invariant."""
    cfg, w, _ = models
    fast = FastModel(cfg, w, "cpu", torch.float32, FastOptions(backend="torch", spec_device_drafts=True))
    trace = _trace(NGRAM)
    eng = Engine(fast, trace.engine, max_len=32, pad_decode=True)
    checked = []
    body = eng.spec.runner._device_body

    def device_body(key, seeded=None):
        out = body(key, seeded)
        nb, w = key
        pos = eng.spec.runner.meta[key][nb * w:2 * nb * w]
        for t, _, _, q in seeded or ():
            assert q == int(pos[t]) + 1, (key, t, q, int(pos[t]))
            checked.append(t // nb)
        return out
    eng.spec.runner._device_body = device_body
    eng.run_trace(trace, "legacy")
    assert checked and max(checked) >= 1, "no seeded position past a row's first was sampled in a device step"


def test_device_drafts_compose_with_the_prefix_cache(models):
    """Prefix-cache hits and stores with device-draft steps between them: log and tokens == the oracle's."""
    cfg, w, oracle_model = models
    fast = FastModel(cfg, w, "cpu", torch.float32, FastOptions(backend="torch", spec_device_drafts=True))
    shared = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
    trace = parse_trace({"schema": "hybridqual.trace/1",
                         "engine": {"max_requests": 2, "max_tokens_per_step": 24, "prefill_chunk": 16,
                                    "prefix_cache": {"block_size": 8, "capacity": 2},
                                    "speculative": {"k": 3, "proposer": NGRAM}},
                         "requests": [{"id": "p0", "arrival_step": 0, "prompt": shared + [1, 2], "max_new_tokens": 6},
                                      {"id": "p1", "arrival_step": 3, "prompt": shared + [4], "max_new_tokens": 6}]})
    eng = Engine(fast, trace.engine, max_len=32, pad_decode=True)
    got = eng.run_trace(trace, "legacy")
    log = got.schedule_log.to_json()
    assert eng.spec.device_drafts.steps == _loop_steps(log) > 0 and any(s["prefix_cache"]["hits"] for s in log["steps"])
    want = oracle_run(oracle_model, trace, "legacy")
    assert got.tokens == want.tokens and log == want.schedule_log.to_json()


def test_device_drafts_show_on_logits_every_position_and_need_graphs_or_pad_decode(models):
    """A logits hook (qualify's, run_recording_logits) sees, after the step's wait, every real position of a
    device-draft step as a decode row: the same rows as the host proposer's run, logits close (the verify widths
    differ: GEMM shapes); without graphs / pad_decode the host proposer runs."""
    from fastpath.batch_invariant import run_recording_logits
    cfg, w, _ = models
    fast = FastModel(cfg, w, "cpu", torch.float32, FastOptions(backend="torch", spec_device_drafts=True))
    trace = _trace(NGRAM)
    assert Engine(fast, trace.engine, max_len=32).spec.device_drafts is None
    eng = Engine(fast, trace.engine, max_len=32, pad_decode=True)
    dev, ld = run_recording_logits(eng, trace, "legacy")
    assert eng.spec.device_drafts.steps > 0
    eng.spec.device_drafts = None
    host, lh = run_recording_logits(eng, trace, "legacy")
    assert dev.tokens == host.tokens and dev.schedule_log.to_json() == host.schedule_log.to_json()
    assert ld.keys() == lh.keys() and len(ld) > 0
    for key in ld:
        assert torch.allclose(ld[key], lh[key], atol=1e-5, rtol=1e-5), key


def test_batch_invariant_device_drafts_equal_no_speculation_bitwise(models):
    """Batch-invariant mode: a verify row's logits are bitwise a decode row's, so speculative tokens == the
    non-speculative ones exactly (the CPU twin of the GPU test below)."""
    cfg, w, _ = models
    o = FastOptions(backend="torch", batch_invariant=True, spec_device_drafts=True)
    m, E = make_model(cfg, w, "cpu", torch.float32, o), engine_class(o)
    t = json.loads(json.dumps(TRACE))
    t["requests"] = t["requests"][:1]                       # one request: the interpreter's fixed-tile matmul is slow
    trace = parse_trace(t)
    eng = E(m, trace.engine, max_len=32, pad_decode=True)
    got = eng.run_trace(trace, "legacy")
    plain = without_speculation(trace)
    assert eng.spec.device_drafts.steps > 0
    assert got.tokens == E(m, plain.engine, max_len=32, pad_decode=True).run_trace(plain, "legacy").tokens


# ------------------------------------------------------------------------------------------------------- GPU

GPU_TRACE = {"schema": "hybridqual.trace/1",
             "engine": {"max_requests": 3, "max_tokens_per_step": 32, "prefill_chunk": 16,
                        "speculative": {"k": 4, "proposer": {"kind": "ngram", "min_n": 1, "max_n": 3}}},
             "requests": [
                 {"id": "a", "arrival_step": 0, "prompt": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], "max_new_tokens": 40},
                 {"id": "b", "arrival_step": 0, "prompt": [7, 8, 7, 8, 7, 8, 7], "max_new_tokens": 24},
                 {"id": "c", "arrival_step": 0, "prompt": [9, 10, 11, 9, 10, 11, 9, 10], "max_new_tokens": 32}]}


def _sync_checked(eng) -> list[int]:
    """Wrap eng.step: a step taken when every unfinished request is admitted and past its prompt (the decode loop:
    resolve of the step before, rollback, release, compaction, batch, device drafts, verify graph, token copy)
    runs under set_sync_debug_mode("error"); returns the counter of checked steps."""
    real, n = eng.step, [0]

    def step():
        live = [s for s in eng.requests.values() if s.finish_reason is None]
        if not live or not all(s.admitted and not s.prefilling for s in live):
            return real()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            n[0] += 1
    eng.step = step
    return n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("proposer,batch_invariant", [("ngram", True), ("ngram", False), ("draft", False)],
                         ids=["ngram-batch_invariant", "ngram-default", "draft-default"])
def test_gpu_device_drafts_decode_loop_has_no_host_sync_with_graphs(proposer, batch_invariant):
    """bf16, CUDA graphs, drafts on the device (ngram; the draft model's passes): after a warm-up run (graph
    captures), the decode loop of a second run raises on any synchronising CUDA call; drafts were proposed and
    accepted; the log is consistent (and the acceptance the oracle recomputes from the logged proposals matches
    when the tokens are the oracle's); async == legacy; speculative tokens == non-speculative bitwise in
    batch-invariant mode; both track the fp64 oracle tie-aware."""
    from hybridqual.qualify.compare import TAU, compare_tie_aware
    cfg = zoo.tiny_config("bamba", **MODEL)
    w = zoo.random_weights(cfg, seed=3)
    oracle_model = OracleModel(cfg, w, dtype=torch.float64)
    o = FastOptions(batch_invariant=batch_invariant, spec_device_drafts=True)
    fast, E = make_model(cfg, w, "cuda", torch.bfloat16, o), engine_class(o)
    t = json.loads(json.dumps(GPU_TRACE))
    if proposer == "draft":
        t["engine"]["speculative"]["proposer"] = DRAFT
    trace = parse_trace(t)
    eng = E(fast, trace.engine, max_len=96, graphs=True)
    warm = eng.run_trace(trace, "legacy")
    before, checked = eng.spec.device_drafts.steps, _sync_checked(eng)
    got = eng.run_trace(trace, "legacy")
    assert got.tokens == warm.tokens and got.digest == warm.digest
    log = got.schedule_log.to_json()
    assert eng.spec.device_drafts.steps - before == _loop_steps(log) >= 5 and checked[0] >= _loop_steps(log)
    assert eng.spec.runner.replays > 0
    rows = [b for s in log["steps"] for b in s["batch"] if b["kind"] == "verify"]
    assert rows and any(v["accepted"] > 0 for s in log["steps"] for v in (s.get("verify") or ()))
    assert log_consistency(got.schedule_log) == []
    if got.tokens == oracle_run(oracle_model, trace, "legacy").tokens:     # else a bf16 near tie (checked below)
        assert recompute_accepted(oracle_model, trace, got) == []
    assert eng.run_trace(trace, "async").tokens == got.tokens
    plain_trace = without_speculation(trace)
    plain = E(fast, plain_trace.engine, max_len=96, graphs=True).run_trace(plain_trace, "legacy")
    if batch_invariant:
        assert got.tokens == plain.tokens, "speculation changed a token in batch-invariant mode"
    for res in (got, plain):
        for req in trace.requests:
            v = compare_tie_aware(oracle_model, req.id, req.prompt, res.tokens[req.id], req.stop_token_ids,
                                  req.max_new_tokens, TAU[torch.bfloat16])
            assert v.ok, f"{req.id}: {v.failure} {v.note}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_device_draft_logits_are_the_replayed_graphs_own_in_every_run():
    """bf16, CUDA graphs, device drafts on spec_ngram.json (seeded rows run a bucket eagerly before a greedy step
    replays the same bucket's graph): the logits rows on_logits sees are bitwise the same in a run that captures the
    graphs, in later runs on the same engine (legacy, async) and on a fresh engine — an eager step's logits must not
    stand in for a later replay's (docs/journal/engine.md, "device proposals (measured)": rows off by 3.3 in every run after the
    capturing one)."""
    from fastpath.batch_invariant import run_recording_logits
    from oracle.trace import load_trace
    cfg = zoo.tiny_config("bamba")
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=3), "cuda", torch.bfloat16,
                     FastOptions(spec_device_drafts=True))
    trace = load_trace(os.path.join(os.path.dirname(__file__), "..", "goldens", "traces", "spec_ngram.json"))

    def kept(eng, mode):
        res, rows = run_recording_logits(eng, trace, mode)
        return res, {(r.id, len(r.prompt) + i): rows[(r.id, len(r.prompt) + i)]
                     for r in trace.requests for i in range(len(res.tokens[r.id]))}
    eng = Engine(fast, trace.engine, max_len=96, graphs=True)
    runs = [kept(eng, "legacy"), kept(eng, "async"), kept(eng, "legacy"),
            kept(Engine(fast, trace.engine, max_len=96, graphs=True), "async")]
    assert eng.spec.device_drafts.steps > 0 and eng.spec.runner.replays > 0
    (first, base), rest = runs[0], runs[1:]
    for res, rows in rest:
        assert res.tokens == first.tokens and rows.keys() == base.keys()
        assert [k for k in sorted(base) if not torch.equal(base[k], rows[k])] == []
