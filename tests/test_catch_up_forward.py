"""The draft's catch-up forward (fastpath/engine/catch_up.py): rows of 1..W new tokens right-aligned in one
verify-shaped batch leave the state a packed prefill of the same tokens leaves and sample its next token, touch no
slot outside the batch, and name the bound a catch-up outside its buckets breaks."""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import FastModel  # noqa: E402
from fastpath.engine.catch_up import CatchUp  # noqa: E402
from fastpath.engine.draft import DraftModel, DraftRow  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import zoo  # noqa: E402

R, MAX_LEN, W = 4, 96, 9


def _model(backend: str) -> FastModel:
    cfg = zoo.tiny_config("bamba")
    return FastModel(cfg, zoo.random_weights(cfg, seed=7), "cpu", torch.float32, FastOptions(backend=backend))


def _prefilled(model: FastModel, prompts: list[list[int]], slots: list[int], width: int = W) -> DraftModel:
    """A draft (widest catch-up `width`) whose bank holds each prompt in its slot (one packed prefill), the free
    slot filled with noise."""
    d = DraftModel(model, R, MAX_LEN, "eager", k=width - 1)
    g = torch.Generator().manual_seed(1)
    for t in (d.bank.conv_state, d.bank.ssm_state, d.bank.k_cache, d.bank.v_cache):
        t.copy_(torch.randn(t.shape, generator=g))
    d._prefill_catch_up([DraftRow(f"r{j}", s, p, [], 0) for j, (p, s) in enumerate(zip(prompts, slots))],
                        [0] * len(prompts))
    return d


@pytest.mark.parametrize("backend,lengths,width,bucket", [("torch", (1, 6, 2), W, 9), ("triton", (1, 6, 2), W, 9),
                                                          ("torch", (40, 65, 3), 70, 65)],
                         ids=["torch-9", "triton-9", "torch-65"])
def test_catch_up_forward_leaves_the_state_and_token_a_packed_prefill_of_the_same_tokens_leaves(backend, lengths,
                                                                                                  width, bucket):
    """Three rows of new tokens (1, 6, 2: width bucket 9; 40, 65, 3: bucket 65 of the widths up to 70), right-aligned
    (slot -1 before each row's first token), in slots 2, 0, 3: every Mamba layer's conv window and SSM state, the
    K/V at the new positions and the next greedy token equal the packed prefill's (fp32); slot 1, in no row, is
    bitwise untouched."""
    model = _model(backend)
    rng = random.Random(0)
    V = model.config.vocab_size
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in (11, 5, 9)]
    slots = [2, 0, 3]
    new = [[rng.randrange(3, V) for _ in range(n)] for n in lengths]
    fwd, ref = _prefilled(model, prompts, slots, width), _prefilled(model, prompts, slots, width)
    untouched = [t[:, 1].clone() for t in (fwd.bank.conv_state, fwd.bank.ssm_state)]
    tok = fwd.catch_up.run(new, [len(p) for p in prompts], slots)
    assert fwd.catch_up.runs == {(4, bucket): 1} and fwd.catch_up.widths[-1] == width
    want = ref._prefill_catch_up([DraftRow(f"r{j}", s, p, list(x), 0) for j, (p, s, x) in
                                  enumerate(zip(prompts, slots, new))], [len(p) for p in prompts])
    assert tok.tolist() == want.tolist()
    for a, b in ((fwd.bank.conv_state, ref.bank.conv_state), (fwd.bank.ssm_state, ref.bank.ssm_state)):
        torch.testing.assert_close(a[:, slots], b[:, slots], rtol=1e-4, atol=1e-5)
    for p, s, x in zip(prompts, slots, new):
        at = slice(len(p), len(p) + len(x))
        for a, b in ((fwd.bank.k_cache, ref.bank.k_cache), (fwd.bank.v_cache, ref.bank.v_cache)):
            torch.testing.assert_close(a[:, s, at], b[:, s, at], rtol=1e-4, atol=1e-5)
    for before, t in zip(untouched, (fwd.bank.conv_state, fwd.bank.ssm_state)):
        assert torch.equal(before, t[:, 1])


def test_catch_up_outside_its_buckets_is_an_error_naming_the_bound():
    """More rows than the bank, one token (a decode replay's job) or more than W tokens: a ValueError saying which."""
    model = _model("torch")
    c = CatchUp(model, DraftModel(model, R, MAX_LEN, None).bank, R, W, capture=False)
    assert c.widths == [2, 3, 5, 9]
    with pytest.raises(ValueError, match="2..9 tokens"):
        c.run([[5] * 10], [3], [0])
    with pytest.raises(ValueError, match="2..9 tokens"):
        c.run([[5]], [3], [0])
    with pytest.raises(ValueError, match="4 rows"):
        c.run([[5, 6]] * 5, [3] * 5, [0, 1, 2, 3, 0])
    with pytest.raises(ValueError, match="needs >= 2"):
        CatchUp(model, c.bank, R, 1, capture=False)
