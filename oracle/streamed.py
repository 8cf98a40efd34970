"""The streamed oracle: teacher-forced fp64 scoring of given tokens for checkpoints too big to hold in memory.

    so = StreamedOracle("path/to/hf-folder")                 # config + safetensors headers read and checked
    [rows] = so.score([(prompt, tokens)])                    # rows [len(tokens) + 1, vocab], fp64
    rows[k] is the distribution that predicts tokens[k]; rows[-1] the one after the last token.

One pass per batch of requests: each request's prompt + tokens go through the model as one sequence, layer
by layer. A layer's weights are read from the safetensors file(s) (mmap, only that layer's tensors), checked,
cast to fp64, applied to every request of the batch, then dropped: memory is about one layer (in fp64) plus
the activations, whatever the model's size. The math is the in-memory oracle's own (oracle.model.embed,
layer_forward, lm_head on canonical tensors from oracle.checkpoint), so on CPU the rows are bitwise equal to
`oracle.load(path, torch.float64).prefill(prompt + tokens)[0][len(prompt) - 1:]` (tests/test_oracle_streamed.py).
Equality needs the same GEMM shapes, so the head runs on all positions of a sequence (slicing rows first
changes MKL's blocking and the last bits) and requests are never concatenated.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .checkpoint import CheckpointError, SafetensorsIndex, expected_shapes, hf_part_of, in_folder, \
    normalised_names, to_canonical
from .config import HybridConfig, from_hf_config
from .model import OracleState, embed, empty_state, layer_forward, lm_head, residual_dtype

Request = tuple[Sequence[int], Sequence[int]]          # (prompt, tokens to score)


def _check_ids(c: HybridConfig, ids: Sequence[int], what: str) -> list[int]:
    """Token ids as a list of ints in [0, vocab); ValueError naming the request and position otherwise."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise ValueError(f"{what}: expected a list of token ids, got {type(ids).__name__}")
    out = []
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{what}[{j}]: token id must be an integer, got {t!r}")
        if not 0 <= t < c.vocab_size:
            raise ValueError(f"{what}[{j}]: token id {t} is out of range for vocab_size={c.vocab_size}")
        out.append(int(t))
    return out


def _device(device: torch.device | str | None) -> torch.device:
    """The compute device; ValueError naming `device` for a bad name or an absent CUDA."""
    try:
        d = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a torch device ({e}); cpu or cuda") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r} is not supported (cpu or cuda)")
    return d


class StreamedOracle:
    """An HF folder scored layer by layer from its safetensors files, in fp64 on `device` (default CPU)."""

    def __init__(self, path: str | os.PathLike, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float64):
        if not isinstance(path, (str, os.PathLike)):
            raise CheckpointError(f"path: expected a folder path, got {type(path).__name__} {path!r}")
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a directory")
        self.config = from_hf_config(self.path)
        self.dtype, self.device = dtype, _device(device)
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"dtype: the streamed oracle computes in float64 (or float32), got {dtype!r}")
        self.index = SafetensorsIndex(self.path)
        with in_folder(self.path):   # the whole checkpoint checked by name, shape and dtype, no data read
            to_canonical(self.config, self.index.meta())
        self._cache: dict[tuple[int, ...], Tensor] = {}          # sequence -> logits, filled by prefetch()
        self._parts: dict[int | str, list[str]] = {}
        for name, stored in normalised_names(self.config, self.index.entries).items():
            self._parts.setdefault(hf_part_of(self.config, name), []).append(stored)

    # ------------------------------------------------------------------------------------------- weights
    def raw_part(self, part: int | str) -> dict[str, Tensor]:
        """Canonical tensors of one part ("top" or layer i) in their stored dtype, read now and checked (finite)."""
        with in_folder(self.path):
            return to_canonical(self.config, self.index.read(self._parts.get(part, [])), part)

    def part_weights(self, part: int | str) -> dict[str, Tensor]:
        """Canonical tensors of one part, moved to the compute device in their stored dtype, then cast there
        (tensor by tensor, each stored copy dropped once cast)."""
        raw, out = self.raw_part(part), {}
        for k in sorted(raw):
            out[k] = raw.pop(k).to(self.device).to(self.dtype)
        return out

    # ------------------------------------------------------------------------------------------- scoring
    def sequence_logits(self, sequences: Sequence[Sequence[int]]) -> list[Tensor]:
        """Logits [len, vocab] at every position of each sequence (one streamed pass over the weights)."""
        c = self.config
        seqs = [_check_ids(c, s, f"sequences[{r}]") for r, s in enumerate(sequences)]
        for r, s in enumerate(seqs):
            if not s:
                raise ValueError(f"sequences[{r}]: empty sequence")
        sd = residual_dtype(c, self.dtype)
        top = self.raw_part("top")
        hs = []
        for s in seqs:           # embed rows only: casting the gathered rows is the same as gathering cast rows
            rows = top["embed.weight"][torch.tensor(s, dtype=torch.long)].to(self.device).to(self.dtype)
            hs.append(embed(c, {"embed.weight": rows}, torch.arange(len(s), device=self.device), sd))
        del top
        for i in range(c.num_layers):
            w = self.part_weights(i)
            for r, s in enumerate(seqs):
                old = empty_state(c, self.dtype, self.device, layers=(i,))
                positions = torch.arange(len(s), device=self.device)
                hs[r] = layer_forward(c, w, i, hs[r], old, OracleState(), positions, "chunked", self.dtype)
            del w
        top = self.raw_part("top")
        w = {k: top[k].to(self.device).to(self.dtype) for k in ("final_norm.weight", "lm_head.weight")}
        del top
        return [lm_head(c, w, h, self.dtype) for h in hs]

    def score(self, requests: Sequence[Request]) -> list[Tensor]:
        """Per request (prompt, tokens): rows [len(tokens) + 1, vocab]; row k predicts tokens[k], the last row
        follows the last token (rows = logits of prompt + tokens from the prompt's last position on)."""
        prompts = []
        for r, req in enumerate(requests):
            if not isinstance(req, (tuple, list)) or len(req) != 2:
                raise ValueError(f"requests[{r}]: expected a (prompt, tokens) pair, got {type(req).__name__}")
            prompt, tokens = req
            p = _check_ids(self.config, prompt, f"requests[{r}].prompt")
            if not p:
                raise ValueError(f"requests[{r}].prompt: empty prompt")
            prompts.append(p + _check_ids(self.config, tokens, f"requests[{r}].tokens"))
        logits = self.sequence_logits(prompts)
        return [lg[len(p) - 1:] for lg, (p, _) in zip(logits, requests)]

    def prefetch(self, requests: Sequence[Request]) -> None:
        """Score every request in one pass and keep each sequence's logits, so the teacher_forced_logits calls
        that follow (one per request in hybridqual.qualify.compare) do not each read the whole model again."""
        seqs = [tuple(_check_ids(self.config, list(p) + list(t), f"requests[{r}]")) for r, (p, t) in
                enumerate(requests)]
        todo = sorted({s for s in seqs if s not in self._cache})
        if not todo:            # every sequence kept already: no pass over the weights
            return
        for s, lg in zip(todo, self.sequence_logits(todo)):
            self._cache[s] = lg

    def clear(self) -> None:
        """Drop the logits kept by prefetch()."""
        self._cache.clear()

    def teacher_forced_logits(self, prompt: Sequence[int], tokens: Sequence[int]) -> Tensor:
        """[len(tokens), vocab]: the rows that predicted each of `tokens` (hybridqual.qualify.compare.teacher_forced_logits'
        contract, computed in one chunked pass instead of prefill + decode; from prefetch() when it has them:
        the same bits, as a sequence's logits do not depend on where prompt and tokens are split)."""
        seq = tuple(list(prompt) + list(tokens))
        if seq in self._cache and prompt:
            return self._cache[seq][len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        return self.score([(prompt, tokens)])[0][:len(tokens)]


# ------------------------------------------------------------------------------ margins for goldens/qualify

@dataclass
class TokenScores:
    """The oracle's view of one request's given tokens: per generated position k (rows[k] predicts tokens[k])."""
    tokens: list[int]
    logits: Tensor            # [len(tokens) + 1, vocab] fp64
    top1: list[int]           # argmax of each row (lowest index on ties), len(tokens) + 1
    top2: list[int]           # runner-up of each row
    margins: list[float]      # top-1 minus top-2 logit of each row (hybridqual.qualify.compare.top2_margin)
    gaps: list[float]         # per token: logit[top1] - logit[token] (0 when the token is the argmax)


def token_scores(rows: Tensor, tokens: Sequence[int]) -> TokenScores:
    """Top-1/top-2, margins and per-token gaps from score() rows (CPU fp64 lists)."""
    rows = rows.detach().to("cpu", torch.float64)
    if rows.shape[-1] < 2:
        raise ValueError(f"rows: need a vocab of >= 2 for a top-2 margin, got {rows.shape[-1]}")
    vals, idx = torch.topk(rows, 2, dim=-1)
    top1 = [int(torch.argmax(r)) for r in rows]                    # argmax: lowest index on exact ties
    second = [int(i[1]) if int(i[0]) == t else int(i[0]) for i, t in zip(idx, top1)]
    gaps = [float(rows[k, top1[k]] - rows[k, t]) for k, t in enumerate(tokens)]
    return TokenScores(list(tokens), rows, top1, second, [float(v[0] - v[1]) for v in vals], gaps)


def score_tokens(path: str | os.PathLike, requests: Sequence[Request],
                 device: torch.device | str | None = None) -> list[TokenScores]:
    """One streamed fp64 pass over `path` scoring each (prompt, tokens): what goldens/qualify need for a model
    that does not fit in memory (tokens from the engine, truth from the streamed oracle)."""
    so = StreamedOracle(path, device=device)
    return [token_scores(rows, toks) for rows, (_, toks) in zip(so.score(requests), requests)]


# ----------------------------------------------------------------------------------- does it fit in memory

def in_memory_bytes(config: HybridConfig, dtype: torch.dtype = torch.float64) -> int:
    """Bytes of the in-memory oracle's weights in `dtype` (tied lm_head counted once)."""
    shapes = expected_shapes(config)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return sum(math.prod(s) for s in shapes.values()) * torch.empty(0, dtype=dtype).element_size()


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def stored_bytes(path: str | os.PathLike) -> int:
    """Bytes of the checkpoint's tensors as stored (what load_checkpoint holds on the host)."""
    return sum(e[2].itemsize * math.prod(e[1]) for e in SafetensorsIndex(path).entries.values())


def load_bytes(path: str | os.PathLike, dtype: torch.dtype = torch.float64) -> int:
    """Peak host bytes of oracle.load(path, dtype) on CPU: the weights in `dtype` plus the stored copy while casting."""
    return in_memory_bytes(from_hf_config(path), dtype) + stored_bytes(path)


def gpu_free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (torch.cuda.mem_get_info), None when unknown."""
    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except (RuntimeError, AssertionError, ValueError):
        return None


def memory_needs(path: str | os.PathLike, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> list[tuple[str, int, int | None]]:
    """(where, bytes oracle.load needs there, bytes available or None) for each memory it uses: on CPU the host
    holds weights + stored copy; on cuda the host holds the stored copy and the GPU the weights in `dtype`."""
    d = _device(device)
    if d.type == "cpu":
        return [("host RAM", load_bytes(path, dtype), available_memory_bytes())]
    return [("host RAM", stored_bytes(path), available_memory_bytes()),
            (f"{d} memory", in_memory_bytes(from_hf_config(path), dtype), gpu_free_bytes(d))]


def fits_in_memory(path: str | os.PathLike, dtype: torch.dtype = torch.float64, headroom: float = 1.5,
                   device: torch.device | str | None = None) -> bool:
    """Whether oracle.load(path, dtype, device) fits: each need times `headroom` against what is available (True
    when unknown). Callers use StreamedOracle when it does not."""
    return all(avail is None or need * headroom <= avail for _, need, avail in memory_needs(path, dtype, device))


def why_not_fits(path: str | os.PathLike, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None, headroom: float = 1.0) -> str | None:
    """None when oracle.load(path, dtype, device) fits (`headroom` × need <= available), else why not, in words."""
    for where, need, avail in memory_needs(path, dtype, device):
        if avail is not None and need * headroom > avail:
            return (f"oracle.load in {str(dtype).replace('torch.', '')} needs {need / 2**30:.1f} GiB of {where}, "
                    f"{avail / 2**30:.1f} GiB available")
    return None


def require_fits(path: str | os.PathLike, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> None:
    """CheckpointError before allocating when oracle.load(path, dtype, device) needs more memory than available."""
    why = why_not_fits(path, dtype, device)
    if why is not None:
        raise CheckpointError(f"{os.fspath(path)}: {why}; score with oracle.streamed.StreamedOracle (memory ≈ "
                              "one layer) instead")
