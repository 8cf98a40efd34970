"""Verify steps of speculative decoding as decode-shaped batches (DESIGN §13, docs/engine.md "Speculative decoding").

A verify batch is nb rows x w positions, laid out position-major: token t = j*nb + r is row r's input j at position
pos_r + j. Every projection, norm and MLP runs once over all T = nb*w tokens (one pass over the weights); each Mamba
layer runs the decode steps of all w positions in one launch each (conv1d_steps, ssm_steps: the bits of w
conv1d_step / ssm_step calls, the SSM state kept in registers across positions), and after each position
j < w-1 those kernels also store each live row's new conv window and SSM state into scratch snapshot j
(per-position snapshots, the bank's bits: no copy kernel); attention
runs attention_decode position by position (position j's K/V is written before position j+1 reads it). A row's
positions past its own m drafts, and padding rows, carry slot -1: no kernel reads or writes their state. So after
the forward each slot holds the state after its last real input, and a row that accepted a < m drafts only needs
snapshot a copied back (`PositionSnapshots.restore`): no second forward. KV needs no rollback (positions past the
accepted ones are rewritten before anything reads them).

The measured alternative (FastOptions.spec_replay): no per-position snapshots; each Mamba layer keeps the rows'
pre-verify conv window and SSM state and its conv inputs and dt at every position (`InputLog`), and a rollback
restores the pre-verify state and re-runs only the conv and SSM steps of the accepted positions (`replay`), with the
same kernels on the same inputs, so both rollbacks leave the same bits.

On CUDA each (rows bucket, width bucket) is captured once as a graph over static buffers (greedy rows); the eager
padded path (`capture=False`, the engine's pad_decode) runs exactly the same shapes and kernels, so graph replay ==
eager padded bitwise by construction, as for the decode graphs (fastpath/engine/graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .bank import StateBank
from .graphs import buckets, warm_capture
from .sample import sample_rows


def width_buckets(k: int) -> list[int]:
    """Verify widths (positions per row): 2, 3, 5, 9, ... (1 + powers of two) below k+1, then k+1."""
    out, b = [], 1
    while b + 1 < k + 1:
        out.append(b + 1)
        b *= 2
    return out + [k + 1]


class PositionSnapshots:
    """Conv windows and SSM states of every Mamba layer after verify positions 0..k-1 of up to R rows, allocated
    once: conv [n_mamba, k, R, conv_dim, d_conv-1], ssm [n_mamba, k, R, H, P, N] (the bank's dtypes)."""

    def __init__(self, bank: StateBank, R: int, k: int):
        self.bank = bank
        n_m = bank.conv_state.shape[0]
        self.conv = torch.zeros((n_m, k, R) + tuple(bank.conv_state.shape[2:]), dtype=bank.conv_state.dtype,
                                device=bank.device)
        self.ssm = torch.zeros((n_m, k, R) + tuple(bank.ssm_state.shape[2:]), dtype=bank.ssm_state.dtype,
                               device=bank.device)

    def position_views(self, m: int, w: int, n: int) -> tuple[Tensor, Tensor]:
        """(conv, ssm) snapshots [w, n, ...] of Mamba layer index m after positions 0..w-1: the multi-step kernels
        store each live row's new window and state there as they write the bank (no copy kernel). A row's position
        j is live up to its own last input, and rollback only restores positions before it."""
        return self.conv[m, :w, :n], self.ssm[m, :w, :n]

    def restore(self, j: int, r: int, slot: int) -> None:
        """bank[:, slot] := snapshot[:, j, r]: row r's state after its input j, in every Mamba layer."""
        self.bank.ssm_state[:, slot].copy_(self.ssm[:, j, r])
        self.bank.conv_state[:, slot].copy_(self.conv[:, j, r])

    def nbytes(self) -> int:
        """Bytes of scratch (the memory the per-position rollback costs)."""
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


class InputLog:
    """The replay rollback's record, allocated once: every row's pre-verify conv window and SSM state per Mamba
    layer (conv0 [n_mamba, R, ...], ssm0), and each Mamba layer's conv inputs xBC and dt at every verify token
    (xbc [n_mamba, (k+1)*R, conv_dim], dt [n_mamba, (k+1)*R, H]; the model dtype)."""

    def __init__(self, bank: StateBank, R: int, k: int, dtype: torch.dtype):
        c, n_m, dev = bank.config, bank.conv_state.shape[0], bank.device
        self.bank = bank
        self.conv0 = torch.zeros((n_m, R) + tuple(bank.conv_state.shape[2:]), dtype=bank.conv_state.dtype, device=dev)
        self.ssm0 = torch.zeros((n_m, R) + tuple(bank.ssm_state.shape[2:]), dtype=bank.ssm_state.dtype, device=dev)
        self.xbc = torch.zeros(n_m, (k + 1) * R, c.conv_dim, dtype=dtype, device=dev)
        self.dt = torch.zeros(n_m, (k + 1) * R, c.mamba_n_heads, dtype=dtype, device=dev)

    def save(self, m: int, src: Tensor, xBC: Tensor, dt: Tensor) -> None:
        """Before layer m's first verify position: its rows' state, and its conv inputs and dt at every token."""
        n, T = src.shape[0], xBC.shape[0]
        torch.index_select(self.bank.conv_state[m], 0, src, out=self.conv0[m, :n])
        torch.index_select(self.bank.ssm_state[m], 0, src, out=self.ssm0[m, :n])
        self.xbc[m, :T].copy_(xBC)
        self.dt[m, :T].copy_(dt)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv0, self.ssm0, self.xbc, self.dt))


@dataclass
class VerifyBatch:
    """Device inputs of one verify forward (views of one metadata tensor, position-major)."""
    ids: Tensor      # [w*nb] int64
    pos: Tensor      # [w*nb] int64
    slot: Tensor     # [w, nb] int64: the row's slot at its real positions, -1 elsewhere
    src: Tensor      # [nb] int64: the slot each row's pre-verify state is logged from (replay; padding: row 0's)
    nb: int
    w: int

    @staticmethod
    def view(meta: Tensor, nb: int, w: int) -> "VerifyBatch":
        T = nb * w
        return VerifyBatch(meta[:T], meta[T:2 * T], meta[2 * T:3 * T].view(w, nb), meta[3 * T:3 * T + nb], nb, w)


def pack_rows(rows: list[list[int]], starts: list[int], slots: list[int], nb: int, w: int,
              right: bool = False) -> list[int]:
    """ids | pos | slot of an (nb, w) batch (VerifyBatch's layout, host side): row r's tokens at positions
    starts[r].. in slots[r], from column 0 (or right-aligned, ending at column w-1); slot -1 everywhere else."""
    T = nb * w
    ids, pos, sl = [0] * T, [0] * T, [-1] * T
    for r, (toks, p, s) in enumerate(zip(rows, starts, slots)):
        first = w - len(toks) if right else 0
        for j, t in enumerate(toks):
            at = (first + j) * nb + r
            ids[at], pos[at], sl[at] = t, p + j, s
    return ids + pos + sl


def upload_meta(stage: Tensor, meta: Tensor, vals: list[int]) -> None:
    """A batch's metadata (VerifyBatch's layout) from the host in one non-blocking copy through the pinned `stage`,
    which the caller rewrites only after the step's next host sync."""
    stage[:len(vals)].copy_(torch.tensor(vals, dtype=torch.int64))
    meta.copy_(stage[:len(vals)], non_blocking=True)


def capture_idle(meta: Tensor, nb: int, w: int, body, pool):
    """warm_capture(body, pool) with every slot of the (nb, w) batch in `meta` set to -1 first, so the warm-up and
    captured runs read and write no bank state; the metadata is restored after. (graph, what body returned)."""
    saved = meta.clone()
    VerifyBatch.view(meta, nb, w).slot.fill_(-1)
    out = warm_capture(body, pool)
    meta.copy_(saved)
    return out


def verify_forward(model, vb: VerifyBatch, bank: StateBank, snaps: PositionSnapshots | None,
                   log: InputLog | None = None) -> Tensor:
    """FastModel.forward's layer loop over a verify batch with sequential mixers; logits [w*nb, V] at every token."""
    return model._logits(verify_hidden(model, vb, bank, snaps, log))


def verify_hidden(model, vb: VerifyBatch, bank: StateBank, snaps: PositionSnapshots | None,
                  log: InputLog | None = None) -> Tensor:
    """verify_forward up to the LM head: the final-normed hidden states [w*nb, hidden] (the draft's catch-up takes
    the head of its last position only: fastpath/engine/catch_up.py)."""
    c, w = model.config, model.w
    h = F.embedding(vb.ids, w["embed.weight"])
    if c.embedding_multiplier != 1.0:
        h = h * c.embedding_multiplier
    h = h.to(model.stream_dtype)
    out = None
    for i, spec in enumerate(c.layers):
        if spec.mixer is not None:
            h, u = model._add_norm(h, out, f"layers.{i}.mixer_norm.weight")
            out = (_mamba(model, i, u, vb, bank, snaps, log) if spec.mixer == "mamba" else
                   _attention(model, i, u, vb, bank))
        if spec.ffn is not None:
            h, u = model._add_norm(h, out, f"layers.{i}.ffn_norm.weight")
            p = f"layers.{i}."
            out = model.mlp(u, p + "mlp.") if spec.ffn == "mlp" else model.moe(u, p + "moe.")
    _, h = model._add_norm(h, out, "final_norm.weight")
    return h


def _mamba(model, i: int, u: Tensor, vb: VerifyBatch, bank: StateBank, snaps: PositionSnapshots | None,
           log: InputLog | None = None) -> Tensor:
    """FastModel.mamba with the conv and SSM updates as w decode steps (one conv1d_steps and one ssm_steps launch:
    bits of w conv1d_step / ssm_step calls), snapshots after positions 0..w-2 (or, for the replay rollback, the
    pre-verify state and the inputs logged first)."""
    c, p, nb, be = model.config, f"layers.{i}.mamba.", vb.nb, model.backend
    conv_w, conv_b = model.w[p + "conv1d.weight"], model.w.get(p + "conv1d.bias")
    zxbcdt = model._linear(u, p + "in_proj")
    T, H, P, G, N = zxbcdt.shape[0], c.mamba_n_heads, c.mamba_head_dim, c.mamba_n_groups, c.mamba_d_state
    z, xBC, dt = torch.split(zxbcdt, [c.d_inner, c.conv_dim, H], dim=-1)
    xbc = torch.empty(T, c.conv_dim, dtype=zxbcdt.dtype, device=zxbcdt.device)
    y = torch.empty(T, H, P, dtype=zxbcdt.dtype, device=zxbcdt.device)
    A, D, dt_bias, m = model.A[i], model.w[p + "D"], model.w[p + "dt_bias"], bank.mamba_index[i]
    if log is not None:
        log.save(m, vb.src, xBC, dt)
    w = vb.w
    sc, ss = snaps.position_views(m, w - 1, nb) if snaps is not None and w > 1 else (None, None)
    ops.conv1d_steps(xBC.view(w, nb, c.conv_dim), conv_w, conv_b, bank.conv(i), vb.slot,
                     out=xbc.view(w, nb, c.conv_dim), backend=be, snap=sc)
    x, B, C = torch.split(xbc, [c.d_inner, G * N, G * N], dim=-1)
    ops.ssm_steps(bank.ssm(i), x.view(w, nb, H, P), dt.view(w, nb, H), A, B.view(w, nb, G, N), C.view(w, nb, G, N),
                  D, dt_bias, vb.slot, dt_limit=c.dt_limit, out=y.view(w, nb, H, P), backend=be, snap=ss)
    y = model._gated_norm(y.reshape(T, c.d_inner), z, model.w[p + "norm.weight"])
    return model._linear(y, p + "out_proj")


def _attention(model, i: int, u: Tensor, vb: VerifyBatch, bank: StateBank) -> Tensor:
    """FastModel.attention with one attention_decode per position (K/V written at pos_r + j, read up to it)."""
    c, p, nb = model.config, f"layers.{i}.attn.", vb.nb
    Hq, Hkv, d = c.n_attn_heads, c.n_kv_heads, c.attn_head_dim
    T = u.shape[0]
    if p + "qkv.weight" in model.w:
        qk, v = model._linear(u, p + "qkv").split([(Hq + Hkv) * d, Hkv * d], dim=-1)
        qk, v = qk.view(T, Hq + Hkv, d), v.view(T, Hkv, d)
        q, k = qk[:, :Hq], qk[:, Hq:]
    else:
        q = model._linear(u, p + "q_proj").view(T, Hq, d)
        k = model._linear(u, p + "k_proj").view(T, Hkv, d)
        v = model._linear(u, p + "v_proj").view(T, Hkv, d)
    kc, vc = bank.kv(i)
    o = torch.empty(T, Hq, d, dtype=q.dtype, device=q.device)
    for j in range(vb.w):
        s = slice(j * nb, (j + 1) * nb)
        ops.attention_decode(q[s], k[s], v[s], kc, vc, vb.slot[j], vb.pos[s], c.attn_scale, out=o[s],
                             rope_dim=c.rope_dim, rope_theta=c.rope_theta, backend=model.backend)
    return model._linear(o.view(T, Hq * d), p + "o_proj")


def replay(model, bank: StateBank, log: InputLog, nb: int, rows: list[tuple[int, int, int]]) -> None:
    """The replay rollback: rows (r, a, slot) of the last verify batch (nb rows) get their pre-verify state back,
    then every Mamba layer re-runs the conv and SSM steps of their inputs 0..a (all rows of one position in one
    launch; rows already done carry slot -1)."""
    for r, _, slot in rows:
        bank.conv_state[:, slot].copy_(log.conv0[:, r])
        bank.ssm_state[:, slot].copy_(log.ssm0[:, r])
    top = max(a for _, a, _ in rows)
    slots = [[-1] * nb for _ in range(top + 1)]
    for r, a, slot in rows:
        for j in range(a + 1):
            slots[j][r] = slot
    sl = torch.tensor(slots, dtype=torch.int64, device=bank.device)
    c, be = model.config, model.backend
    H, P, G, N = c.mamba_n_heads, c.mamba_head_dim, c.mamba_n_groups, c.mamba_d_state
    xbc = torch.empty(nb, c.conv_dim, dtype=log.xbc.dtype, device=bank.device)
    y = torch.empty(nb, H, P, dtype=log.xbc.dtype, device=bank.device)
    for i in c.mamba_layer_ids:
        p, m = f"layers.{i}.mamba.", bank.mamba_index[i]
        for j in range(top + 1):
            s = slice(j * nb, (j + 1) * nb)
            ops.conv1d_step(log.xbc[m, s], model.w[p + "conv1d.weight"], model.w.get(p + "conv1d.bias"), bank.conv(i),
                            sl[j], out=xbc, backend=be)
            x, B, C = torch.split(xbc, [c.d_inner, G * N, G * N], dim=-1)
            ops.ssm_step(bank.ssm(i), x.reshape(nb, H, P), log.dt[m, s], model.A[i], B.reshape(nb, G, N),
                         C.reshape(nb, G, N), model.w[p + "D"], model.w[p + "dt_bias"], sl[j], dt_limit=c.dt_limit,
                         out=y, backend=be)


class VerifyRunner:
    """Verify forwards at (rows, width) shapes: exact (eager, no graphs), bucketed eager (pad_decode: the bitwise
    reference), or bucketed CUDA graphs (greedy batches; a batch with seeded rows runs the same shapes eagerly)."""

    def __init__(self, engine, k: int, capture: bool, padded: bool):
        self.model, self.bank, self.k = engine.model, engine.bank, k
        dev, R = engine.device, engine.R
        self.device = dev
        self.capture = capture and dev.type == "cuda"
        self.padded = padded or self.capture
        self.row_buckets, self.widths = buckets(R), width_buckets(k)
        self.replaying = bool(getattr(getattr(self.model, "options", None), "spec_replay", False))
        self.snaps = None if self.replaying else PositionSnapshots(engine.bank, R, k)
        self.inputs = InputLog(engine.bank, R, k, self.model.dtype) if self.replaying else None
        self.last_nb = 0
        self.stage = torch.zeros(3 * R * (k + 1) + R, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.meta: dict[tuple[int, int], Tensor] = {}
        self.tok: dict[tuple[int, int], Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, int], Tensor] = {}
        self.pool = None
        self.replays = 0
        self.source = None     # device drafts: (VerifyBatch, room [nb]) -> (drafts [nb, k], m [nb]) (spec_device.py)
        self.res: Tensor | None = None                     # ... and the buffer their step's results are packed into
        self.device_logits: Tensor | None = None           # the last device-draft step's logits [w*nb, V]

    def shape(self, rows: int, width: int) -> tuple[int, int]:
        """(nb, w) a batch of `rows` rows of at most `width` inputs runs at."""
        if not self.padded:
            return rows, width
        return next(b for b in self.row_buckets if b >= rows), next(w for w in self.widths if w >= width)

    def _buffers(self, key: tuple[int, int]) -> tuple[Tensor, Tensor]:
        if key not in self.meta:
            nb, w = key
            self.meta[key] = torch.zeros(3 * nb * w + nb, dtype=torch.int64, device=self.device)
            self.tok[key] = torch.zeros(nb * w, dtype=torch.int64, device=self.device)
        return self.meta[key], self.tok[key]

    def _body(self, key: tuple[int, int]) -> Tensor:
        meta, tok = self._buffers(key)
        logits = verify_forward(self.model, VerifyBatch.view(meta, *key), self.bank, self.snaps, self.inputs)
        ops.greedy_sample(logits, tok, backend=self.model.backend)
        return logits

    def _capture(self, key: tuple) -> None:
        """Warm up on a side stream with every slot -1 (the bank untouched), then capture with the garbage collector
        off (graphs.capture); metadata restored. key (nb, w): the host-draft body; (nb, w, "device"): the device-draft
        body (_device_body)."""
        meta, _ = self._buffers(key[:2])
        body = (lambda: self._device_body(key[:2])) if len(key) == 3 else (lambda: self._body(key))
        g, self._logits[key] = capture_idle(meta, *key[:2], body, self.pool)   # the logits: the graph's output
        self.pool = g.pool()
        self.graphs[key] = g

    def capture_all(self) -> None:
        """Capture every (rows, width) bucket now (benchmarks: no capture inside a timed run), largest first."""
        if self.capture:
            for key in sorted(((nb, w) for nb in self.row_buckets for w in self.widths), reverse=True):
                for k in ((key, key + ("device",)) if self.source is not None else (key,)):
                    if k not in self.graphs:
                        self._capture(k)

    def run(self, inputs: list[list[int]], pos: list[int], slot: list[int],
            seeded: list[tuple[int, float, int, int]]) -> tuple[int, int, Tensor, Tensor]:
        """Row r feeds inputs[r] at positions pos[r].. in slot[r]; returns (nb, w, logits [w*nb, V], tokens [w*nb])
        with token t = j*nb + r the sampler's choice after row r's input j. `seeded` (logits row, temperature, seed,
        position) is laid out by the caller with shape()'s nb."""
        S = len(inputs)
        nb, w = self.shape(S, max(len(x) for x in inputs))
        vals = pack_rows(inputs, pos, slot, nb, w) + list(slot) + [slot[0]] * (nb - S)
        key, self.last_nb = (nb, w), nb
        meta, tok = self._buffers(key)
        upload_meta(self.stage, meta, vals)
        if self.capture and not seeded:
            if key not in self.graphs:
                self._capture(key)
            self.graphs[key].replay()
            self.replays += 1
            return nb, w, self._logits[key], tok
        logits = verify_forward(self.model, VerifyBatch.view(meta, nb, w), self.bank, self.snaps, self.inputs)
        sample_rows(logits, tok, seeded, backend=self.model.backend)
        return nb, w, logits, tok

    def _device_body(self, key: tuple[int, int], seeded: list | None = None) -> Tensor:
        """The device-draft verify step, one graph per bucket (or eager): each row's room from the slots the host
        laid out, drafts and counts from `source` (fixed shapes), the drafts' ids and slot -1 past m written into
        the metadata, the verify forward, sampling, and tokens | drafts | counts packed into `res`."""
        nb, w = key
        meta, tok = self._buffers(key)
        vb = VerifyBatch.view(meta, nb, w)
        room = (vb.slot[1:] >= 0).sum(0)                   # [nb]: row r was laid out for room_r drafts
        drafts, m = self.source(vb, room)                  # [nb, k], [nb]
        vb.ids.view(w, nb)[1:].copy_(drafts[:, :w - 1].t())
        j = torch.arange(1, w, dtype=torch.int64, device=self.device)[:, None]
        vb.slot[1:].copy_(torch.where(j <= m[None, :], vb.slot[1:], torch.full_like(vb.slot[1:], -1)))
        logits = verify_forward(self.model, vb, self.bank, self.snaps, self.inputs)
        if seeded is None:
            ops.greedy_sample(logits, tok, backend=self.model.backend)
        else:
            sample_rows(logits, tok, seeded, backend=self.model.backend)
        T, k = nb * w, self.k
        self.res[:T].copy_(tok)
        self.res[T:T + nb * k].copy_(drafts.reshape(-1))
        self.res[T + nb * k:T + nb * k + nb].copy_(m)
        return logits

    def run_device(self, last: list[int], pos: list[int], slot: list[int], room: list[int],
                   seeded: list[tuple[int, float, int, int]]) -> tuple[int, int]:
        """run() with the drafts made on the device by `source` (docs/engine.md "Device proposals"): row r feeds
        last[r] then its m[r] <= room[r] drafts at positions pos[r]..; the host lays the batch out for room[r]
        drafts, _device_body (a graph when greedy) does the rest. Returns (nb, w); the step's tokens [nb*w], drafts
        [nb*k] and counts [nb] are in res. No host read."""
        S = len(last)
        nb, w = self.shape(S, 1 + max(room))
        rows = [[t] + [0] * n for t, n in zip(last, room)]      # the drafts' ids are written on the device
        vals = pack_rows(rows, pos, slot, nb, w) + list(slot) + [slot[0]] * (nb - S)
        key, self.last_nb = (nb, w), nb
        meta, _ = self._buffers(key)
        upload_meta(self.stage, meta, vals)
        if self.capture and not seeded:
            if key + ("device",) not in self.graphs:
                self._capture(key + ("device",))
            self.graphs[key + ("device",)].replay()
            self.replays += 1
            self.device_logits = self._logits[key + ("device",)]      # the graph's own output
        else:                          # eager: its own logits (never the graph's entry, which a replay still fills)
            self.device_logits = self._device_body(key, seeded)
        return nb, w

    def replay(self, rows: list[tuple[int, int, int]]) -> None:
        """The replay rollback of rows (r, a, slot) of the last verify batch (FastOptions.spec_replay)."""
        replay(self.model, self.bank, self.inputs, self.last_nb, rows)

    def scratch_bytes(self) -> int:
        """Device bytes the rollback keeps (snapshots, or the replay's log)."""
        return (self.snaps or self.inputs).nbytes()
