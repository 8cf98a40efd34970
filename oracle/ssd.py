"""The Mamba2 state-space scan, two ways: the per-token recurrence (the truth) and the chunked SSD form.

Shapes (one sequence, no batch):  x [L, H, P]  dt [L, H]  A [H]  B, C [L, G, N]  D [H]  h [H, P, N].
`dt` here is the *processed* step (softplus(dt + dt_bias), clamped); `A` is negative (A = -exp(A_log)).
Head h reads group g = h // (H // G) of B and C.

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t ⊗ B_t          (state update, "ssm_step")
    y_t = h_t · C_t + D x_t                              (readout)

The chunked form splits positions at multiples of `chunk_size` in *absolute* position (`start_pos` is the
absolute position of x[0]), so the first chunk of a continuation piece may be short; within a chunk it is the
quadratic "segment-sum" form, between chunks the state is passed on.  Both forms are literal and unfused.
"""
from __future__ import annotations

import torch
from torch import Tensor


def heads_of_groups(B: Tensor, n_heads: int) -> Tensor:
    """[L, G, N] -> [L, H, N]: each head reads its group's B (or C)."""
    G = B.shape[1]
    if n_heads % G != 0:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_groups={G}")
    return B.repeat_interleave(n_heads // G, dim=1)


def ssm_step(h: Tensor, x_t: Tensor, dt_t: Tensor, A: Tensor, B_t: Tensor, C_t: Tensor,
             D: Tensor | None) -> tuple[Tensor, Tensor]:
    """One token: h [H,P,N], x_t [H,P], dt_t [H], B_t/C_t [H,N] (already per head). Returns (y_t [H,P], h)."""
    decay = torch.exp(dt_t * A)                                        # [H]
    h = decay[:, None, None] * h + (dt_t[:, None] * x_t)[:, :, None] * B_t[:, None, :]
    y_t = torch.einsum("hpn,hn->hp", h, C_t)
    if D is not None:
        y_t = y_t + D[:, None] * x_t
    return y_t, h


def ssm_recurrence(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                   h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The truth: apply ssm_step token by token. Returns (y [L,H,P], h_final [H,P,N])."""
    L, H, P = x.shape
    Bh, Ch = heads_of_groups(B, H), heads_of_groups(C, H)
    h = x.new_zeros(H, P, B.shape[-1]) if h0 is None else h0.to(x.dtype)
    ys = []
    for t in range(L):
        y_t, h = ssm_step(h, x[t], dt[t], A, Bh[t], Ch[t], D)
        ys.append(y_t)
    y = torch.stack(ys) if ys else x.new_zeros(0, H, P)
    return y, h


def chunk_bounds(start_pos: int, length: int, chunk_size: int) -> list[tuple[int, int]]:
    """[(lo, hi)) offsets into the piece, cut where start_pos + offset is a multiple of chunk_size."""
    bounds, lo = [], 0
    while lo < length:
        hi = min(length, lo + chunk_size - (start_pos + lo) % chunk_size)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def segsum(a: Tensor) -> Tensor:
    """a [l, H] -> S [H, l, l] with S[h,i,j] = sum_{j<k<=i} a[k,h] for i >= j, and -inf above the diagonal."""
    cs = torch.cumsum(a, dim=0).transpose(0, 1)                         # [H, l]
    S = cs[:, :, None] - cs[:, None, :]
    causal = torch.tril(torch.ones(a.shape[0], a.shape[0], dtype=torch.bool, device=a.device))
    return S.masked_fill(~causal, float("-inf"))


def ssd_chunk(x: Tensor, dt: Tensor, A: Tensor, Bh: Tensor, Ch: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk (within-chunk quadratic form + the carried-in state). Bh/Ch per head [l,H,N]."""
    a = dt * A                                                          # [l, H] log-decay per token
    decay_within = torch.exp(segsum(a))                                 # [H, l, l]  exp(sum a over (j, i])
    decay_from_start = torch.exp(torch.cumsum(a, dim=0))                # [l, H]     exp(sum a over [0, i])
    decay_to_end = torch.exp(a.sum(0)[None, :] - torch.cumsum(a, dim=0))  # [l, H]   exp(sum a over (j, end])
    scores = torch.einsum("ihn,jhn->hij", Ch, Bh) * decay_within        # C_i·B_j · decay(j -> i)
    y_diag = torch.einsum("hij,jh,jhp->ihp", scores, dt, x)             # tokens of this chunk
    y_off = torch.einsum("ihn,hpn,ih->ihp", Ch, h, decay_from_start)    # the state carried into the chunk
    h_new = torch.exp(a.sum(0))[:, None, None] * h + torch.einsum(
        "jh,jh,jhp,jhn->hpn", decay_to_end, dt, x, Bh)
    return y_diag + y_off, h_new


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                h0: Tensor | None = None, chunk_size: int = 256, start_pos: int = 0) -> tuple[Tensor, Tensor]:
    """Chunked SSD: chunks cut at absolute multiples of chunk_size, state passed between them."""
    L, H, P = x.shape
    Bh, Ch = heads_of_groups(B, H), heads_of_groups(C, H)
    h = x.new_zeros(H, P, B.shape[-1]) if h0 is None else h0.to(x.dtype)
    y = x.new_empty(L, H, P)
    for lo, hi in chunk_bounds(start_pos, L, chunk_size):
        y[lo:hi], h = ssd_chunk(x[lo:hi], dt[lo:hi], A, Bh[lo:hi], Ch[lo:hi], h)
    if D is not None:
        y = y + D[None, :, None] * x
    return y, h
