"""Where qualify's truth comes from (DESIGN §15): the in-memory fp64 oracle, or the streamed one for a model
that does not fit.

    model, why = load_truth(folder, "auto", "cpu")    # auto: in memory when it fits, else streamed (and why)

In memory (`oracle.load`), the truth is the oracle's own generation (or the shipped golden) and the engine's
tokens are judged against it. Streamed (`oracle.streamed.StreamedOracle`: one layer's weights in memory), the
oracle does not generate: it scores the engine's own tokens teacher-forced in one streamed pass per instance, and
each must be the oracle's choice or within τ of it (compare.compare_tie_aware, the same rule); the schedule check
replays the oracle scheduler with the engine's tokens, which needs no model math (`ScheduleOnly`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

ORACLES = ("auto", "memory", "streamed")


class ScheduleOnly:
    """A model for the oracle scheduler replayed with forced tokens: config only, zero logits, no state. Every
    sampled token is forced, so the logits are never used; where the forced tokens run out (an engine output
    that breaks the finish rule) the replay samples from zeros and differs from the engine, as it must."""

    def __init__(self, config) -> None:
        self.config = config

    def prefill(self, tokens: Sequence[int], state=None):
        return torch.zeros(len(tokens), self.config.vocab_size), None

    def decode(self, token: int, state):
        return torch.zeros(self.config.vocab_size), None


class OnDevice:
    """An in-memory OracleModel on a GPU whose logits are handed back on CPU (states stay on the device), so the
    scheduler's sampler and the comparisons see CPU tensors."""

    def __init__(self, model) -> None:
        self.model, self.config = model, model.config

    def prefill(self, tokens: Sequence[int], state=None):
        logits, state = self.model.prefill(list(tokens), state)
        return logits.cpu(), state

    def decode(self, token: int, state):
        logits, state = self.model.decode(token, state)
        return logits.cpu(), state


class StreamedTruth:
    """A StreamedOracle as qualify's oracle model: teacher_forced_logits / prefetch (one streamed pass per batch of
    requests; CPU results), and prefill/decode by recomputing the whole sequence (exact, one streamed pass per
    call: slow, used only by the speculative acceptance recount and the prefix-cache policy check)."""
    streamed = True

    def __init__(self, path: Path, device: str = "cpu", why: str = "", use_goldens: bool = True) -> None:
        from oracle.streamed import StreamedOracle
        self.so = StreamedOracle(path, device=device)
        self.config, self.why, self.use_goldens = self.so.config, why, use_goldens

    def prefetch(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        self.so.prefetch(requests)

    def clear(self) -> None:
        self.so.clear()

    def teacher_forced_logits(self, prompt: Sequence[int], tokens: Sequence[int]) -> Tensor:
        return self.so.teacher_forced_logits(prompt, tokens).cpu()

    def prefill(self, tokens: Sequence[int], state: tuple[int, ...] | None = None):
        """Logits of `tokens` after the sequence `state` (the tokens so far); the new state is the longer sequence."""
        before = tuple(state or ())
        seq = before + tuple(int(t) for t in tokens)
        if not tokens:
            raise ValueError("tokens: empty prompt")
        return self.so.sequence_logits([list(seq)])[0][len(before):].cpu(), seq

    def decode(self, token: int, state: tuple[int, ...]):
        if not state:
            raise ValueError("state: decode needs a state (use prefill)")
        logits, seq = self.prefill([token], state)
        return logits[0], seq


def schedule_model(model):
    """The model the schedule replay runs on: no model math is needed once every token is forced."""
    return ScheduleOnly(model.config)


def is_streamed(model) -> bool:
    return bool(getattr(model, "streamed", False))


def load_truth(model_dir: Path, oracle: str = "auto", device: str = "cpu"):
    """(oracle model, description for the report). `oracle`: auto (in memory when oracle.load fits, else streamed),
    memory (refuse, CheckpointError, when it does not fit), streamed (always, and shipped goldens unused: the
    streamed scoring is the truth). `device`: cpu or cuda, fp64 both."""
    import oracle as oracle_pkg
    from oracle.streamed import why_not_fits
    if oracle not in ORACLES:
        raise ValueError(f"--oracle {oracle!r}: expected one of {', '.join(ORACLES)}")
    on = "" if torch.device(device).type == "cpu" else f" on {device}"
    why = why_not_fits(model_dir, torch.float64, device) if oracle != "streamed" else None
    if oracle == "streamed" or (why is not None and oracle == "auto"):
        reason = f"model does not fit: {why}" if why else "--oracle streamed"
        model = StreamedTruth(Path(model_dir), device, reason, use_goldens=oracle == "auto")
        return model, f"streamed fp64 oracle{on} ({reason})"
    model = oracle_pkg.load(model_dir, dtype=torch.float64, device=device)      # memory: refuses when it cannot fit
    return (OnDevice(model) if on else model), f"in-memory fp64 oracle{on}"


@dataclass(frozen=True)
class Truth:
    """What an instance is judged against: the truth's tokens per request and its schedule digest per mode (from
    the shipped golden or the oracle run now), or, streamed, only the tokens proven to be the oracle's own."""
    source: str                                          # where it came from, as the report says it
    tokens: dict[str, list[int]] = field(default_factory=dict)   # request id -> the truth's output
    schedule_digest: dict[str, str] = field(default_factory=dict)   # mode -> its schedule log's digest
    streamed: bool = False                               # the streamed oracle: tokens known only where proven
    golden_rejected: str | None = None                   # why a shipped golden failed its checks (console line)

    @classmethod
    def from_golden(cls, g: dict, source: str, golden_rejected: str | None = None) -> "Truth":
        """A golden record (hybridqual.golden/2, shipped or computed now) as the truth."""
        return cls(source, {r: list(v["tokens"]) for r, v in g["requests"].items()}, dict(g["schedule_digest"]),
                   golden_rejected=golden_rejected)

    def with_tokens(self, tokens: dict[str, list[int]]) -> "Truth":
        """This truth with its tokens replaced (a streamed truth with the outputs proven the oracle's own)."""
        return replace(self, tokens=dict(tokens))
