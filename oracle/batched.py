"""Many sequences in one pass over the weights: the oracle's layers applied to a batch of independent segments.

A segment is a prefill piece or a decode token of one request, continuing from that request's own state:

    h_s = embed[tokens_s]                                       for every segment s
    for each layer:  rows(h) = [h_1; h_2; ...]                  the segments' rows stacked
        u = rms_norm(rows(h));  a = in_proj(u)                  row-wise: one GEMM over every segment's rows
        a_s -> mixer sequence part on state_s                   conv window, scan, attention keys: per segment
        h = h + out_proj(rows(a))                               row-wise again
        h = h + ffn(rms_norm(h))
    logits = lm_head(rms_norm(rows(h)))

A model that batches so has `stack_rows` (OracleModel); the scheduler and qualify's teacher-forced scoring
use `batches(model)` to tell. Each layer's weights are read once for all segments: the pass costs what one request's pass costs while its
rows are few. Every row-wise step (norms, projections, FFN, lm_head) runs either on the stack (`stacked=True`:
the GPU, one GEMM per weight) or segment by segment (`stacked=False`: the CPU, where a GEMM's summation order
depends on its row count, so that each segment's numbers are bitwise those of `OracleModel.forward` on its own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .gated_norm import rms_norm
from .mamba2 import mamba2_sequence
from .mlp import linear, mlp, moe
from .model import OracleModel, OracleState, attention_sequence, embed, lm_head, token_ids


@dataclass
class Segment:
    """One request's tokens for this pass and the state they continue from (None: a fresh request)."""
    tokens: list[int]
    state: OracleState | None
    scan: str = "chunked"            # "chunked" (a prefill piece) or "recurrence" (a decode token)


def batches(model: object) -> bool:
    """Whether `model` runs forward_segments (an OracleModel; not a stand-in or a streamed oracle)."""
    return isinstance(model, OracleModel) and getattr(model, "stack_rows", None) is not None


@dataclass
class _Rows:
    """The segments' rows stacked, and how to run a row-wise function over them."""
    sizes: list[int]
    stacked: bool

    def apply(self, f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """f over every row of x [sum(sizes), ...]: once on the stack, or segment by segment."""
        if self.stacked:
            return f(x)
        return torch.cat([f(part) for part in torch.split(x, self.sizes)])

    def split(self, x: Tensor) -> tuple[Tensor, ...]:
        return torch.split(x, self.sizes)


def forward_segments(model: OracleModel, segments: list[Segment],
                     stacked: bool | None = None) -> list[tuple[Tensor, OracleState]]:
    """Every segment's (logits [len, vocab], new state), computed layer by layer for all segments at once;
    `stacked` None: the model's own choice (OracleModel.stack_rows)."""
    if not segments:
        return []
    stacked = model.stack_rows if stacked is None else stacked
    c, w, dtype = model.config, model.weights, model.dtype
    olds = [s.state if s.state is not None else model.new_state() for s in segments]
    news = [OracleState(position=o.position) for o in olds]
    idss = [token_ids(s.tokens) for s in segments]
    for j, ids in enumerate(idss):
        if len(ids) == 0:
            raise ValueError(f"segments[{j}].tokens: empty")
        bad = [int(t) for t in ids if not 0 <= int(t) < c.vocab_size]
        if bad:
            raise ValueError(f"segments[{j}].tokens: ids {bad[:5]} out of range for vocab_size={c.vocab_size}")
    rows = _Rows([len(ids) for ids in idss], stacked)
    positions = [torch.arange(o.position, o.position + n, device=model.device) for o, n in zip(olds, rows.sizes)]
    h = rows.apply(lambda ids: embed(c, w, ids, model.stream_dtype), torch.cat(idss).to(model.device))
    for i in range(c.num_layers):
        h = _layer(model, i, h, rows, olds, news, positions, [s.scan for s in segments])
    logits = rows.apply(lambda x: lm_head(c, w, x, dtype), h)
    for new, old, n in zip(news, olds, rows.sizes):
        new.position = old.position + n
    return list(zip(rows.split(logits), news))


def _layer(model: OracleModel, i: int, h: Tensor, rows: _Rows, olds: list[OracleState], news: list[OracleState],
           positions: list[Tensor], scans: list[str]) -> Tensor:
    """Layer i over the stacked rows h (as model.layer_forward per segment); writes each segment's layer-i state."""
    c, w, dtype = model.config, model.weights, model.dtype
    p, spec, sd = f"layers.{i}.", c.layers[i], h.dtype
    if spec.mixer is not None:
        u = rows.apply(lambda x: rms_norm(x.to(dtype), w[p + "mixer_norm.weight"], c.norm_eps), h)
        if spec.mixer == "mamba":
            q = p + "mamba."
            a = rows.apply(lambda x: linear(x, w[q + "in_proj.weight"], w.get(q + "in_proj.bias")), u)
            ys = []
            for j, a_s in enumerate(rows.split(a)):
                y, news[j].conv[i], news[j].ssm[i] = mamba2_sequence(c, w, q, a_s, olds[j].conv[i], olds[j].ssm[i],
                                                                     olds[j].position, scans[j])
                ys.append(y)
            out = rows.apply(lambda x: linear(x, w[q + "out_proj.weight"], w.get(q + "out_proj.bias")),
                             torch.cat(ys))
        else:
            q = p + "attn."
            qkv = [rows.split(rows.apply(lambda x, n=n: linear(x, w[q + f"{n}_proj.weight"],
                                                                w.get(q + f"{n}_proj.bias")), u)) for n in "qkv"]
            os = []
            for j in range(len(rows.sizes)):
                o, news[j].k[i], news[j].v[i] = attention_sequence(c, qkv[0][j], qkv[1][j], qkv[2][j], olds[j].k[i],
                                                                   olds[j].v[i], positions[j])
                os.append(o)
            out = rows.apply(lambda x: linear(x, w[q + "o_proj.weight"], w.get(q + "o_proj.bias")), torch.cat(os))
        h = h + (out * c.residual_multiplier).to(sd)
    if spec.ffn is not None:
        def ffn(x: Tensor) -> Tensor:
            u = rms_norm(x.to(dtype), w[p + "ffn_norm.weight"], c.norm_eps)
            return mlp(u, w, p + "mlp.", c.mlp_act) if spec.ffn == "mlp" else moe(u, c, w, p + "moe.")
        h = h + (rows.apply(ffn, h) * c.residual_multiplier).to(sd)
    return h
