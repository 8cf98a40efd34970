"""Verify steps whose drafts never visit the host before the forward (docs/engine.md "Device proposals").

With graphs (or pad_decode) and the ngram or draft proposer, a step in which no live row is prefilling (the
decode loop) takes its drafts on the device. ngram: the request tokens live in a per-slot TokenHistory (new tokens
written by one non-blocking pinned copy) and fastpath/engine/ngram_device.py proposes drafts [S, k] and counts
m [S] with fixed shapes; draft: the draft model's catch-up pass and drafting steps (DraftModel.propose_device)
leave its drafts on the device, m = room. Then VerifyRunner.run_device lays every row out for its room
(min(k, tokens left)) and masks positions past m with slot -1 on the device, and the tokens, drafts and counts
come back in ONE non-blocking copy with the step's event. The host learns the proposals only in resolve, after
the step's one wait; there it logs each row exactly as a host proposal would have (m = 0: a decode row; else a
verify row with its m proposals) and decides acceptance. Steps with a prefill piece (whose budget needs m before
the batch is built) and runs with an on_logits hook take the host path (the same proposals:
tests/test_ngram_device.py, tests/test_spec_device.py). Cost: with ngram every decode-loop step is a verify batch
at the room's width, also when no row has a draft (the host cannot know that without a sync).
"""
from __future__ import annotations

import torch

from oracle.schedule_log import BatchRow

from .ngram_device import TokenHistory


class DeviceProposals:
    """The Speculator's device-draft steps: `applies` (this step), `row`, `launch`, and the resolve-time `finalize`."""

    def __init__(self, sp, engine):
        self.sp, self.engine, self.k = sp, engine, sp.k
        R, dev = engine.R, engine.device
        self.ngram = sp.spec.proposer.kind == "ngram"
        self.hist = TokenHistory(R, engine.bank.max_len, dev) if self.ngram else None
        self.drafts = None                                 # draft proposer: (drafts [S, max room], request ids)
        n = R * (self.k + 1) + R * self.k + R              # tokens [nb*w] | drafts [S*k] | counts [S]
        self.res = torch.zeros(n, dtype=torch.int64, device=dev)
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.steps = 0                                     # device-draft steps run (tests)
        self._pend = None

    def reset(self) -> None:
        """A new run."""
        if self.hist is not None:
            self.hist.reset()
        self._pend, self.drafts = None, None

    def applies(self, live) -> bool:
        """This step takes device drafts: rows to decode, none prefilling, no logits hook, histories that fit."""
        eng = self.engine
        return (bool(live) and eng.on_logits is None and not any(st.prefilling for _, st in live)
                and (not self.ngram or all(self.hist.fits(len(st.req.prompt) + len(st.output)) for _, st in live)))

    def row(self, r: int, st, slot: int) -> BatchRow:
        """A placeholder verify row laid out for its room; the real row (decode or verify) is logged in finalize."""
        room = min(self.k, st.req.max_new_tokens - len(st.output))
        return BatchRow(r, st.req.id, slot, "verify", len(st.req.prompt) + len(st.output) - 1, room + 1, proposals=[])

    def launch(self, batch: list[BatchRow], rec):
        """Drafts on the device, the verify forward (graph replay or eager), one non-blocking copy of tokens, drafts
        and counts with the step's event; no host read of device data."""
        from .engine import Launched
        eng, sp, k = self.engine, self.sp, self.k
        sts = [eng.requests[b.request] for b in batch]
        toks = [list(st.req.prompt) + st.output for st in sts]
        S, room = len(batch), [b.count - 1 for b in batch]
        meta = torch.tensor([[b.slot for b in batch], [len(t) for t in toks], room], dtype=torch.int64)
        if eng.device.type == "cuda":
            meta = meta.pin_memory()
        meta = meta.to(eng.device, non_blocking=True)
        if self.ngram:
            self.hist.catch_up([(b.request, b.slot, t) for b, t in zip(batch, toks)])
            p = sp.spec.proposer
            drafts, m = self.hist.propose(meta[0], meta[1], meta[2], k, p.min_n, p.max_n)
        else:                                              # the draft model's room drafts per row (prepare)
            drafts, ids = self.drafts
            self.drafts = None
            assert ids == [b.request for b in batch], "draft rows out of step with the batch"
            drafts, m = torch.nn.functional.pad(drafts, (0, k - drafts.shape[1])), meta[2]
        nb, _ = sp.runner.shape(S, 1 + max(room))
        seeded = []
        for r, (b, st) in enumerate(zip(batch, sts)):
            if st.req.sampling.kind == "seeded":
                for i in range(room[r] + 1):               # each position keyed by its own absolute position
                    seeded.append((i * nb + r, float(st.req.sampling.temperature), int(st.req.sampling.seed),
                                   b.pos + 1 + i))
        last = [st.output[-1] for st in sts]
        nb, w, _, tok = sp.runner.run_device(last, [b.pos for b in batch], [b.slot for b in batch], room, drafts, m,
                                             seeded)
        T = nb * w
        n = T + S * k + S
        self.res[:T].copy_(tok[:T])
        self.res[T:T + S * k].copy_(drafts.reshape(-1))
        self.res[T + S * k:n].copy_(m)
        self.host[:n].copy_(self.res[:n], non_blocking=True)
        event = None
        if eng.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pend = (batch, last, nb, T, S)
        self.steps += 1
        return Launched(eng.k, [], rec, [], self.host, event, finalize=self.finalize)

    def finalize(self, p) -> None:
        """Resolve, after the step's wait: the logged batch (decode rows for m = 0, verify rows with their drafts),
        acceptance, and the pending step's one-token rows (Speculator.outcome)."""
        batch, last, nb, T, S = self._pend
        self._pend, k = None, self.k
        vals = self.host[:T + S * k + S].tolist()
        vt, dr, mm = vals[:T], vals[T:T + S * k], vals[T + S * k:]
        real, inputs = [], []
        for r, b in enumerate(batch):
            props = dr[r * k:r * k + mm[r]]
            inputs.append([last[r]] + props)
            real.append(BatchRow(b.row, b.request, b.slot, "verify", b.pos, len(props) + 1, proposals=props) if props
                        else BatchRow(b.row, b.request, b.slot, "decode", b.pos, 1))
        p.record.batch = real
        out_rows, samples, host = self.sp.outcome(real, real, inputs, vt, nb, [], [], p.record)
        if not p.record.verify:                            # no row had a draft: logged as the plain decode step
            p.record.verify = None
        p.batch, p.samples, p.host_tokens = out_rows, samples, torch.tensor(host, dtype=torch.int64)
