"""A model's units for scenarios (chunk size, vocab, special ids) and the token map a scenario writes through.

A scenario names its prompt and stop tokens as *literal* ids of a 64-id alphabet (the shipped corpus' ids). When
every literal id a scenario uses is below the model's vocab_size they are kept as they are (so the shipped
concrete traces come out byte for byte); otherwise the scenario is rebuilt with its ids *folded* onto the model's
ordinary ids (every id below vocab_size that is not bos/eos/pad): literal t -> ordinary[t % len(ordinary)].
Special ids are used only where a scenario asks for them by role (`Units.eos`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from oracle.trace import model_positions

ALPHABET = 64            # literal ids of the corpus are < 64
MIN_ORDINARY = 4         # fewer ordinary ids than this and folded prompts say nothing


class Skip(Exception):
    """Raised by a scenario builder that cannot be instantiated for a model; the message is the reason."""


class ScenarioError(ValueError):
    """A scenario or its inputs are wrong (unknown name, config without the fields a scenario needs)."""


def _special(extra: dict, key: str, vocab: int) -> tuple[int, ...]:
    """The ids under an HF special-token key (int, list of ints or absent), kept only when inside the vocab."""
    v = extra.get(key)
    ids = v if isinstance(v, list) else [v]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab)


@dataclass(frozen=True)
class Units:
    """What a scenario reads from a model: chunk_size C, vocab_size V, the special ids the config names, d_conv."""
    chunk: int
    vocab: int
    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    specials: tuple[int, ...] = ()
    d_conv: int = 4                 # the Mamba conv width (last pieces 1..d_conv: tools/scenarios/boundaries.py)
    granularities: tuple[int, ...] = ()   # the engine's declared piece rule (Capabilities.piece_granularities)
    positions: int | None = None    # max_position_embeddings when the config declares one
    rule: object | None = None      # the engine's scenarios.step_rule.StepRule (Capabilities.step_rule,
                                    # --engine-budget); None: ours

    @classmethod
    def from_config(cls, config) -> "Units":
        """From an oracle HybridConfig (its `extra` holds the HF bos/eos/pad ids)."""
        for name in ("chunk_size", "vocab_size"):
            v = getattr(config, name, None)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ScenarioError(f"config.{name}: must be an integer >= 1, got {v!r}")
        extra = getattr(config, "extra", None) or {}
        ids = {k: _special(extra, f"{k}_token_id", config.vocab_size) for k in ("bos", "eos", "pad")}
        specials = tuple(sorted({i for v in ids.values() for i in v}))
        d_conv = getattr(config, "mamba_d_conv", 4)
        d_conv = d_conv if isinstance(d_conv, int) and not isinstance(d_conv, bool) and d_conv >= 1 else 4
        return cls(config.chunk_size, config.vocab_size, *(v[0] if v else None for v in ids.values()),
                   specials=specials, d_conv=d_conv, positions=model_positions(config))

    @property
    def ordinary(self) -> list[int]:
        """Token ids below vocab_size that are not special, ascending."""
        sp = set(self.specials)
        return [i for i in range(self.vocab) if i not in sp]


class Tokens:
    """Literal scenario ids -> the model's ids: identity, or folded onto the ordinary ids (module docstring)."""

    def __init__(self, units: Units, folding: bool):
        self.units, self.folding = units, folding
        self.max_literal = -1
        self._ord = units.ordinary
        if folding and len(self._ord) < MIN_ORDINARY:
            raise Skip(f"vocab_size {units.vocab} leaves {len(self._ord)} ordinary token ids "
                       f"(< {MIN_ORDINARY}) to fold the scenario's ids onto")

    def __call__(self, ids: Iterable[int]) -> list[int]:
        """Map a list of literal ids, order and repeats kept (for a stop-id set use `stops`)."""
        ids = list(ids)
        for t in ids:
            if not 0 <= t < ALPHABET:
                raise ScenarioError(f"literal token id {t} outside the scenario alphabet [0, {ALPHABET})")
        self.max_literal = max([self.max_literal, *ids])
        return [self._ord[t % len(self._ord)] for t in ids] if self.folding else ids

    def stops(self, ids: Iterable[int]) -> list[int]:
        """A stop-id set: mapped, repeats dropped (first occurrence kept)."""
        return list(dict.fromkeys(self(ids)))


def seq(start: int, n: int, step: int = 3, mod: int = 61) -> list[int]:
    """The corpus' prompt pattern: n literal ids start, start+step, ... modulo `mod`."""
    return [(start + step * j) % mod for j in range(n)]


def build_with_tokens(builder: Callable[[Units, Tokens], dict], units: Units) -> tuple[dict, bool]:
    """Run a builder with literal ids; if they do not all fit the vocab, run it again folded. -> (obj, folded)."""
    tok = Tokens(units, folding=False)
    obj = builder(units, tok)
    if tok.max_literal < units.vocab:
        return obj, False
    return builder(units, Tokens(units, folding=True)), True


def request(rid: str, arrival: int, prompt: list[int], max_new: int, stops: list[int] | None = None,
            sampling: dict | None = None) -> dict:
    """One request's JSON."""
    return {"id": rid, "arrival_step": arrival, "prompt": list(prompt), "max_new_tokens": max_new,
            "stop_token_ids": list(stops or []), "sampling": sampling or {"kind": "greedy"}}


def seeded(temperature: float, seed: int) -> dict:
    """Seeded sampling JSON."""
    return {"kind": "seeded", "temperature": temperature, "seed": seed}


def trace(description: str, max_requests: int, budget: int, prefill_chunk: int, mode: str,
          requests: list[dict]) -> dict:
    """A trace JSON object."""
    return {"schema": "hybridqual.trace/1", "description": description,
            "engine": {"max_requests": max_requests, "max_tokens_per_step": budget, "prefill_chunk": prefill_chunk,
                       "mode": mode},
            "requests": requests}
