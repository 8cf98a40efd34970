"""No garbage collection while a stream captures (fastpath/engine/graphs.py `capture`).

torch.cuda.graph does not collect before a capture (torch >= 2.9), and a speculative Engine is a reference cycle, so
an unreachable earlier engine keeps its CUDAGraphs until the cyclic collector runs; a collection during a capture
destroyed them there ("operation not permitted when stream is capturing", CUDAGraph.reset) and invalidated the
capture in progress: the gpu tier's order-dependent failure of
test_gpu_replay_rollback_equals_snapshot_rollback_bitwise_with_graphs[spec_scripted] in VerifyRunner._capture.

CPU: every capture site (verify, decode and prefill graphs) under a stand-in for torch.cuda.graph whose capture
begins by dropping the last reference to a cycle holding a stand-in graph, with the collector's threshold at 1 (any
container allocated during the capture would trigger a collection): the stray graph must be finalised after the
capture ends, never inside it. GPU: the same with a real captured CUDAGraph in the cycle, through a real engine.
"""
from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath.engine import graphs, verify  # noqa: E402
from fastpath.engine.prefill_graphs import PrefillGraphs  # noqa: E402

TRACES = Path(__file__).parent.parent / "goldens" / "traces"


class _Recorder:
    """What happened, in order: ("begin", collector on?), ("body", collector on?), ("stray freed", inside a
    capture?), ("end",)."""

    def __init__(self):
        self.events: list[tuple] = []
        self.capturing = False


class _StrayGraph:
    """Stands in for an earlier engine's CUDAGraph: its finaliser is where the real one calls cudaGraphExecDestroy."""

    def __init__(self, rec: _Recorder):
        self.rec = rec

    def __del__(self):
        self.rec.events.append(("stray freed", self.rec.capturing))


def _fake_cuda(monkeypatch, rec: _Recorder) -> None:
    """torch.cuda's graph, CUDAGraph, Stream, stream and current_stream as CPU stand-ins; the capture begins by
    making a cycle that holds a stray graph unreachable (an engine dropped by an earlier test)."""

    class Graph:
        def __init__(self, g, pool=None, **_):
            self.g = g

        def __enter__(self):
            rec.capturing = True
            rec.events.append(("begin", gc.isenabled()))
            cycle = {"graph": _StrayGraph(rec)}
            cycle["self"] = cycle
            self.thresholds = gc.get_threshold()
            gc.set_threshold(1, 1, 1)               # while capturing, any container allocated may collect
            del cycle                               # unreachable now: only the cyclic collector frees it
            for _ in range(64):                     # allocations a capture makes
                [[] for _ in range(4)]

        def __exit__(self, *exc):
            gc.set_threshold(*self.thresholds)
            rec.capturing = False
            rec.events.append(("end",))
            return False

    class CUDAGraph:
        def pool(self):
            return ("pool", id(self))

        def replay(self):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "graph", Graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())


@pytest.fixture
def collector_on():
    """The collector on (as in any program), its thresholds and state restored afterwards."""
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.collect()
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        (gc.enable if was else gc.disable)()


def _body(rec: _Recorder, out: torch.Tensor):
    def body(*_):
        rec.events.append(("body", gc.isenabled()))
        [[] for _ in range(16)]
        return out
    return body


def _check(rec: _Recorder) -> None:
    gc.collect()                                    # after the capture: the stray graph is freed here
    ev = rec.events
    assert ("begin", False) in ev, ev               # the collector was already off when the capture began
    during = ev[ev.index(("begin", False)):ev.index(("end",))]
    assert ("body", False) in during and ("body", True) not in during, ev
    assert ("stray freed", True) not in ev, ev      # never finalised inside the capture
    assert ("stray freed", False) in ev, ev         # ... but once it was over
    assert gc.isenabled()                           # and the collector is on again


def test_verify_capture_collects_no_garbage_while_capturing(monkeypatch, collector_on):
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)
    runner = object.__new__(verify.VerifyRunner)
    runner.device, runner.meta, runner.tok, runner.graphs, runner._logits, runner.pool = (
        torch.device("cpu"), {}, {}, {}, {}, None)
    logits = torch.zeros(6, 5)
    runner._body = _body(rec, logits)
    runner._capture((2, 3))
    _check(rec)
    assert (2, 3) in runner.graphs and runner._logits[(2, 3)] is logits and runner.pool is not None
    assert [e for e in rec.events if e[0] == "body"][:2] == [("body", True), ("body", True)]   # warm-up, before


def test_decode_capture_collects_no_garbage_while_capturing(monkeypatch, collector_on):
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)
    dg = object.__new__(graphs.DecodeGraphs)
    dg.meta, dg.tok = {2: torch.zeros(4, dtype=torch.int64)}, torch.zeros(2, dtype=torch.int64)
    dg.graphs, dg.pool = {}, None
    dg._body = _body(rec, None)
    dg._capture(2)
    _check(rec)
    assert 2 in dg.graphs


def test_prefill_capture_collects_no_garbage_while_capturing(monkeypatch, collector_on):
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)

    class Model:
        device = torch.device("cpu")

        def prepare(self, sb, bank):
            return sb

        forward = staticmethod(_body(rec, torch.zeros(1, 5)))

    pg = PrefillGraphs(Model(), bank=None, capture=True)
    pg.capture = True                               # as on CUDA
    pg._keep(((0, 3, 0),), sb="batch")
    _check(rec)
    assert pg.kept[((0, 3, 0),)]["graph"] is not None and pg.captures == 1


def test_capture_restores_the_collectors_state_also_on_error(monkeypatch):
    rec = _Recorder()
    _fake_cuda(monkeypatch, rec)
    was = gc.isenabled()
    try:
        gc.enable()
        with pytest.raises(RuntimeError):
            with graphs.capture(torch.cuda.CUDAGraph()):
                assert not gc.isenabled()
                raise RuntimeError("capture failed")
        assert gc.isenabled()
        gc.disable()                                # a caller that runs with the collector off keeps it off
        with graphs.capture(torch.cuda.CUDAGraph()):
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
        gc.collect()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_verify_and_decode_captures_survive_a_stray_graph_becoming_garbage(monkeypatch, collector_on):
    """bf16, CUDA graphs, spec_scripted.json (the failing test's trace): every capture begins by making a cycle that
    holds a real captured CUDAGraph unreachable, the collector at threshold 1 while capturing; the run captures and
    replays its decode and verify graphs and keeps the tokens and logs of the eager padded run."""
    from fastpath import Engine, FastModel
    from oracle import zoo
    from oracle.trace import load_trace

    real_graph = torch.cuda.graph

    def stray_graph() -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        x = torch.zeros(4, device="cuda")
        with real_graph(g):
            x.add_(1)
        return g

    strays = {"made": 0}

    class Graph(real_graph):
        def __enter__(self):
            cycle = {"graph": stray_graph()}         # captured before this capture begins
            cycle["self"] = cycle
            super().__enter__()
            self.thresholds = gc.get_threshold()
            gc.set_threshold(1, 1, 1)                # while capturing, any container allocated may collect
            del cycle                                # garbage from now on, while the stream captures
            strays["made"] += 1
            for _ in range(64):
                [[] for _ in range(4)]

        def __exit__(self, *exc):
            gc.set_threshold(*self.thresholds)
            return super().__exit__(*exc)

    monkeypatch.setattr(torch.cuda, "graph", Graph)
    cfg = zoo.tiny_config("bamba", pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2,
                          n_kv_heads=1)
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=3), "cuda", torch.bfloat16)
    trace = load_trace(TRACES / "spec_scripted.json")
    eng = Engine(fast, trace.engine, max_len=64, graphs=True)
    got = eng.run_trace(trace, "legacy")
    ref = Engine(fast, trace.engine, max_len=64, graphs=False, pad_decode=True).run_trace(trace, "legacy")
    assert strays["made"] > 0 and eng.spec.runner.replays > 0
    assert got.tokens == ref.tokens and got.schedule_log.to_json() == ref.schedule_log.to_json()
