"""The fast-path model: one batched forward over a step's packed batch, reading/writing the state bank by slot.

Mirrors oracle/model.py (same canonical weight names, same block order) but runs every sequence of a step at
once: the first `n_dec` tokens are decode rows (one token each; `conv1d_step`, `ssm_step`, `attention_decode`),
the rest are prefill pieces packed by `cu_seqlens` (`causal_conv1d_varlen`, `ssd_varlen`,
`attention_prefill_varlen`).  Recurrent state and KV live in the engine's `StateBank`, indexed by slot; slot -1
is a padding row (CUDA graphs) that no kernel reads or writes.  Logits are computed only for the last token
of every sequence.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fastpath.engine import ops
from fastpath.engine.bank import StateBank
from fastpath.kernels.matmul import matmul, route_matmuls
from fastpath.options import FastOptions, OptionsError, check_options
from fastpath.kernels.act_mul import act_mul as _act_mul
from fastpath.kernels.fused_add_norm import add_rms_norm as _add_rms_norm
from fastpath.kernels.gemv import ConvStep, ResidualAdd, gemv as _gemv
from fastpath.kernels.gemv_rows import K_MULTIPLE as GEMV_ROWS_K_MULTIPLE, MAX_ROWS as GEMV_MAX_ROWS
from fastpath.kernels.gemv_rows import gemv_rows as _gemv_rows


@dataclass
class StepBatch:
    """Device inputs of one forward (decode rows first, then prefill pieces)."""
    ids: Tensor            # [T] int64 packed input tokens
    pos: Tensor            # [T] int64 absolute positions
    n_dec: int             # decode rows = tokens 0..n_dec-1, sequences 0..n_dec-1
    dec_slot: Tensor       # [n_dec] int32 (-1 = padding row)
    pre_cu: Tensor         # [n_pre+1] int32, cumulative lengths of the prefill pieces (relative to n_dec)
    pre_slot: Tensor       # [n_pre] int32
    pre_start: Tensor      # [n_pre] int64 absolute start position of each piece
    pre_init: Tensor       # [n_pre] bool: piece continues a state (start > 0)
    last: Tensor           # [S] int64 index of each sequence's last token (logits rows)
    pre_cu_host: list[int]
    pre_start_host: list[int]
    table: object = None   # the SSD chunk table of the prefill pieces (built once per step)
    checkpoints: tuple = ()  # (piece, absolute position p, bank slot): the piece's Mamba state at the chunk start
                             # p inside it is also written to that slot (prefix-cache checkpoints, DESIGN §12)
    pre_slot_host: list | None = None   # pre_slot as a host list (None: attention reads the device tensors back)
    pre_tok_seq: Tensor | None = None   # [T - n_dec] int32 piece of each prefill token (built once per step)
    attn_plan: object = None            # the attention layers' shared AttentionPlan (FastModel.prepare, once per step)


class FastModel:
    """Weights on the device in the compute dtype, and `forward(batch, bank) -> logits [S, V]`; how it runs (kernel
    backend, fusions, folds, batch invariance) is the frozen `options` (fastpath/options.py)."""

    def __init__(self, config, tensors: dict[str, Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, options: FastOptions | None = None):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.options = o = check_options(options)
        self.backend = o.backend
        f32 = ("A_log", "D", "dt_bias")
        self.w: dict[str, Tensor] = {}
        for k, v in tensors.items():
            keep32 = k.rsplit(".", 1)[-1] in f32 or k.endswith("router.weight") or k.endswith("score_bias")
            self.w[k] = v.to(device=self.device, dtype=torch.float32 if keep32 else dtype).contiguous()
        for k in [k for k in self.w if k.endswith("mlp.gate_proj.weight") or k.endswith("shared.gate_proj.weight")]:
            p = k[: -len("gate_proj.weight")]
            if p + "up_proj.bias" not in self.w and p + "gate_proj.bias" not in self.w:
                self.w[p + "gate_up.weight"] = torch.cat([self.w.pop(k), self.w.pop(p + "up_proj.weight")])
        for k in [k for k in self.w if k.endswith("attn.q_proj.weight")]:       # q, k, v in one GEMM
            p = k[: -len("q_proj.weight")]
            names = [p + "q_proj", p + "k_proj", p + "v_proj"]
            with_bias = {n + ".bias" in self.w for n in names}
            if all(n + ".weight" in self.w for n in names) and len(with_bias) == 1:
                self.w[p + "qkv.weight"] = torch.cat([self.w.pop(n + ".weight") for n in names])
                if with_bias == {True}:
                    self.w[p + "qkv.bias"] = torch.cat([self.w.pop(n + ".bias") for n in names])
        if "lm_head.weight" not in self.w:          # tied embeddings
            self.w["lm_head.weight"] = self.w["embed.weight"]
        self.gains_folded = self._fold_gains() if o.fold_gains else set()
        self.A = {i: -torch.exp(self.w[f"layers.{i}.mamba.A_log"]) for i in config.mamba_layer_ids}
        c = config
        self.stream_dtype = torch.float32 if (c.residual_in_fp32 and dtype != torch.float32) else dtype

    def _fold_gains(self) -> set[str]:
        """W·diag(g) for each RMSNorm gain g whose normalised rows only projections read (mixer norms, MLP norms,
        the gated norm before out_proj; not the final norm — lm_head may be tied — nor a MoE norm); the norm's gain
        becomes 1. The same function (up to rounding), and a one-row projection can now normalise its own input."""
        w, done = self.w, set()

        def fold(norm: str, consumers: list[str]) -> None:
            names = [n + ".weight" for n in consumers if n + ".weight" in w]
            if norm not in w or not names:
                return
            g = w[norm].float()
            for n in names:
                if w[n].shape[-1] != g.shape[0]:
                    raise ValueError(f"FastModel: {n} has {w[n].shape[-1]} input columns, its norm {norm} has "
                                     f"{g.shape[0]} gains")
                w[n] = (w[n].float() * g).to(w[n].dtype)
            w[norm] = torch.ones_like(w[norm])
            done.add(norm)

        for i, spec in enumerate(self.config.layers):
            p = f"layers.{i}."
            if spec.mixer == "mamba":
                fold(p + "mixer_norm.weight", [p + "mamba.in_proj"])
                fold(p + "mamba.norm.weight", [p + "mamba.out_proj"])
            elif spec.mixer == "attention":
                fold(p + "mixer_norm.weight", [p + "attn." + n for n in ("qkv", "q_proj", "k_proj", "v_proj")])
            if spec.ffn == "mlp":
                fold(p + "ffn_norm.weight", [p + "mlp." + n for n in ("gate_up", "gate_proj", "up_proj")])
        return done

    # ------------------------------------------------------------------------------------------- blocks
    def with_options(self, **changes) -> "FastModel":
        """The same weights (shared, not copied) under other run options (not fold_gains: it is applied to the
        weights at load)."""
        o = self.options.replace(**changes)
        if o.fold_gains != self.options.fold_gains:
            raise OptionsError("options.fold_gains: applied to the weights at load; build a new FastModel")
        m = copy.copy(self)
        m.options, m.backend = o, o.backend
        return m

    def _norm(self, h: Tensor, name: str) -> Tensor:
        return ops.rms_norm_gated(h.to(self.dtype), None, self.w[name], 1, self.config.norm_eps, backend=self.backend)

    def _fusing(self) -> bool:
        return self.options.fused and self.backend == "triton"

    def _add_norm(self, h: Tensor, out: Tensor | None, name: str,
                  rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(h + out, norm(h + out)) — the residual add of the previous sublayer (out None: none) fused with
        the next norm; `rows` selects the rows to normalise (then the returned stream is not updated)."""
        if self._fusing():
            hn, u = _add_rms_norm(h, out, self.w[name], self.config.norm_eps, self.config.residual_multiplier,
                                  rows=rows, out_dtype=self.dtype)
            return (h if hn is None else hn), u
        if out is not None:
            h = self._residual(h, out)
        return h, self._norm(h if rows is None else h.index_select(0, rows), name)

    def _gemv_path(self, x: Tensor) -> bool:
        """x may take a Triton GEMV (one-row or few-row): on CUDA with the Triton backend, not batch-invariant, last
        dim contiguous (gemv_on_cpu: on CPU too, through the interpreter — the CPU tier's way to test the wiring)."""
        o = self.options
        return (not o.batch_invariant and (x.is_cuda or o.gemv_on_cpu) and self.backend == "triton"
                and x.stride(-1) == 1)

    def _gemv_ok(self, x: Tensor) -> bool:
        """One row: projections go through the Triton GEMV and its folds."""
        return self.options.gemv and x.shape[0] == 1 and self._gemv_path(x)

    def _proj(self, x: Tensor, w: Tensor, b: Tensor | None = None, act: str | None = None,
              conv: ConvStep | None = None, rms_eps: float | None = None,
              residual: ResidualAdd | None = None) -> Tensor:
        """x · wᵀ (+ b); act: x is [gate | up] and the product is act(gate)·up · wᵀ; conv: the decode conv step
        in the GEMV's epilogue; rms_eps: x RMS-normalised first; residual: added to the stream, not returned
        (all four: one-row GEMV only)."""
        if self._gemv_ok(x):
            return _gemv(x, w, b, act=act, conv=conv, rms_eps=rms_eps, residual=residual)
        if act is not None or conv is not None or rms_eps is not None or residual is not None:
            raise ValueError("FastModel._proj: act, conv, rms_eps and residual are only folded into the one-row "
                             "Triton GEMV")
        if self._gemv_rows_ok(x):
            return _gemv_rows(x, w, b)
        return self._dense(x, w, b)

    def _gemv_rows_ok(self, x: Tensor) -> bool:
        """2..8 rows (a bs1 verify, a small batch): the few-row GEMV, which reads each weight once for all rows;
        only where K is a multiple of 16, where its rows are proven to have the one-row GEMV's bits (gemv_rows.py)."""
        return (self.options.gemv_rows and 2 <= x.shape[0] <= GEMV_MAX_ROWS and x.shape[1] % GEMV_ROWS_K_MULTIPLE == 0
                and self._gemv_path(x))

    def _dense(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """A projection off the one-row GEMV path; batch-invariant: the fixed-tile matmul (tiles keyed on N, K)."""
        return matmul(x, w, b) if self.options.batch_invariant else F.linear(x, w, b)

    def _linear(self, x: Tensor, name: str, act: str | None = None, conv: ConvStep | None = None,
                rms_eps: float | None = None, residual: ResidualAdd | None = None) -> Tensor:
        return self._proj(x, self.w[name + ".weight"], self.w.get(name + ".bias"), act, conv, rms_eps, residual)

    def mamba(self, i: int, u: Tensor, b: StepBatch, bank: StateBank, res: ResidualAdd | None = None) -> Tensor:
        """Mamba2 mixer of layer i over the packed batch; conv/ssm state at bank[slot]. res (the folded one-row
        step): u is the un-normalised stream and the output is added to res in out_proj's epilogue."""
        c, p, n = self.config, f"layers.{i}.mamba.", b.n_dec
        eps = c.norm_eps if res is not None else None
        conv_w, conv_b = self.w[p + "conv1d.weight"], self.w.get(p + "conv1d.bias")
        conv = None
        if self._fusing() and self.options.fold_conv and n == 1 and b.ids.shape[0] == 1 and self._gemv_ok(u):
            xbc = torch.empty(1, c.conv_dim, dtype=self.dtype, device=self.device)
            conv = ConvStep(conv_w, conv_b, bank.conv(i), b.dec_slot, xbc, c.d_inner)   # in in_proj's epilogue
        zxbcdt = self._linear(u, p + "in_proj", conv=conv, rms_eps=eps)
        T, H, P, G, N = zxbcdt.shape[0], c.mamba_n_heads, c.mamba_head_dim, c.mamba_n_groups, c.mamba_d_state
        z, xBC, dt = torch.split(zxbcdt, [c.d_inner, c.conv_dim, H], dim=-1)     # strided views, no copies
        if conv is None:                        # not folded: the decode rows' conv step as its own kernel
            xbc = torch.empty(T, c.conv_dim, dtype=zxbcdt.dtype, device=zxbcdt.device)
            if n:
                ops.conv1d_step(xBC[:n], conv_w, conv_b, bank.conv(i), b.dec_slot, out=xbc[:n], backend=self.backend)
        if b.checkpoints:                       # before the conv call below rewrites the pieces' windows
            self._checkpoint_windows(xBC, b, bank.conv(i))
        if T > n:
            ops.causal_conv1d_varlen(xBC[n:], conv_w, conv_b, bank.conv(i), b.pre_cu, b.pre_slot, b.pre_init,
                                     out=xbc[n:], validate=b.table is None, backend=self.backend, tok_seq=b.pre_tok_seq)
        x, B, C = torch.split(xbc, [c.d_inner, G * N, G * N], dim=-1)
        x, B, C = x.reshape(T, H, P), B.reshape(T, G, N), C.reshape(T, G, N)
        A, D, dt_bias = self.A[i], self.w[p + "D"], self.w[p + "dt_bias"]
        y = torch.empty(T, H, P, dtype=x.dtype, device=x.device)
        gate_in_step = res is not None and G == 1 and T == n   # the whole gated norm folded: y·silu(z) in ssm_step
        if n:
            ops.ssm_step(bank.ssm(i), x[:n], dt[:n], A, B[:n], C[:n], D, dt_bias, b.dec_slot,
                         z=z[:n].reshape(n, H, P) if gate_in_step else None, dt_limit=c.dt_limit, out=y[:n],
                         backend=self.backend)
        if T > n:
            ops.ssd_varlen(x[n:], dt[n:], A, B[n:], C[n:], D, dt_bias, bank.ssm(i), b.pre_cu_host, b.pre_slot,
                           b.pre_start_host, b.pre_init, c.chunk_size, dt_limit=c.dt_limit, out=y[n:],
                           table=b.table, backend=self.backend, checkpoints=b.checkpoints)
        if gate_in_step:                        # its RMS in out_proj's x load, its gain folded into out_proj
            return self._linear(y.reshape(T, c.d_inner), p + "out_proj", rms_eps=eps, residual=res)
        y = self._gated_norm(y.reshape(T, c.d_inner), z, self.w[p + "norm.weight"])
        return self._linear(y, p + "out_proj", residual=res)

    @staticmethod
    def _checkpoint_windows(xBC: Tensor, b: StepBatch, conv_bank: Tensor) -> None:
        """conv_bank[slot] := the conv window at p (the d_conv-1 inputs before p, oldest first) for every
        checkpoint (piece, p, slot): the rows of the piece's own inputs, after its initial window when p is
        closer than d_conv-1 to the piece's start — the very values a piece ending at p leaves."""
        K1 = conv_bank.shape[-1]
        for s, p, slot in b.checkpoints:
            rel, lo = p - b.pre_start_host[s], b.n_dec + b.pre_cu_host[s]
            rows = xBC[lo + max(rel - K1, 0):lo + rel].t().to(conv_bank.dtype)
            if rel < K1:                        # part of the window is the piece's initial one (zeros if none)
                init = conv_bank.index_select(0, b.pre_slot[s:s + 1].long())[0] * b.pre_init[s].to(conv_bank.dtype)
                rows = torch.cat([init[:, rel:], rows], dim=1)
            conv_bank[slot].copy_(rows)

    def _gated_norm(self, y: Tensor, z: Tensor, weight: Tensor) -> Tensor:
        """Gated RMSNorm over groups of d_inner / n_groups (the hook TP overrides for groups spanning ranks)."""
        c = self.config
        return ops.rms_norm_gated(y, z, weight, c.mamba_n_groups, c.norm_eps, backend=self.backend)

    def attention(self, i: int, u: Tensor, b: StepBatch, bank: StateBank, res: ResidualAdd | None = None) -> Tensor:
        """GQA attention of layer i (RoPE, KV written to bank[slot] at the tokens' positions); res as in mamba."""
        c, p, n = self.config, f"layers.{i}.attn.", b.n_dec
        eps = c.norm_eps if res is not None else None
        Hq, Hkv, d = c.n_attn_heads, c.n_kv_heads, c.attn_head_dim
        T = u.shape[0]
        if p + "qkv.weight" in self.w:                     # one GEMM; q, k, v are strided views of its output
            qk, v = self._linear(u, p + "qkv", rms_eps=eps).split([(Hq + Hkv) * d, Hkv * d], dim=-1)
            qk, v = qk.view(T, Hq + Hkv, d), v.view(T, Hkv, d)
            q, k = qk[:, :Hq], qk[:, Hq:]
        else:
            q = self._linear(u, p + "q_proj", rms_eps=eps).view(T, Hq, d)
            k = self._linear(u, p + "k_proj", rms_eps=eps).view(T, Hkv, d)
            v = self._linear(u, p + "v_proj", rms_eps=eps).view(T, Hkv, d)
        kc, vc = bank.kv(i)
        o = torch.empty(T, Hq, d, dtype=q.dtype, device=q.device)
        if n:                                              # decode rows: RoPE inside the decode kernel
            ops.attention_decode(q[:n], k[:n], v[:n], kc, vc, b.dec_slot, b.pos[:n], c.attn_scale, out=o[:n],
                                 rope_dim=c.rope_dim, rope_theta=c.rope_theta, backend=self.backend)
        if T > n:
            qp, kp = q[n:], k[n:]
            if c.rope_dim:                                 # prefill rows: q and k heads rotated in one launch
                if p + "qkv.weight" in self.w:
                    qk = ops.rope(qk[n:], b.pos[n:], c.rope_dim, c.rope_theta, backend=self.backend)
                    qp, kp = qk[:, :Hq], qk[:, Hq:]
                else:
                    qp, kp = (ops.rope(t, b.pos[n:], c.rope_dim, c.rope_theta, backend=self.backend)
                              for t in (qp, kp))
            host = None if b.pre_slot_host is None else (b.pre_cu_host, b.pre_slot_host, b.pre_start_host)
            ops.attention_prefill_varlen(qp, kp, v[n:], kc, vc, b.pre_cu, b.pre_slot, b.pre_start,
                                         c.attn_scale, out=o[n:], backend=self.backend, host=host,
                                         tok_seq=b.pre_tok_seq, plan=b.attn_plan)
        return self._linear(o.view(T, c.n_attn_heads * c.attn_head_dim), p + "o_proj", residual=res)

    def _residual(self, h: Tensor, out: Tensor) -> Tensor:
        m = self.config.residual_multiplier
        return h + (out if m == 1.0 else out * m).to(self.stream_dtype)

    def _act(self, x: Tensor) -> Tensor:
        return F.silu(x) if self.config.mlp_act == "silu" else torch.square(F.relu(x))

    def mlp(self, x: Tensor, p: str, res: ResidualAdd | None = None) -> Tensor:
        """Gated SiLU (gate_proj present) or squared-ReLU MLP; res as in mamba."""
        eps = self.config.norm_eps if res is not None else None
        if p + "gate_up.weight" in self.w:                  # gate and up in one GEMM
            gu = self._linear(x, p + "gate_up", rms_eps=eps)
            if self._fusing() and self.options.fold_act and self._gemv_ok(gu):   # act·mul folded into the down GEMV's x load
                return self._linear(gu, p + "down_proj", act=self.config.mlp_act, residual=res)
            if self._fusing():
                hidden = _act_mul(gu, self.config.mlp_act)
            else:
                gate, up = gu.chunk(2, dim=-1)
                hidden = self._act(gate) * up
        elif p + "gate_proj.weight" in self.w:
            hidden = self._act(self._linear(x, p + "gate_proj", rms_eps=eps)) * self._linear(x, p + "up_proj",
                                                                                            rms_eps=eps)
        else:
            hidden = self._act(self._linear(x, p + "up_proj", rms_eps=eps))
        return self._linear(hidden, p + "down_proj", residual=res)

    def moe(self, x: Tensor, p: str) -> Tensor:
        """Routed experts (dense over experts, gate weight 0 where not chosen) plus the shared expert;
        batch-invariant: its router and expert matmuls on the fixed-tile kernel."""
        if self.options.batch_invariant:
            with route_matmuls():
                return self._moe(x, p)
        return self._moe(x, p)

    def _moe(self, x: Tensor, p: str) -> Tensor:
        c, w = self.config, self.w
        logits = F.linear(x.float(), w[p + "router.weight"])                              # [T, E]
        if c.moe_router == "softmax_topk":
            top_logits, idx = logits.topk(c.moe_top_k, dim=-1)
            gates = torch.softmax(top_logits, dim=-1)
        else:   # sigmoid_grouped
            scores = torch.sigmoid(logits)
            choice = scores + w[p + "router.score_bias"]
            T, E = choice.shape
            gsc = choice.view(T, c.moe_n_group, E // c.moe_n_group).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(gsc, dtype=torch.bool).scatter_(1, gsc.topk(c.moe_topk_group, -1).indices, True)
            mask = keep[:, :, None].expand(T, c.moe_n_group, E // c.moe_n_group).reshape(T, E)
            idx = choice.masked_fill(~mask, float("-inf")).topk(c.moe_top_k, dim=-1).indices
            gates = scores.gather(1, idx)
            if c.moe_norm_topk_prob:
                gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
            gates = gates * c.moe_routed_scaling_factor
        dense = torch.zeros_like(logits).scatter_(1, idx, gates)                          # [T, E]
        gate_w, up_w, down_w = w.get(p + "experts.gate_proj"), w[p + "experts.up_proj"], w[p + "experts.down_proj"]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(up_w.shape[0]):
            up = x @ up_w[e].T
            hidden = self._act(x @ gate_w[e].T) * up if gate_w is not None else self._act(up)
            out += dense[:, e:e + 1] * (hidden @ down_w[e].T).float()
        out = out.to(x.dtype)
        if c.moe_shared_intermediate_size:
            out = out + self.mlp(x, p + "shared.")
        return out

    # ------------------------------------------------------------------------------------------ forward
    def prepare(self, b: StepBatch, bank: StateBank) -> StepBatch:
        """Build the step's metadata that every attention layer shares (b.attn_plan: checks, split plan, one
        pinned copy, the partials' workspace) once, before the layers; idempotent. forward() calls it; a CUDA
        graph capture calls it first, so the capture records no host->device copy."""
        c = self.config
        if (b.attn_plan is None and self.backend == "triton" and c.attention_layer_ids and b.pre_slot_host is not None
                and b.ids.shape[0] > b.n_dec):
            kc, _ = bank.kv(c.attention_layer_ids[0])
            b.attn_plan = ops.attention_prefill_plan(b.pre_cu_host, b.pre_slot_host, b.pre_start_host, kc.shape[0],
                                                     kc.shape[1], c.n_attn_heads, c.attn_head_dim, kc.device,
                                                     dtype=kc.dtype)
        return b

    def forward(self, b: StepBatch, bank: StateBank) -> Tensor:
        """Packed batch -> logits [S, V] of each sequence's last token; the bank is updated in place."""
        c, w = self.config, self.w
        self.prepare(b, bank)
        h = F.embedding(b.ids, w["embed.weight"])
        if c.embedding_multiplier != 1.0:
            h = h * c.embedding_multiplier
        if self._row_folds(b, h):
            return self._forward_row(b, bank, h)
        h = h.to(self.stream_dtype)
        out = None                                      # the pending sublayer output (added with the next norm)
        for i, spec in enumerate(c.layers):
            if spec.mixer is not None:
                h, u = self._add_norm(h, out, f"layers.{i}.mixer_norm.weight")
                out = self.mamba(i, u, b, bank) if spec.mixer == "mamba" else self.attention(i, u, b, bank)
            if spec.ffn is not None:
                h, u = self._add_norm(h, out, f"layers.{i}.ffn_norm.weight")
                p = f"layers.{i}."
                out = self.mlp(u, p + "mlp.") if spec.ffn == "mlp" else self.moe(u, p + "moe.")
        _, h = self._add_norm(h, out, "final_norm.weight", rows=b.last)
        return self._logits(h)

    def _logits(self, h: Tensor) -> Tensor:
        logits = self._proj(h, self.w["lm_head.weight"])
        c = self.config
        return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits

    def _row_folds(self, b: StepBatch, e: Tensor) -> bool:
        """The folded one-row step applies: one decode row, GEMV path, every mixer/MLP norm gain folded."""
        if not (self.options.fold_norm and self._fusing() and b.n_dec == 1 and e.shape[0] == 1 and self._gemv_ok(e)):
            return False
        for i, spec in enumerate(self.config.layers):
            if spec.ffn not in (None, "mlp") or (spec.ffn and f"layers.{i}.ffn_norm.weight" not in self.gains_folded):
                return False
            if spec.mixer and f"layers.{i}.mixer_norm.weight" not in self.gains_folded:
                return False
        return True

    def _forward_row(self, b: StepBatch, bank: StateBank, e: Tensor) -> Tensor:
        """forward() of one decode row with no norm kernels: each projection that reads a normalised row
        normalises it in its x load (gains folded at load), each sublayer's last projection adds its output to
        the residual stream in its epilogue (ResidualAdd), so a Mamba layer is 5 kernels instead of 8."""
        c = self.config
        stream = e.to(self.stream_dtype)
        res = ResidualAdd(stream, stream.to(self.dtype, copy=True), c.residual_multiplier)
        for i, spec in enumerate(c.layers):
            if spec.mixer == "mamba":
                self.mamba(i, res.x, b, bank, res)
            elif spec.mixer is not None:
                self.attention(i, res.x, b, bank, res)
            if spec.ffn is not None:
                self.mlp(res.x, f"layers.{i}.mlp.", res)
        _, h = self._add_norm(stream, None, "final_norm.weight", rows=b.last)
        return self._logits(h)


class BatchInvariantModel(FastModel):
    """FastModel with `options.batch_invariant` set (same constructor): every projection, the MoE router and
    experts on the fixed-tile matmul, never the one-row GEMV (FastModel._dense, _gemv_ok, moe read the option)."""

    def __init__(self, config, tensors: dict[str, Tensor], device="cpu", dtype=torch.float32,
                 options: FastOptions | None = None):
        super().__init__(config, tensors, device, dtype, check_options(options).replace(batch_invariant=True))


def make_model(config, tensors: dict[str, Tensor], device="cpu", dtype=torch.float32,
               options: FastOptions | None = None) -> FastModel:
    """FastModel, or its batch-invariant variant when `options.batch_invariant`."""
    options = check_options(options)
    return (BatchInvariantModel if options.batch_invariant else FastModel)(config, tensors, device, dtype, options)
