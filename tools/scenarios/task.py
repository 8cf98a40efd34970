"""The synthetic task of the trained tiny model: sort a digit string.

    prompt = [BOS] d_1 … d_n [SEP]          n ∈ [MIN_DIGITS, MAX_DIGITS], digits uniform 0-9
    answer = sorted(d_1 … d_n) [EOS]

With n = 16…20 the prompt is 18-22 tokens (more than two SSD chunks of 8) and the answer 17-21 tokens,
so chunked prefill and long decodes both matter. Examples are a pure function of (seed, index): the
training stream uses the run's seed, the held-out set `HELDOUT_SEED` (a different stream).
An answer is correct only if the greedy output equals it exactly, EOS included.
The *margin* at a generated position is the gap between the top-1 and top-2 logits there.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0 = 4                      # token id of digit 0; digit k is DIGIT0 + k
VOCAB_SIZE = 16                 # PAD BOS EOS SEP + 10 digits, rounded up to 16
MIN_DIGITS, MAX_DIGITS = 16, 20
HELDOUT_SEED = 1_000_003        # the held-out stream; training seeds must differ from it


@dataclass(frozen=True)
class Example:
    """One prompt and its exact expected answer (token ids; the answer ends with EOS)."""
    prompt: tuple[int, ...]
    answer: tuple[int, ...]


def make_example(rng: random.Random) -> Example:
    """Draw one sorting example from `rng`."""
    n = rng.randint(MIN_DIGITS, MAX_DIGITS)
    digits = [rng.randrange(10) for _ in range(n)]
    prompt = (BOS, *(DIGIT0 + d for d in digits), SEP)
    answer = (*(DIGIT0 + d for d in sorted(digits)), EOS)
    return Example(prompt, answer)


def make_examples(seed: int, count: int) -> list[Example]:
    """The first `count` examples of the stream `seed` (deterministic in (seed, count))."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(count)]


def heldout(count: int = 500) -> list[Example]:
    """The held-out evaluation set (the first `count` examples of the HELDOUT_SEED stream)."""
    return make_examples(HELDOUT_SEED, count)


def max_new_tokens(example: Example) -> int:
    """Decode budget for an example: the answer length (a correct model stops exactly there)."""
    return len(example.answer)


def exact_match(answer: Sequence[int], output: Sequence[int]) -> bool:
    """True iff the generated tokens equal the expected answer exactly (EOS included)."""
    return tuple(output) == tuple(answer)


def accuracy(examples: Sequence[Example], outputs: Sequence[Sequence[int]]) -> float:
    """Fraction of examples whose output is an exact match."""
    if len(examples) != len(outputs):
        raise ValueError(f"accuracy: {len(examples)} examples but {len(outputs)} outputs")
    if not examples:
        raise ValueError("accuracy: no examples")
    return sum(exact_match(e.answer, o) for e, o in zip(examples, outputs)) / len(examples)


def top2_margin(logits: Tensor) -> Tensor:
    """logits [..., V] -> top-1 minus top-2 logit [...] (0 at an exact tie)."""
    top = torch.topk(logits.to(torch.float64), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def margin_stats(margins: Sequence[float]) -> dict[str, float]:
    """Summary of per-position margins: count, min, 1st percentile, median, mean."""
    if not margins:
        raise ValueError("margin_stats: no margins")
    s = sorted(float(m) for m in margins)
    p01 = s[min(len(s) - 1, int(0.01 * len(s)))]
    return {"count": len(s), "min": s[0], "p01": p01, "median": statistics.median(s),
            "mean": statistics.fmean(s)}


class StepModel(Protocol):
    """The oracle's per-request API (DESIGN §10): prefill a prompt, then decode token by token."""

    def prefill(self, tokens: list[int], state=None) -> tuple[Tensor, object]: ...

    def decode(self, token: int, state) -> tuple[Tensor, object]: ...


def greedy_generate(model: StepModel, prompt: Sequence[int], max_new: int,
                    stop: int = EOS) -> tuple[list[int], list[float]]:
    """Greedy decode with the oracle API; returns (tokens, per-token top-1/top-2 margins). Stops after `stop`."""
    logits, state = model.prefill(list(prompt))
    last = logits[-1]
    tokens: list[int] = []
    margins: list[float] = []
    for i in range(max_new):
        tok = int(torch.argmax(last))
        tokens.append(tok)
        margins.append(float(top2_margin(last)))
        if tok == stop or i == max_new - 1:
            break
        last, state = model.decode(tok, state)
    return tokens, margins


def evaluate(model: StepModel, examples: Sequence[Example]) -> dict[str, object]:
    """Greedy exact-answer accuracy and margin statistics of `model` on `examples` (oracle API)."""
    outputs, margins = [], []
    for ex in examples:
        toks, ms = greedy_generate(model, ex.prompt, max_new_tokens(ex))
        outputs.append(toks)
        margins.extend(ms)
    return {"n": len(examples), "accuracy": accuracy(examples, outputs),
            "margins": margin_stats(margins), "outputs": outputs}
