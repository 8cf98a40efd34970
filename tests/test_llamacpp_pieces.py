"""The llama.cpp worker reports the prompt pieces it ran, step by step, so qualify's shape line can see whether an
instance built under the adapter's step rule reached its short last pieces (default tier: a stand-in for llama.cpp)."""
from __future__ import annotations

from pathlib import Path

import oracle
from hybridqual.scenarios import plan as scenarios
from hybridqual.scenarios.step_rule import last_pieces, pieces_from_facts
from hybridqual.adapters.llamacpp.adapter import STEP_RULE
from llamacpp_standin import StandIn
from test_llamacpp_prefix_cache import _requests

MODELS = Path(__file__).resolve().parents[1] / "goldens" / "models"


def test_the_worker_reports_its_pieces_and_piece_tails_reaches_every_promised_last_piece():
    model_dir = MODELS / "zoo-mamba2"
    config = oracle.from_hf_config(model_dir / "config.json")
    inst = next(i for i in scenarios.instantiate(model_dir, config, ["piece_tails"], rule=STEP_RULE))
    trace, e = inst.trace, inst.trace.engine
    got = StandIn(config.vocab_size).run(_requests(trace), e.max_requests, e.max_tokens_per_step, e.prefill_chunk,
                                         config.chunk_size)
    prompts = {r.id: len(r.prompt) for r in trace.requests}
    pieces = pieces_from_facts([{"batches": [{"rows": rows}]} for rows in got["pieces"]], prompts)
    for rid, ps in pieces.items():                      # contiguous from 0 to the prompt's end
        assert [p.pos for p in ps] == [sum(q.count for q in ps[:i]) for i in range(len(ps))], rid
        assert sum(p.count for p in ps) == prompts[rid], rid
    assert set(dict(inst.shape["last_pieces"]).items()) <= set(last_pieces(pieces, prompts).items())
