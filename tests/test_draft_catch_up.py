"""The draft proposer's catch-up through its graphs (fastpath/engine/draft.py): a short catch-up (the accepted
drafts and the bonus) runs as one decode-graph replay or one catch-up forward instead of a packed prefill, and
proposes exactly what the prefill catch-up proposes, and what a draft state built from scratch on the accepted tokens
proposes, under every acceptance pattern; the engine with it keeps the oracle's log on the shipped draft trace."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.engine.draft import DraftModel, DraftRow  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.scheduler import run_trace as oracle_run  # noqa: E402
from oracle.trace import load_trace  # noqa: E402

TRACES = Path(__file__).parent.parent / "goldens" / "traces"
from test_speculative_verify import models  # noqa: E402,F401  (the engine-test models fixture)
K, R, MAX_LEN = 3, 3, 64


def _draft_model(backend: str = "torch", device: str = "cpu", dtype=torch.float32) -> FastModel:
    """A tiny Mamba/attention/Mamba draft (chunk 8, so prompts span chunks)."""
    cfg = zoo.tiny_config("bamba")
    return FastModel(cfg, zoo.random_weights(cfg, seed=5), device, dtype, FastOptions(backend=backend))


def _proposers(model: FastModel, full: bool = True, graphs: str = "eager") -> dict[str, DraftModel]:
    """The graph catch-up, the prefill catch-up through the same buckets, and (full) no graphs at all (exact
    shapes)."""
    graph, prefill = DraftModel(model, R, MAX_LEN, graphs, K), DraftModel(model, R, MAX_LEN, graphs, K)
    prefill.short_catch_up = False
    return {"graph": graph, "prefill": prefill} | ({"no_graphs": DraftModel(model, R, MAX_LEN, None, K)} if full
                                                   else {})


def _from_scratch(model: FastModel, row: DraftRow) -> list[int]:
    """The drafts of a fresh draft state built by one prefill of the row's accepted tokens (no history)."""
    return DraftModel(model, R, MAX_LEN, None, K).propose([row])[row.rid]


# how many of its drafts a request accepts at each step, cycling ("all": every one, then the bonus)
PATTERNS = {"full": ("all",), "first_rejected": (0,), "mixed": (1, "all", 0, 2), "short_room": ("all", 0)}


def _drive(model: FastModel, steps: int, seed: int, props: dict[str, DraftModel], scratch: bool = True) -> dict:
    """A decode loop over R slots: each step every decoding request gets drafts from every proposer in `props` (they
    must agree with each other and, with `scratch`, with a from-scratch draft state), then its output grows by the
    accepted drafts and a bonus token (a wrong one where a draft is rejected); finished requests free their slot for
    the next, whose first pass is a prefill. Returns what the loop went through."""
    rng = random.Random(seed)
    V = model.config.vocab_size
    queue = [(f"r{i}", name) for i, name in enumerate(["full", "first_rejected", "mixed", "short_room", "full",
                                                        "mixed", "first_rejected"])]
    live: dict[int, tuple] = {}
    seen = {"passes": 0, "mixed_lengths": 0, "room_lt_k_continued": 0, "slot_reused": 0, "finished": 0}
    used_slots: set[int] = set()
    for step in range(steps):
        for slot in range(R):
            if slot not in live and queue:
                rid, name = queue.pop(0)
                seen["slot_reused"] += slot in used_slots
                used_slots.add(slot)
                prompt = [rng.randrange(3, V) for _ in range(rng.randrange(5, 19))]
                max_new = 7 if name == "short_room" else rng.randrange(9, 16)
                live[slot] = (rid, name, prompt, [rng.randrange(3, V)], max_new)    # the prefill's first token
        if not live:
            break
        rows = [DraftRow(rid, slot, prompt, out, min(K, mx - len(out))) for slot, (rid, _, prompt, out, mx)
                in sorted(live.items())]
        got = {name: p.propose(rows) for name, p in props.items()}
        assert all(g == got["graph"] for g in got.values()), (step, got)
        for row in rows if scratch else ():
            assert got["graph"][row.rid] == _from_scratch(model, row), (step, row.rid)
        seen["passes"] += 1
        news = set()
        for slot, (rid, name, prompt, out, mx) in list(live.items()):
            drafts, room = got["graph"][rid], min(K, mx - len(out))
            rule = PATTERNS[name][step % len(PATTERNS[name])]
            a = room if rule == "all" else min(rule, room)
            bonus = rng.randrange(3, V)
            if a < room:
                bonus = (drafts[a] + 1 + rng.randrange(V - 1)) % V            # anything but the next draft
            new = drafts[:a] + [bonus]
            out.extend(new[:mx - len(out)])
            news.add(len(new))
            if len(out) >= mx:
                del live[slot]
                seen["finished"] += 1
            elif room < K:
                seen["room_lt_k_continued"] += 1
        seen["mixed_lengths"] += len(news) > 1
    seen["catch_ups"] = dict(props["graph"].catch_ups)
    seen["forward_widths"] = sorted({w for _, w in props["graph"].catch_up.runs})
    return seen


def test_graph_catch_up_proposes_what_the_prefill_catch_up_and_a_fresh_state_propose():
    """Full acceptance (k+1 new tokens), first-draft rejection (1), partial acceptance, rows of different catch-up
    lengths in one pass (right-aligned replays), rows with room < k that go on, finished requests whose slot the next
    request reuses: the drafts of every pass are equal token for token across the three catch-ups and equal to the
    drafts of a draft state built from scratch on the accepted tokens (so no pass leaves its drafting in the state)."""
    model = _draft_model()
    seen = _drive(model, steps=24, seed=0, props=_proposers(model))
    assert seen["passes"] >= 12 and seen["finished"] >= 4 and seen["slot_reused"] >= 2, seen
    assert seen["mixed_lengths"] >= 3 and seen["room_lt_k_continued"] >= 1, seen
    assert seen["catch_ups"]["graph"] >= 20 and seen["catch_ups"]["prefill"] >= 7, seen
    assert seen["forward_widths"] == [2, 3, 4], seen          # catch-ups of 2..k+1 tokens: one forward each


def test_graph_catch_up_on_the_triton_kernels_proposes_what_the_prefill_catch_up_proposes():
    """The graph and prefill catch-ups agree through the Triton kernels too (the interpreter on CPU), a few passes."""
    model = _draft_model("triton")
    seen = _drive(model, steps=2, seed=1, props=_proposers(model, full=False), scratch=False)
    assert seen["catch_ups"]["graph"] >= 3 and seen["mixed_lengths"] >= 1, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_catch_up_replays_propose_what_the_eager_padded_buckets_propose():
    """bf16 on CUDA: the catch-up and drafting steps as captured CUDA graphs propose, pass for pass, exactly what the
    same buckets run eagerly propose (the graphs' bitwise reference), under every acceptance pattern of the CPU test;
    the graphs were replayed."""
    model = _draft_model("triton", "cuda", torch.bfloat16)
    captured, eager = DraftModel(model, R, MAX_LEN, "capture", K), DraftModel(model, R, MAX_LEN, "eager", K)
    seen = _drive(model, steps=16, seed=0, props={"graph": captured, "eager": eager}, scratch=False)
    assert seen["catch_ups"]["graph"] >= 20 and seen["mixed_lengths"] >= 3, seen
    assert captured.graphs.capture and captured.graphs.replays >= seen["catch_ups"]["graph"] // R


def test_draft_state_is_forgotten_for_requests_no_longer_decoding():
    """A pass's rows are every decoding request: the state of any other (finished) request is dropped, so `seen`
    does not grow with the requests served."""
    model = _draft_model()
    d = DraftModel(model, R, MAX_LEN, "eager", K)
    a, b = DraftRow("a", 0, [5, 6, 7], [8], K), DraftRow("b", 1, [9, 10], [11], K)
    d.propose([a, b])
    assert set(d.seen) == {"a", "b"}
    d.propose([DraftRow("c", 0, [12, 13], [14], K), b])
    assert set(d.seen) == {"c", "b"}
    d.propose([])
    assert d.seen == {}


@pytest.mark.parametrize("device_drafts", [False, True], ids=["host-drafts", "device-drafts"])
def test_engine_with_graph_catch_up_keeps_the_oracles_log_on_the_draft_trace(models, device_drafts):
    """spec_draft.json with pad_decode (the graphs' buckets, eager on CPU), legacy and async: log (proposals
    included) and tokens == the oracle's and == the prefill catch-up's run; short catch-ups went through the graphs."""
    oracle_model, fast = models
    fast = fast.with_options(spec_device_drafts=device_drafts)
    trace = load_trace(TRACES / "spec_draft.json")
    for mode in ("legacy", "async"):
        eng = Engine(fast, trace.engine, max_len=32, pad_decode=True)
        got = eng.run_trace(trace, mode)
        want = oracle_run(oracle_model, trace, mode)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
        assert got.schedule_log.to_json() == want.schedule_log.to_json(), mode
        assert eng.spec.draft.catch_ups["graph"] > 0 and eng.spec.draft.catch_ups["prefill"] > 0
        assert (eng.spec.device_drafts is not None) == device_drafts
        eng.spec.draft.short_catch_up = False
        ref = eng.run_trace(trace, mode)
        assert ref.schedule_log.to_json() == got.schedule_log.to_json()
