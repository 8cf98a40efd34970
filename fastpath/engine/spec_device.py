"""Verify steps whose drafts never visit the host before the forward (docs/engine.md "Device proposals").

With graphs (or pad_decode) and the ngram or draft proposer, a step in which no live row is prefilling (the
decode loop) takes its drafts on the device. The host uploads the verify batch laid out for every row's room
(min(k, tokens left)); VerifyRunner._device_body — one CUDA graph per (rows, width) bucket, or eager — reads each
row's room from those slots, takes drafts and counts from a source (NgramSource: fastpath/engine/ngram_device.py
over the static per-slot TokenHistory, fixed shapes; DraftSource: the draft model's drafts from
DraftModel.propose_device, copied into a static buffer, m = room), writes the drafts' ids and slot -1 past m into
the metadata, runs the verify forward and sampling, and packs tokens | drafts | counts into one buffer that comes
back in ONE non-blocking copy with the step's event. The host learns the proposals only in resolve, after the
step's one wait (Launched.finalize); there it logs each row exactly as a host proposal would have (m = 0: a decode
row; else a verify row with its m proposals), calls on_logits (if set) and decides acceptance. Steps with a
prefill piece (whose budget needs m before the batch is built) take the host path (the same proposals:
tests/test_ngram_device.py, tests/test_spec_device.py). Cost: with ngram every decode-loop step is a verify batch
at the room's width, also when no row has a draft (the host cannot know that without a sync).
"""
from __future__ import annotations

import torch
from torch import Tensor

from oracle.schedule_log import BatchRow

from .ngram_device import TokenHistory, ngram_device


class NgramSource:
    """The verify body's ngram drafts: ngram_device over the rows' histories (slots = the snapshot sources, lengths =
    the first position + 1), all from the verify metadata and the static history (so it can be captured)."""

    def __init__(self, hist: TokenHistory, k: int, min_n: int, max_n: int):
        self.hist, self.k, self.min_n, self.max_n = hist, k, min_n, max_n

    def __call__(self, vb, room: Tensor) -> tuple[Tensor, Tensor]:
        return ngram_device(self.hist.hist.index_select(0, vb.src), vb.pos[:vb.nb] + 1, room, self.k, self.min_n,
                            self.max_n)


class DraftSource:
    """The verify body's draft-model drafts: a static [R, k] buffer the draft's drafts are copied into, m = room."""

    def __init__(self, buf: Tensor):
        self.buf = buf

    def __call__(self, vb, room: Tensor) -> tuple[Tensor, Tensor]:
        return self.buf[:vb.nb], room


class DeviceProposals:
    """The Speculator's device-draft steps: `applies` (this step), `row`, `launch`, and the resolve-time `finalize`."""

    def __init__(self, sp, engine):
        self.sp, self.engine, self.k = sp, engine, sp.k
        R, dev, p = engine.R, engine.device, sp.spec.proposer
        self.ngram = p.kind == "ngram"
        self.hist = TokenHistory(R, engine.bank.max_len, dev) if self.ngram else None
        self.drafts = None                                 # draft proposer: (drafts [S, max room], request ids)
        self.buf = None if self.ngram else torch.zeros(R, self.k, dtype=torch.int64, device=dev)
        n = R * (self.k + 1) + R * self.k + R              # tokens [nb*w] | drafts [nb*k] | counts [nb]
        self.res = torch.zeros(n, dtype=torch.int64, device=dev)
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=dev.type == "cuda")
        sp.runner.res = self.res
        sp.runner.source = NgramSource(self.hist, self.k, p.min_n, p.max_n) if self.ngram else DraftSource(self.buf)
        self.steps = 0                                     # device-draft steps run (tests)
        self._pend = None

    def reset(self) -> None:
        """A new run."""
        if self.hist is not None:
            self.hist.reset()
        self._pend, self.drafts = None, None

    def applies(self, live) -> bool:
        """This step takes device drafts: rows to decode, none prefilling, histories that fit."""
        eng = self.engine
        return (bool(live) and not any(st.prefilling for _, st in live)
                and (not self.ngram or all(self.hist.fits(len(st.req.prompt) + len(st.output)) for _, st in live)))

    def row(self, r: int, st, slot: int) -> BatchRow:
        """A placeholder verify row laid out for its room; the real row (decode or verify) is logged in finalize."""
        room, pos = self.sp.room(st), len(st.req.prompt) + len(st.output) - 1
        if not room:                                       # paused by backoff: a plain decode row
            return BatchRow(r, st.req.id, slot, "decode", pos, 1)
        return BatchRow(r, st.req.id, slot, "verify", pos, room + 1, proposals=[])

    def launch(self, batch: list[BatchRow], rec):
        """Drafts on the device, the verify forward (graph replay or eager), one non-blocking copy of tokens, drafts
        and counts with the step's event; no host read of device data."""
        from .launched import Launched
        eng, sp, k = self.engine, self.sp, self.k
        sts = [eng.requests[b.request] for b in batch]
        toks = [list(st.req.prompt) + st.output for st in sts]
        S, room = len(batch), [b.count - 1 for b in batch]
        if self.ngram:
            self.hist.catch_up([(b.request, b.slot, t) for b, t in zip(batch, toks)])
        else:                                              # the draft model's room drafts per row (prepare)
            drafts, ids = self.drafts
            self.drafts = None
            assert ids == [b.request for b in batch], "draft rows out of step with the batch"
            self.buf[:S, :drafts.shape[1]].copy_(drafts)
        nb, _ = sp.runner.shape(S, 1 + max(room))
        seeded = []
        for r, (b, st) in enumerate(zip(batch, sts)):
            if st.req.sampling.kind == "seeded":
                for i in range(room[r] + 1):               # each position keyed by its own absolute position
                    seeded.append((i * nb + r, float(st.req.sampling.temperature), int(st.req.sampling.seed),
                                   b.pos + 1 + i))
        last = [st.output[-1] for st in sts]
        nb, w = sp.runner.run_device(last, [b.pos for b in batch], [b.slot for b in batch], room, seeded)
        T = nb * w
        n = T + nb * k + nb
        self.host[:n].copy_(self.res[:n], non_blocking=True)
        event = None
        if eng.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pend = (batch, last, nb, w, S)
        self.steps += 1
        return Launched(eng.k, [], rec, [], self.host, event, finalize=self.finalize)

    def finalize(self, p) -> None:
        """Resolve, after the step's wait: the logged batch (decode rows for m = 0, verify rows with their drafts),
        acceptance, and the pending step's one-token rows (Speculator.outcome)."""
        batch, last, nb, w, S = self._pend
        self._pend, k, T = None, self.k, nb * w
        vals = self.host[:T + nb * k + nb].tolist()
        vt, dr, mm = vals[:T], vals[T:T + nb * k], vals[T + nb * k:]
        real, inputs = [], []
        for r, b in enumerate(batch):
            props = dr[r * k:r * k + mm[r]]
            inputs.append([last[r]] + props)
            real.append(BatchRow(b.row, b.request, b.slot, "verify", b.pos, len(props) + 1, proposals=props) if props
                        else BatchRow(b.row, b.request, b.slot, "decode", b.pos, 1))
        p.record.batch = real
        eng = self.engine
        if eng.on_logits is not None:                      # after the wait: the verify logits are still the step's
            eng.on_logits(*self.sp._expand(real, inputs, nb, self.sp.runner.device_logits, [], None))
        out_rows, samples, host = self.sp.outcome(real, real, inputs, vt, nb, [], [], p.record)
        if not p.record.verify:                            # no row had a draft: logged as the plain decode step
            p.record.verify = None
        p.batch, p.samples, p.host_tokens = out_rows, samples, torch.tensor(host, dtype=torch.int64)
