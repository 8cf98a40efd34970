"""The verify step of speculative decoding (fastpath/engine/verify.py): one decode-shaped forward per verify step,
per-position snapshots, rollback = a snapshot copy (no second forward), (rows, width) buckets with an eager padded
path that is the CUDA graphs' bitwise reference."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.engine import verify  # noqa: E402
from fastpath.engine.verify import width_buckets  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.model import OracleModel  # noqa: E402
from oracle.scheduler import run_trace as oracle_run  # noqa: E402
from oracle.trace import parse_trace  # noqa: E402
from hybridqual.qualify.spec_checks import verify_rows, without_speculation  # noqa: E402

ENGINE_MODEL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
K = 4
BASE = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 3, "max_tokens_per_step": 24, "prefill_chunk": 16},
        "requests": [
            {"id": "a", "arrival_step": 0, "prompt": [1, 2, 3, 4, 1, 2, 3], "max_new_tokens": 9},
            {"id": "b", "arrival_step": 0, "prompt": [5, 6, 7], "max_new_tokens": 6},
            {"id": "c", "arrival_step": 1, "prompt": [8, 9, 8, 9, 8], "max_new_tokens": 6}]}
TRACES = Path(__file__).parent.parent / "goldens" / "traces"


@pytest.fixture(scope="module")
def models():
    cfg = zoo.tiny_config("bamba", **ENGINE_MODEL)
    w = zoo.random_weights(cfg, seed=3)
    return OracleModel(cfg, w, dtype=torch.float64), FastModel(cfg, w, "cpu", torch.float32).with_options(
        backend="torch")


def _trace(proposer: dict | None, obj: dict = BASE, k: int = K):
    t = json.loads(json.dumps(obj))
    if proposer is not None:
        t["engine"]["speculative"] = {"k": k, "proposer": proposer}
    return parse_trace(t)


def _mixed_script(tokens: dict[str, list[int]], V: int) -> dict:
    """Rows of different widths in one step: 'a' K true drafts (full accept), 'b' one draft then a wrong one
    (rejected at the second), 'c' none at even lengths (a decode row inside a verify batch), 2 true ones at odd."""
    table = {"a": {}, "b": {}, "c": {}}
    for n in range(1, 9):
        table["a"][str(n)] = tokens["a"][n:n + K]
        good = tokens["b"][n:n + 2]
        if len(good) == 2:
            table["b"][str(n)] = [good[0], (good[1] + 1) % V]
        if n % 2:
            table["c"][str(n)] = tokens["c"][n:n + 2]
    return {"kind": "scripted", "proposals": table}


def test_width_buckets_are_one_plus_powers_of_two_up_to_k_plus_one():
    assert width_buckets(1) == [2] and width_buckets(3) == [2, 3, 4] and width_buckets(8) == [2, 3, 5, 9]
    assert width_buckets(4) == [2, 3, 5]


def test_fast_ngram_search_equals_the_oracles_prompt_lookup():
    """The fast path's bytes.rfind search == oracle.speculative.ngram_propose (slice by slice) on seeded random token
    lists: small alphabets (many matches), ids whose packed bytes match across token boundaries, every n range."""
    import random
    from fastpath.engine.speculative import ngram
    from oracle.speculative import ngram_propose
    rng = random.Random(18)
    for _ in range(4000):
        V = rng.choice([2, 3, 7, 256, 257, 65536, 2**31])
        toks = [rng.randrange(V) for _ in range(rng.randrange(0, 30))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        assert ngram(toks, k, lo, hi) == ngram_propose(toks, k, lo, hi), (toks, k, lo, hi)
    assert ngram([256, 0, 1, 0], 2, 1, 1) == ngram_propose([256, 0, 1, 0], 2, 1, 1) == [1, 0]


def test_snapshot_copy_equals_the_state_a_verify_of_the_accepted_inputs_leaves_bitwise(models):
    """Rollback's premise, bitwise: the snapshot after input a of a verify of m drafts == the state a verify of
    only the first a+1 inputs leaves in the slot (same batch shape, so the same kernels and GEMM shapes)."""
    _, fast = models
    eng = Engine(fast, _trace({"kind": "ngram", "min_n": 1, "max_n": 2}).engine, max_len=32, pad_decode=True)
    run, bank = eng.spec.runner, eng.bank
    gen = torch.Generator().manual_seed(0)
    bank.conv_state.copy_(torch.randn(bank.conv_state.shape, generator=gen))
    bank.ssm_state.copy_(torch.randn(bank.ssm_state.shape, generator=gen))
    start = {"conv": bank.conv_state.clone(), "ssm": bank.ssm_state.clone()}
    inputs, pos, slots = [[3, 9, 4, 1, 7], [5, 2, 8, 8, 6]], [6, 4], [2, 0]   # row 1 keeps the width at 5
    run.run(inputs, pos, slots, [])
    snaps = {a: (run.snaps.conv[:, a, 0].clone(), run.snaps.ssm[:, a, 0].clone()) for a in range(4)}
    full = (bank.conv_state[:, 2].clone(), bank.ssm_state[:, 2].clone())
    for a in range(5):
        bank.conv_state.copy_(start["conv"])
        bank.ssm_state.copy_(start["ssm"])
        nb, w, _, _ = run.run([inputs[0][:a + 1], inputs[1]], pos, slots, [])
        assert (nb, w) == (2, 5)                                   # the same bucket as the full verify
        want = snaps[a] if a < 4 else full
        assert torch.equal(bank.conv_state[:, 2], want[0]) and torch.equal(bank.ssm_state[:, 2], want[1]), a
        assert torch.equal(bank.conv_state[:, 1], start["conv"][:, 1])        # a slot no row uses: untouched


def test_a_verify_step_is_one_forward_and_its_rollback_none(models, monkeypatch):
    """Per verify step: exactly one verify forward and no model.forward (no prefill in it), rejections included;
    the rollback copies snapshots only. Tokens and log == the oracle's, == no speculation."""
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    trace = _trace(_mixed_script(plain.tokens, fast.config.vocab_size))
    counts = {"verify": 0, "forward": 0}
    real_verify = verify.verify_forward
    monkeypatch.setattr(verify, "verify_forward", lambda *a: counts.__setitem__("verify", counts["verify"] + 1)
                        or real_verify(*a))
    eng = Engine(fast, trace.engine, max_len=32)
    real_forward = eng.model.forward
    eng.model.forward = lambda *a: counts.__setitem__("forward", counts["forward"] + 1) or real_forward(*a)
    per_step, last = [], dict(counts)
    step = eng.step

    def counted():
        more = step()
        per_step.append((eng.log.steps[-1] if more else None, counts["verify"] - last["verify"],
                         counts["forward"] - last["forward"]))
        last.update(counts)
        return more
    eng.step = counted
    got = eng.run_trace(trace, "legacy")
    assert got.tokens == plain.tokens
    assert got.schedule_log.to_json() == oracle_run(oracle_model, trace).schedule_log.to_json()
    accepted = [v["accepted"] for v in verify_rows(got.schedule_log)]
    assert 1 in accepted and K in accepted, accepted
    ver = [(rec, v, f) for rec, v, f in per_step[:-1] if any(b.kind == "verify" for b in rec.batch)]
    assert ver
    widths = {len({b.count for b in rec.batch if b.kind in ("decode", "verify")}) for rec, _, _ in ver}
    assert max(widths) > 1                                          # rows of different widths in one verify batch
    for rec, v, f in ver:
        prefill = any(b.kind == "prefill" for b in rec.batch)
        assert v == 1 and f == int(prefill), (rec.step, v, f)


@pytest.mark.parametrize("proposer", ["scripted", "ngram"])
def test_padded_verify_buckets_equal_exact_shapes_and_no_speculation(models, proposer):
    """pad_decode (the graphs' bucket shapes, eager) vs exact shapes: the same tokens and log, logits of every real
    position close (different GEMM shapes), and both == the engine without speculation."""
    from fastpath.batch_invariant import run_recording_logits
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    spec = (_mixed_script(plain.tokens, fast.config.vocab_size) if proposer == "scripted"
            else {"kind": "ngram", "min_n": 1, "max_n": 3})
    trace = _trace(spec)
    out = {}
    for pad in (False, True):
        eng = Engine(fast, trace.engine, max_len=32, pad_decode=pad)
        out[pad] = run_recording_logits(eng, trace, "legacy")
        if pad:
            assert eng.spec.runner.padded and not eng.spec.runner.capture
            assert {k for k in eng.spec.runner.meta} <= {(nb, w) for nb in (1, 2, 3) for w in width_buckets(K)}
    (exact, lx), (padded, lp) = out[False], out[True]
    assert exact.tokens == padded.tokens == plain.tokens
    assert exact.schedule_log.to_json() == padded.schedule_log.to_json()
    assert lx.keys() == lp.keys() and len(lx) > 0
    for key in lx:
        assert torch.allclose(lx[key], lp[key], atol=1e-5, rtol=1e-5), key
    base = Engine(fast, without_speculation(trace).engine, max_len=32).run_trace(without_speculation(trace))
    assert base.tokens == exact.tokens


def test_verify_scratch_is_allocated_once_and_sized_by_k(models):
    """The per-position snapshots: k positions x R rows x every Mamba layer's conv window and SSM state, allocated
    with the engine (data_ptr stable over a run)."""
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    trace = _trace(_mixed_script(plain.tokens, fast.config.vocab_size))
    eng = Engine(fast, trace.engine, max_len=32)
    s, bank = eng.spec.snap, eng.bank
    assert s.conv.shape == (bank.conv_state.shape[0], K, 3) + tuple(bank.conv_state.shape[2:])
    assert s.ssm.shape == (bank.ssm_state.shape[0], K, 3) + tuple(bank.ssm_state.shape[2:])
    ptrs = (s.conv.data_ptr(), s.ssm.data_ptr())
    eng.run_trace(trace)
    assert (s.conv.data_ptr(), s.ssm.data_ptr()) == ptrs
    assert s.nbytes() == K * 3 * (bank.conv_state[:, 0].numel() + bank.ssm_state[:, 0].numel()) * 4


def test_draft_steps_through_the_decode_buckets_keep_the_oracles_log(models):
    """pad_decode: the draft model's drafting steps run as the decode graphs' buckets on its own bank (the CUDA
    path, eager): proposals, accepted counts and tokens == the oracle's, == no speculation."""
    oracle_model, fast = models
    trace = _trace({"kind": "draft", "model": "goldens/models/zoo-mamba2"})
    eng = Engine(fast, trace.engine, max_len=32, pad_decode=True)
    assert eng.spec.draft.graphs is not None and not eng.spec.draft.graphs.capture
    got = eng.run_trace(trace, "legacy")
    want = oracle_run(oracle_model, trace, "legacy")
    assert got.tokens == want.tokens == oracle_run(oracle_model, _trace(None)).tokens
    assert got.schedule_log.to_json() == want.schedule_log.to_json()
    assert any(len(b.proposals) > 1 for s in got.schedule_log.steps for b in s.batch if b.kind == "verify")


def test_work_per_verify_step_and_rollback_as_counted_in_the_docs(models, monkeypatch):
    """The counts docs/engine.md gives for both rollbacks, counted here: a verify of width w runs w conv and SSM
    steps per Mamba layer and w attention_decode per attention layer; snapshots are stored by w-1 of those conv
    and SSM steps per Mamba layer (no copy of their own), the replay log is 1 save (4 copies) and its rollback
    re-runs a+1 conv and SSM steps per Mamba layer."""
    _, fast = models
    calls: dict[str, int] = {}

    def counting(name, fn):
        def run(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            if k.get("snap") is not None:
                calls[name + " +snap"] = calls.get(name + " +snap", 0) + 1
            return fn(*a, **k)
        return run
    for name in ("conv1d_step", "ssm_step", "attention_decode"):
        monkeypatch.setattr(verify.ops, name, counting(name, getattr(verify.ops, name)))
    monkeypatch.setattr(verify.InputLog, "save", counting("log", verify.InputLog.save))
    cfg = fast.config
    n_m, n_a = len(cfg.mamba_layer_ids), len(cfg.attention_layer_ids)
    trace = _trace({"kind": "ngram", "min_n": 1, "max_n": 2})
    for replaying in (False, True):
        eng = Engine(fast.with_options(spec_replay=replaying), trace.engine, max_len=32)
        calls.clear()
        nb, w, _, _ = eng.spec.runner.run([[3, 9, 4, 1, 7], [5, 2]], [6, 4], [2, 0], [])
        assert (nb, w) == (2, 5)
        want = {"conv1d_step": n_m * w, "ssm_step": n_m * w, "attention_decode": n_a * w}
        want.update({"log": n_m} if replaying else {"conv1d_step +snap": n_m * (w - 1), "ssm_step +snap": n_m * (w - 1)})
        assert calls == want, (replaying, calls)
        if replaying:
            calls.clear()
            eng.spec.runner.replay([(0, 2, 2), (1, 0, 0)])          # rows accepted 2 and 0 drafts
            assert calls == {"conv1d_step": n_m * 3, "ssm_step": n_m * 3}, calls


def _run_with_states(fast, trace, **kw):
    """Run the trace; after every resolve, every live request's slot state keyed by (request, output length)."""
    eng = Engine(fast, trace.engine, max_len=32, **kw)
    seen, original = {}, eng.resolve

    def resolve(p, inflight=None):
        original(p, inflight)
        for r, rid in enumerate(eng.rows.row_request[:eng.rows.active]):
            st = eng.requests[rid]
            if st.output and st.finish_reason is None and not st.prefilling:
                seen[(rid, len(st.output))] = eng.bank.slot_state(eng.rows.row_to_slot[r])
    eng.resolve = resolve
    return eng.run_trace(trace, "legacy"), seen, eng


def test_replay_rollback_leaves_the_snapshot_rollbacks_bits(models):
    """FastOptions.spec_replay (pre-verify state back, then the accepted positions' conv/SSM steps re-run from the
    logged inputs) vs per-position snapshots: same tokens and log, bitwise the same slot state after every step;
    the replay keeps no snapshots (its record: R pre-verify states + (k+1)*R rows of conv inputs and dt)."""
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    trace = _trace(_mixed_script(plain.tokens, fast.config.vocab_size))
    snap, s_states, s_eng = _run_with_states(fast, trace)
    rep, r_states, r_eng = _run_with_states(fast.with_options(spec_replay=True), trace)
    assert rep.tokens == snap.tokens == plain.tokens
    assert rep.schedule_log.to_json() == snap.schedule_log.to_json()
    assert r_eng.spec.runner.snaps is None and s_eng.spec.runner.inputs is None
    assert any(v["accepted"] < len(b.proposals) for s in rep.schedule_log.steps for b, v in
               zip([b for b in s.batch if b.kind == "verify"], s.verify or []))
    assert s_states.keys() == r_states.keys() and len(s_states) > 5
    for key in s_states:
        for name in s_states[key]:
            assert torch.equal(s_states[key][name], r_states[key][name]), (key, name)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SPEC_TRACES = sorted(p.stem for p in TRACES.glob("spec_*.json"))


def _greedy_verify_steps(trace, log) -> int:
    """Steps with verify rows whose decode/verify rows are all greedy (the ones a verify graph replays)."""
    kind = {r.id: r.sampling.kind for r in trace.requests}
    return sum(1 for s in log.steps if any(b.kind == "verify" for b in s.batch)
               and all(kind[b.request] == "greedy" for b in s.batch if b.kind in ("decode", "verify")))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("name", SPEC_TRACES)
def test_gpu_verify_graph_replay_equals_eager_padded_bitwise(name):
    """bf16: verify steps replayed as CUDA graphs == the same buckets run eagerly (pad_decode), bitwise in every
    real position's logits and in tokens and logs; every greedy verify step was a graph replay (host proposers,
    pinned: with FastOptions.spec_device_drafts every decode-loop step is a replay, so the count differs)."""
    from fastpath.batch_invariant import run_recording_logits
    from oracle.trace import load_trace
    cfg = zoo.tiny_config("bamba", **ENGINE_MODEL)
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=3), "cuda", torch.bfloat16,
                     FastOptions(spec_device_drafts=False))
    trace = load_trace(TRACES / f"{name}.json")
    res, replays = {}, 0
    for graphs in (True, False):
        eng = Engine(fast, trace.engine, max_len=64, graphs=graphs, pad_decode=not graphs)
        res[graphs] = run_recording_logits(eng, trace, "legacy")
        replays = replays if not graphs else eng.spec.runner.replays
    (g, lg), (e, le) = res[True], res[False]
    assert g.tokens == e.tokens and g.schedule_log.to_json() == e.schedule_log.to_json()
    assert lg.keys() == le.keys()
    for key in lg:
        assert torch.equal(lg[key], le[key]), key
    assert replays == _greedy_verify_steps(trace, g.schedule_log)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("arch", ["bamba", "nemotron_h", "mamba2", "granitemoehybrid"])
def test_gpu_bf16_graphs_ngram_speculation_keeps_the_tokens(arch):
    """Zoo models in bf16 with CUDA graphs: with ngram speculation (verify graphs) and without, the greedy tokens
    track the fp64 oracle tie-aware; async == legacy bitwise with speculation; verify graphs were replayed."""
    from hybridqual.qualify.compare import TAU, compare_tie_aware
    cfg = zoo.tiny_config(arch)
    w = zoo.random_weights(cfg, seed=3)
    oracle_model, fast = OracleModel(cfg, w, dtype=torch.float64), FastModel(cfg, w, "cuda", torch.bfloat16)
    obj = json.loads(json.dumps(BASE))
    obj["engine"]["max_tokens_per_step"] = 32
    for r in obj["requests"]:
        r["prompt"] = [t % cfg.vocab_size for t in r["prompt"] * 3]
    trace, plain_trace = _trace({"kind": "ngram", "min_n": 1, "max_n": 3}, obj), _trace(None, obj)
    plain = Engine(fast, plain_trace.engine, max_len=96, graphs=True).run_trace(plain_trace, "legacy")
    eng = Engine(fast, trace.engine, max_len=96, graphs=True)
    legacy, async_ = eng.run_trace(trace, "legacy"), eng.run_trace(trace, "async")
    assert legacy.tokens == async_.tokens
    for got in (legacy, plain):
        for req in trace.requests:
            v = compare_tie_aware(oracle_model, req.id, req.prompt, got.tokens[req.id], req.stop_token_ids,
                                  req.max_new_tokens, TAU[torch.bfloat16])
            assert v.ok, f"{req.id}: {v.failure} {v.note}"
    if verify_rows(legacy.schedule_log):
        assert eng.spec.runner.replays > 0


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("name", SPEC_TRACES)
def test_gpu_replay_rollback_equals_snapshot_rollback_bitwise_with_graphs(name):
    """bf16 + CUDA graphs: the replay rollback (FastOptions.spec_replay) and the per-position snapshots give the same
    tokens, logs and logits bitwise (the verify forward differs only by what it copies aside)."""
    from fastpath.batch_invariant import run_recording_logits
    from oracle.trace import load_trace
    cfg = zoo.tiny_config("bamba", **ENGINE_MODEL)
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=3), "cuda", torch.bfloat16)
    trace = load_trace(TRACES / f"{name}.json")
    (a, la), (b, lb) = (run_recording_logits(Engine(m, trace.engine, max_len=64, graphs=True), trace, "legacy")
                        for m in (fast, fast.with_options(spec_replay=True)))
    assert a.tokens == b.tokens and a.schedule_log.to_json() == b.schedule_log.to_json()
    assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)
