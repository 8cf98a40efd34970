"""Short prefill-only steps whose exact shape repeats, replayed as CUDA graphs (a prefix-cache hit's suffix).

A prefix-cache hit's one step — a short piece over a long restored context — is host-bound in eager mode (hundreds
of kernels, each paying Python and launch time: docs/performance.md, "Choices the code makes").
Such a step repeats exactly whenever the same suffix length resumes at the same checkpoint into the same slot,
so it is captured once and replayed:

    key    the step's whole host metadata but its token ids: the pieces' (start, count, slot), decode rows none,
           no checkpoint inside a piece; at most `max_tokens` tokens (a long piece is device-bound anyway)
    1st    seen: eager, as without graphs
    2nd    seen: eager (this step's result), then the same forward captured over the same StepBatch (capture
           records, it does not run, so the bank is untouched); the batch and the graph are kept
    later  the token ids are copied into the kept batch (one pinned copy) and the graph replays

Every other input of the graph is the kept batch's device metadata (equal by key), the bank and the weights
(allocated once), so a replay runs the same kernels on the same arguments as the eager forward of that step:
bitwise equal by construction (tests/test_prefix_cache_graphs.py). Without capture (CPU, or capture=False) the
2nd-and-later path runs eagerly over the kept batch, so the kept-batch plumbing is tested on CPU too. At most
`max_graphs` shapes are kept (LRU; an evicted shape must be seen twice again) and `max_seen` remembered once-seen.

With `buckets` (fastpath/engine/prefill_buckets.py) a one-piece step of fewer tokens than the largest bucket never
takes the path above: it is padded to its bucket, whose kept batch (and graph) was built ahead of time, whatever its
length, start and slot — so a hit of a never-seen shape is not eager either. A step storing a checkpoint inside its
piece runs its bucket's layout eagerly (in the default mode a padded step's bits are its bucket's, so every step a
bucket serves is padded).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from .graphs import capture


class PrefillGraphs:
    """Kept StepBatches (+ captured graphs on CUDA) of repeated short prefill-only step shapes, LRU-bounded."""

    def __init__(self, model, bank, capture: bool = True, max_tokens: int = 512, max_graphs: int = 8,
                 max_seen: int = 1024, buckets: tuple[int, ...] | None = None):
        self.model, self.bank = model, bank
        self.buckets = None
        if buckets:
            from .prefill_buckets import BucketGraphs
            self.buckets = BucketGraphs(model, bank, buckets, capture)
        self.capture = capture and model.device.type == "cuda"
        self.max_tokens, self.max_graphs, self.max_seen = max_tokens, max_graphs, max_seen
        self.seen: OrderedDict[tuple, None] = OrderedDict()   # shapes seen once (LRU-bounded, host only)
        self.kept: OrderedDict[tuple, dict] = OrderedDict()   # key -> {"batch", "graph", "logits"}
        self.pool = None
        self.reuses = self.replays = self.captures = 0    # kept-batch steps, of them graph replays; captures
        self.eager = 0                                    # taken steps run eagerly (unpadded)

    def prepare(self) -> None:
        """Build the buckets' kept batches (and capture their graphs on CUDA) ahead of the first step."""
        if self.buckets is not None:
            self.buckets.prepare()

    def key(self, n_dec: int, pieces: list[tuple[int, int, int]], checkpoints, tokens: int) -> tuple | None:
        """The shape key of a step, or None when the step is not one this runner takes."""
        if n_dec or not pieces or tokens > self.max_tokens:
            return None
        if self.buckets is not None and len(pieces) == 1 and pieces[0][2] >= 0:
            b = self.buckets.bucket(pieces[0][1])
            if b is not None:               # with a checkpoint inside too: the bucket's bits (prefill_buckets.py)
                return ("bucket", b, pieces[0], tuple(checkpoints))
        return None if checkpoints else tuple(pieces)

    def forward(self, key: tuple, ids: list[int], pack) -> Tensor:
        """The step's logits: eager on the first sight of `key`, eager + kept (+ captured) on the second, replayed
        (ids copied into the kept batch) after that; a bucket key: its bucket's kept batch (eager, unpadded, only if
        the layout does not fit it). `pack()` builds the step's StepBatch (pack_step)."""
        if key[0] == "bucket":
            logits = self.buckets.forward(key[1], key[2], ids, key[3])
            if logits is not None:
                return logits
            self.eager += 1
            return self.model.forward(pack(), self.bank)
        entry = self.kept.get(key)
        if entry is None:
            sb = pack()
            self.eager += 1
            logits = self.model.forward(sb, self.bank)
            if key not in self.seen:
                self.seen[key] = None
                if len(self.seen) > self.max_seen:
                    self.seen.popitem(last=False)
                return logits
            del self.seen[key]
            self._keep(key, sb)
            return logits
        self.kept.move_to_end(key)
        sb = entry["batch"]
        host = torch.tensor(ids, dtype=torch.int64)
        sb.ids.copy_(host.pin_memory() if sb.ids.is_cuda else host, non_blocking=True)
        self.reuses += 1
        if entry["graph"] is None:
            return self.model.forward(sb, self.bank)
        entry["graph"].replay()
        self.replays += 1
        return entry["logits"]

    def _keep(self, key: tuple, sb) -> None:
        """Keep the batch (its device metadata is the graph's input) and, on CUDA, capture its forward."""
        while len(self.kept) >= self.max_graphs:
            self.kept.popitem(last=False)
        graph = logits = None
        if self.capture:
            self.model.prepare(sb, self.bank)               # already built by the eager forward: no copy in capture
            graph = torch.cuda.CUDAGraph()
            with capture(graph, self.pool):                  # the garbage collector off (graphs.capture)
                logits = self.model.forward(sb, self.bank)
            self.pool = graph.pool()
            self.captures += 1
        self.kept[key] = {"batch": sb, "graph": graph, "logits": logits}
