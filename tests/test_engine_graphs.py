"""Padded decode buckets (pad rows -> slot -1), CUDA graphs == eager, chunked == unchunked prefill, no hidden syncs."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.engine.graphs import buckets  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SMALL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)


def _model(device: str, dtype: torch.dtype, **overrides) -> FastModel:
    cfg = zoo.tiny_config("bamba", **overrides)
    return FastModel(cfg, zoo.random_weights(cfg, seed=5), device, dtype)


def _decode_trace(R: int, n: int) -> Trace:
    reqs = tuple(Request(f"r{i}", i // 2, (3 + i, 11, 40 + i), 3 + 2 * i) for i in range(n))
    return Trace(EngineConfig(R, R - 1 + 8, 8, "async"), reqs)


def test_buckets_are_powers_of_two_then_max():
    assert buckets(1) == [1] and buckets(4) == [1, 2, 4] and buckets(6) == [1, 2, 4, 6]


def test_padded_decode_rows_skip_their_slot_and_match_unpadded():
    """3 live rows run in bucket 4: the pad row (slot -1) must not touch the bank; tokens and logs unchanged."""
    fast = _model("cpu", torch.float32, **SMALL)
    trace = _decode_trace(4, 3)
    plain = Engine(fast, trace.engine, max_len=32).run_trace(trace, "async")
    padded_engine = Engine(fast, trace.engine, max_len=32, pad_decode=True)
    bank = padded_engine.bank
    bank.conv_state[:, 3].fill_(7.0)           # slot 3 is never admitted: only a pad row could write it
    bank.ssm_state[:, 3].fill_(7.0)
    bank.k_cache[:, 3].fill_(7.0)
    padded = padded_engine.run_trace(trace, "async")
    assert padded.tokens == plain.tokens and padded.digest == plain.digest
    assert bool((bank.conv_state[:, 3] == 7.0).all() and (bank.ssm_state[:, 3] == 7.0).all())
    assert bool((bank.k_cache[:, 3] == 7.0).all())


def _prefill_then_decode(engine: Engine, prompt: tuple[int, ...], chunk: int):
    trace = Trace(EngineConfig(1, chunk, chunk, "legacy"), (Request("p", 0, prompt, 4),))
    engine.ec = trace.engine
    res = engine.run_trace(trace, "legacy")
    return res.tokens["p"], engine.bank.ssm_state[:, 0].clone(), engine.bank.conv_state[:, 0].clone()


@pytest.mark.parametrize("device,dtype,arch", [
    pytest.param("cpu", torch.float32, "mamba2", id="cpu-fp32-mamba2"),
    pytest.param("cuda", torch.bfloat16, "mamba2", marks=GPU, id="cuda-bf16-mamba2"),
    pytest.param("cuda", torch.bfloat16, "bamba", marks=GPU, id="cuda-bf16-bamba")])
def test_chunked_prefill_equals_unchunked_bitwise(device, dtype, arch):
    """A prompt of 4 chunks in one piece vs four chunk-aligned pieces: same tokens, bitwise the same state.

    The hybrid runs on GPU only: passed on the GPU in bf16; on the CPU interpreter attention_prefill_varlen gives
    different bits (1.8e-7) when the prompt is split, so the CPU case is Mamba-only (docs/engine.md)."""
    small = {"pattern": "M", "hidden_size": 16, "mamba_n_heads": 2, "mamba_n_groups": 1} if device == "cpu" else {}
    cfg = zoo.tiny_config(arch, **small)
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=5), device, dtype)
    C = fast.config.chunk_size
    prompt = tuple((7 * i + 3) % 90 for i in range(4 * C))
    eng = Engine(fast, EngineConfig(1, 4 * C, 4 * C, "legacy"), max_len=8 * C)
    whole = _prefill_then_decode(eng, prompt, 4 * C)
    pieces = _prefill_then_decode(eng, prompt, C)         # four chunk-aligned pieces
    assert whole[0] == pieces[0]
    assert torch.equal(whole[1], pieces[1]) and torch.equal(whole[2], pieces[2])


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("device,dtype", [pytest.param("cuda", torch.bfloat16, marks=GPU, id="cuda-bf16")])
def test_cuda_graph_replay_equals_eager_bitwise(device, dtype, backend):
    """Graph replays == the padded eager steps, on the Triton kernels and on the torch stand-ins (whose decode ops
    must read nothing back to the host, or capture is invalidated)."""
    fast = _model(device, dtype).with_options(backend=backend)
    trace = _decode_trace(6, 6)
    eager = Engine(fast, trace.engine, max_len=64, pad_decode=True)
    graphed = Engine(fast, trace.engine, max_len=64, graphs=True)
    for mode in ("legacy", "async"):
        a, b = eager.run_trace(trace, mode), graphed.run_trace(trace, mode)
        assert a.tokens == b.tokens and a.digest == b.digest
    assert graphed.graphs.replays > 0


def _sync_counts(eng: Engine, steps: int) -> dict[str, int]:
    """CUDA runtime synchronisations seen by torch.profiler while the engine runs `steps` steps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
    names = [e.name for e in prof.events()]
    return {"stream_or_device": sum("StreamSynchronize" in n or "DeviceSynchronize" in n for n in names),
            "event": sum("EventSynchronize" in n for n in names)}


@pytest.mark.parametrize("device,dtype", [pytest.param("cuda", torch.bfloat16, marks=GPU, id="cuda-bf16")])
def test_async_decode_steps_have_no_hidden_syncs(device, dtype):
    """Decode steps add no stream/device syncs and exactly one event wait each.

    The profiler itself may synchronise once per window (seen on the GPU: one cudaDeviceSynchronize per profiled
    window), so the claim is made on the difference between a 30-step and a 10-step window."""
    fast = _model(device, dtype)
    trace = Trace(EngineConfig(2, 9, 8, "async"), (Request("a", 0, (1, 2, 3), 60), Request("b", 0, (4, 5), 60)))
    eng = Engine(fast, trace.engine, max_len=80, graphs=True)
    eng.run_trace(trace, "async")                         # warm-up: captures the graphs
    eng.reset("async")
    for r in trace.requests:
        eng.add_request(r)
    for _ in range(4):                                    # admission + prefill, then decode-only steps
        eng.step()
    short, long = _sync_counts(eng, 10), _sync_counts(eng, 30)
    assert long["stream_or_device"] - short["stream_or_device"] == 0, (short, long)
    assert long["event"] - short["event"] == 20, (short, long)


@pytest.mark.parametrize("pad_decode", [False, True], ids=["eager", "padded"])
def test_decode_steps_read_back_from_the_device_once(monkeypatch, pad_decode):
    """CPU stand-in for the sync count: in async decode steps the only tensor->host reads are the one token
    read per step (`tolist` of the host copy); no `.item()`, no other `tolist`, no `__bool__` of a tensor."""
    fast = _model("cpu", torch.float32, **SMALL)
    trace = Trace(EngineConfig(2, 9, 8, "async"), (Request("a", 0, (1, 2, 3), 30), Request("b", 0, (4, 5), 30)))
    eng = Engine(fast, trace.engine, max_len=40, pad_decode=pad_decode)
    eng.reset("async")
    for r in trace.requests:
        eng.add_request(r)
    for _ in range(4):                                    # admission + prefill, then decode-only steps
        eng.step()
    counts = {"item": 0, "tolist": 0, "__bool__": 0}
    for name in counts:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, _name=name, _orig=original, **k):
            counts[_name] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    steps = 10
    for _ in range(steps):
        eng.step()
    monkeypatch.undo()
    assert counts == {"item": 0, "tolist": steps, "__bool__": 0}, counts
    assert all(s["overlap"] == 1 for s in eng.log.to_json()["steps"][-steps:])
