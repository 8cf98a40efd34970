"""Prefill graphs (fastpath/engine/prefill_graphs.py): a repeated short prefill-only step shape (a prefix-cache
hit's suffix) reuses its kept batch — replayed as a CUDA graph on the GPU — and cache on with prefill graphs ==
cache off without them, bitwise (tokens and logits)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.batch_invariant import run_recording_logits  # noqa: E402
from oracle import zoo  # noqa: E402
from fastpath.engine.validate import ArgumentError  # noqa: E402
from oracle.trace import EngineConfig, PrefixCacheConfig, Request, Trace  # noqa: E402

HYBRID = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)


def _model(device="cpu", dtype=torch.float32) -> FastModel:
    cfg = zoo.tiny_config("bamba", **HYBRID)
    return FastModel(cfg, zoo.random_weights(cfg, seed=3), device, dtype)


def _trace(prefix: tuple[int, ...], suffixes: list[tuple[int, ...]], block: int, chunk: int, new: int,
           cache: bool) -> Trace:
    """One request after another (R = 1), each the shared prefix + its own suffix (all of one length)."""
    reqs = tuple(Request(f"r{i}", 6 * i, prefix + s, new) for i, s in enumerate(suffixes))
    return Trace(EngineConfig(1, chunk, chunk, "legacy", prefix_cache=PrefixCacheConfig(block, 2) if cache else None),
                 reqs)


def _hits(result) -> list[int]:
    return [a["cached_tokens"] for s in result.schedule_log.to_json()["steps"] for a in s["admit"]]


def _same(on, off) -> None:
    assert on[0].tokens == off[0].tokens
    assert sorted(on[1]) == sorted(off[1])
    bad = {k: (on[1][k] - off[1][k]).abs().max().item() for k in on[1] if not torch.equal(on[1][k], off[1][k])}
    assert not bad, f"logits rows differ (cache on + prefill graphs vs cache off): {bad}"


def _check(model: FastModel, prefix: tuple[int, ...], block: int, chunk: int, graphs: bool, n_req: int,
           new: int) -> Engine:
    suffixes = [tuple(20 + (3 * i + j) % 40 for j in range(3)) for i in range(n_req)]
    on_t, off_t = (_trace(prefix, suffixes, block, chunk, new, c) for c in (True, False))
    max_len = len(prefix) + 3 + new
    on_e = Engine(model, on_t.engine, max_len=max_len, graphs=graphs, prefill_graphs=True)
    on = run_recording_logits(on_e, on_t, "legacy")
    off = run_recording_logits(Engine(model, off_t.engine, max_len=max_len, graphs=graphs), off_t, "legacy")
    assert _hits(on[0]) == [0] + [len(prefix)] * (n_req - 1)
    _same(on, off)
    return on_e


def test_repeated_hit_step_reuses_its_kept_batch_and_stays_bitwise_cache_off():
    """CPU (interpreter, fp32): 3 one-token requests, 16-token prefix, block 8: the cold request's last piece
    (16, 3) and the two hits' pieces are one shape, so the second hit reuses the kept batch (its ids copied in);
    tokens and logits == the cache-off run without prefill graphs (stale ids would give other logits)."""
    eng = _check(_model(), tuple(16 + (7 * i + 3) % 48 for i in range(16)), 8, 8, graphs=False, n_req=3, new=1)
    pg = eng.prefill_graphs
    assert pg.reuses == 1 and pg.replays == pg.captures == 0 and list(pg.kept) == [((16, 3, 0),)]


def test_only_short_prefill_only_steps_without_checkpoints_are_kept_and_at_most_max_graphs_of_them():
    """key(): decode rows, a checkpoint inside a piece or more than max_tokens tokens -> not taken (None); kept
    shapes are LRU-bounded, an evicted one must be seen twice again (a stand-in model; no kernels run)."""
    from fastpath.engine.prefill_graphs import PrefillGraphs

    class Stub:
        device, calls = torch.device("cpu"), 0

        def forward(self, sb, bank):
            Stub.calls += 1
            return sb.ids.clone()
    pg = PrefillGraphs(Stub(), None, max_tokens=8, max_graphs=2)
    assert pg.key(1, [(0, 4, 0)], [], 5) is None and pg.key(0, [(0, 4, 0)], [(0, 2, 3)], 4) is None
    assert pg.key(0, [(0, 9, 0)], [], 9) is None and pg.key(0, [], [], 0) is None
    keys = [pg.key(0, [(8 * i, 4, 0)], [], 4) for i in range(3)]

    def step(k, ids):
        return pg.forward(k, ids, lambda: type("SB", (), {"ids": torch.tensor(ids)})()).tolist()
    for k in keys:                                     # first and second sight: eager (kept after the second)
        assert step(k, [1, 2, 3, 4]) == step(k, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert list(pg.kept) == keys[1:] and Stub.calls == 6
    assert step(keys[2], [5, 6, 7, 8]) == [5, 6, 7, 8] and pg.reuses == 1     # the kept batch, new ids copied in
    assert step(keys[0], [9, 9, 9, 9]) == [9, 9, 9, 9] and list(pg.kept) == keys[1:]   # evicted: seen anew
    assert step(keys[0], [9, 9, 9, 9]) == [9, 9, 9, 9] and list(pg.kept) == [keys[2], keys[0]]   # LRU: keys[1] out


def test_prefill_graphs_flag_is_checked():
    """prefill_graphs must be a bool (named in the error)."""
    with pytest.raises(ArgumentError, match="prefill_graphs"):
        Engine(_model(), EngineConfig(1, 8, 8, "legacy"), max_len=32, prefill_graphs=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_prefix,block,chunk", [(16, 8, 8), (2048, 1024, 1024)], ids=["short", "split-keys"])
def test_prefill_graph_replay_equals_cache_off_bitwise_bf16(n_prefix, block, chunk):
    """GPU bf16, decode graphs on too: the hit step is captured on its second sight and replayed for the third and
    fourth request; == cache off (no prefill graphs) bitwise. split-keys: a 2048-token prefix, so the replayed
    attention splits over the keys (its plan and workspace are the kept batch's)."""
    prefix = tuple(16 + (5 * i + 1) % 48 for i in range(n_prefix))
    eng = _check(_model("cuda", torch.bfloat16), prefix, block, chunk, graphs=True, n_req=4, new=3)
    pg = eng.prefill_graphs
    assert pg.captures == 1 and pg.replays == 2 == pg.reuses
