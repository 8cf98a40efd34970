"""The device ngram proposer (fastpath/engine/ngram_device.py) == the oracle's prompt lookup (oracle.speculative.
ngram_propose, DESIGN §13) on hypothesis-generated token histories: which n, which earlier match (the most recent),
fewer than k or none; rows batched with stale tokens past each row's length, as in the engine's history."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from fastpath.engine.ngram_device import TokenHistory, ngram_device
from oracle.speculative import ngram_propose

ROW = st.tuples(st.lists(st.integers(0, 3), max_size=24), st.integers(0, 6))     # (tokens, room) ; small alphabet


def _check(rows: list[tuple[list[int], int]], k: int, lo: int, hi: int, width: int, junk: int) -> None:
    g = torch.Generator().manual_seed(junk)
    hist = torch.randint(0, 4, (len(rows), width), generator=g, dtype=torch.int64)     # stale tokens past L
    for r, (toks, _) in enumerate(rows):
        hist[r, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
    L = torch.tensor([len(t) for t, _ in rows], dtype=torch.int64)
    room = torch.tensor([min(rm, k) for _, rm in rows], dtype=torch.int64)
    drafts, m = ngram_device(hist, L, room, k, lo, hi)
    assert drafts.shape == (len(rows), k) and m.shape == (len(rows),)
    for r, (toks, rm) in enumerate(rows):
        want = ngram_propose(toks, min(rm, k), lo, hi) if min(rm, k) else []
        got = drafts[r, :int(m[r])].tolist()
        assert got == want, (toks, rm, k, lo, hi, got, want)
        assert drafts[r, int(m[r]):].eq(0).all()


@settings(max_examples=250, deadline=None, derandomize=True)
@given(rows=st.lists(ROW, min_size=1, max_size=4), k=st.integers(1, 6), lo=st.integers(1, 4), span=st.integers(0, 3),
       extra=st.integers(0, 5), junk=st.integers(0, 2**16))
def test_device_ngram_equals_the_oracles_prompt_lookup(rows, k, lo, span, extra, junk):
    """Batched rows of every length (0, 1, full width), n ranges past the lengths, rooms below k and 0."""
    width = max(len(t) for t, _ in rows) + extra
    if width == 0:
        width = 1
    _check(rows, k, lo, lo + span, width, junk)


def test_device_ngram_picks_the_longest_n_then_the_most_recent_match():
    """Hand cases: longest n wins over a more recent shorter match; the latest of several matches; a match right
    before the suffix (one draft, fewer than k); no match; the length-1 history."""
    cases = [([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3, 1, 3, [9, 2, 3]),       # n=3 at i=0 beats n=2 at i=4
             ([5, 1, 5, 2, 5, 3, 5], 2, 1, 1, [3, 5]),                   # latest 5 is at i=4
             ([4, 4], 3, 1, 2, [4]),                                       # match at i=0, one token follows
             ([1, 2, 3], 2, 1, 2, []), ([7], 2, 1, 1, [])]
    for toks, k, lo, hi, want in cases:
        assert ngram_propose(toks, k, lo, hi) == want
        _check([(toks, k)], k, lo, hi, len(toks) + 2, 0)


def test_token_history_catch_up_writes_only_new_tokens():
    """The history writes each request's tokens once (then only the new ones), per slot; a reset starts over."""
    h = TokenHistory(3, 8, torch.device("cpu"))
    h.catch_up([("a", 2, [1, 2, 3]), ("b", 0, [4])])
    h.hist[2, 0] = 99                                      # already synced: never rewritten
    h.catch_up([("a", 2, [1, 2, 3, 5, 6]), ("b", 0, [4])])
    assert h.hist[2, :5].tolist() == [99, 2, 3, 5, 6] and h.hist[0, 0] == 4 and h.synced == {"a": 5, "b": 1}
    h.reset()
    h.catch_up([("a", 2, [1])])
    assert h.hist[2, 0] == 1 and h.fits(8) and not h.fits(9)
    d, m = h.propose(torch.tensor([2]), torch.tensor([5]), torch.tensor([2]), 2, 1, 2)
    assert (d.tolist(), m.tolist()) == ([[0, 0]], [0])     # [1,2,3,5,6]: no earlier 6 nor (5,6)
