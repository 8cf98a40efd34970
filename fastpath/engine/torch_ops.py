"""Plain-torch, batched stand-ins for the fast-path kernels, behind the engine's kernel boundary (ops.py).

Used only where a Triton kernel is not available (FastOptions(backend="torch")); the engine's default is Triton.
Same contract as the kernels: packed varlen tokens, per-sequence slot into the bank, slot -1 = padding row
(no read, no write, zero output), chunk boundaries of the SSD at absolute multiples of chunk_size.
The decode-step ops (conv_step, ssm_step, attention_step) read no value back to the host, so a CUDA graph can
capture them; the prefill ops take host lists.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def conv_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, conv_bank: Tensor, slots: list[int],
                cu: list[int], has_init: list[bool]) -> Tensor:
    """Causal depthwise conv over packed x [T, D] (no activation); window read/written at bank[slot]."""
    K = weight.shape[1]
    y = torch.zeros_like(x)
    for s, slot in enumerate(slots):
        lo, hi = cu[s], cu[s + 1]
        if slot < 0 or hi == lo:
            continue
        win = conv_bank[slot].to(x.dtype) if has_init[s] else x.new_zeros(x.shape[1], K - 1)
        u = torch.cat([win.T, x[lo:hi]], dim=0)
        acc = torch.zeros(hi - lo, x.shape[1], dtype=torch.float32, device=x.device)
        if bias is not None:
            acc = acc + bias.float()
        for k in range(K):
            acc = acc + weight[:, k].float() * u[k:k + hi - lo].float()
        y[lo:hi] = acc.to(x.dtype)
        conv_bank[slot] = u[u.shape[0] - (K - 1):].T.to(conv_bank.dtype)
    return y


def write_rows(bank: Tensor, idx: Tensor, valid: Tensor, new: Tensor) -> None:
    """bank[idx[r]] = new[r] for the rows with valid[r], without a host sync (CUDA-graph capturable).

    A boolean-mask select would read its count back to the host. Instead every invalid row repeats the first valid
    row's write (or, with none valid, row 0 rewrites its slot's own value): duplicate targets carry equal values,
    so the result does not depend on the order of the writes."""
    n = idx.shape[0]
    first = torch.argmax(valid.to(torch.int32))
    src = torch.where(valid, torch.arange(n, device=idx.device), first)
    tgt = idx.index_select(0, src)
    old = bank.index_select(0, tgt)
    keep = valid.index_select(0, src).reshape(n, *([1] * (new.dim() - 1)))
    bank.index_copy_(0, tgt, torch.where(keep, new.index_select(0, src).to(bank.dtype), old))


def _snapshot(snap: Tensor | None, valid: Tensor, new: Tensor) -> None:
    """snap[r] := new[r] for the valid rows (write_rows, row r to row r); other rows keep what they held."""
    if snap is not None:
        write_rows(snap, torch.arange(new.shape[0], device=new.device), valid, new)


def conv_step(x: Tensor, weight: Tensor, bias: Tensor | None, conv_bank: Tensor, slots: Tensor,
              snap: Tensor | None = None) -> Tensor:
    """One token per row x [n, D]; rows with slot -1 untouched (output 0); snap [n, D, K-1]: live rows' new
    windows also stored there."""
    valid = slots >= 0
    idx = slots.clamp(min=0).long()
    win = conv_bank.index_select(0, idx).float()                       # [n, D, K-1]
    u = torch.cat([win, x.float()[:, :, None]], dim=2)                 # [n, D, K]
    y = (u * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    y = torch.where(valid[:, None], y, torch.zeros_like(y))
    write_rows(conv_bank, idx, valid, u[:, :, 1:])
    _snapshot(snap, valid, u[:, :, 1:])
    return y.to(x.dtype)


def _segsum(a: Tensor) -> Tensor:
    cs = torch.cumsum(a, dim=0).transpose(0, 1)
    S = cs[:, :, None] - cs[:, None, :]
    tri = torch.tril(torch.ones(a.shape[0], a.shape[0], dtype=torch.bool, device=a.device))
    return S.masked_fill(~tri, float("-inf"))


def ssd_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, ssm_bank: Tensor,
               slots: list[int], cu: list[int], start_pos: list[int], has_init: list[bool],
               chunk_size: int, checkpoints: list[tuple[int, int, int]] = ()) -> Tensor:
    """Chunked SSD per packed sequence (fp32), state read/written at bank[slot]. x [T,H,P], B/C [T,G,N].
    checkpoints (sequence, absolute position, bank slot): the state at that chunk start also goes to bank[slot]."""
    ckpt = {(s, p): b for s, p, b in checkpoints}
    T, H, P = x.shape
    rep = H // B.shape[1]
    y = torch.zeros(T, H, P, dtype=torch.float32, device=x.device)
    xf, dtf, Af = x.float(), dt.float(), A.float()
    Bh, Ch = B.float().repeat_interleave(rep, 1), C.float().repeat_interleave(rep, 1)
    for s, slot in enumerate(slots):
        lo, hi = cu[s], cu[s + 1]
        if slot < 0 or hi == lo:
            continue
        h = ssm_bank[slot].float() if has_init[s] else xf.new_zeros(H, P, B.shape[2])
        c0 = lo
        while c0 < hi:
            if (s, start_pos[s] + c0 - lo) in ckpt:
                ssm_bank[ckpt.pop((s, start_pos[s] + c0 - lo))] = h.to(ssm_bank.dtype)
            c1 = min(hi, c0 + chunk_size - (start_pos[s] + c0 - lo) % chunk_size)
            a = dtf[c0:c1] * Af
            L = torch.exp(_segsum(a))
            scores = torch.einsum("ihn,jhn->hij", Ch[c0:c1], Bh[c0:c1]) * L
            y[c0:c1] = torch.einsum("hij,jh,jhp->ihp", scores, dtf[c0:c1], xf[c0:c1])
            y[c0:c1] += torch.einsum("ihn,hpn,ih->ihp", Ch[c0:c1], h, torch.exp(torch.cumsum(a, 0)))
            to_end = torch.exp(a.sum(0)[None] - torch.cumsum(a, 0))
            h = torch.exp(a.sum(0))[:, None, None] * h + torch.einsum(
                "jh,jh,jhp,jhn->hpn", to_end, dtf[c0:c1], xf[c0:c1], Bh[c0:c1])
            c0 = c1
        ssm_bank[slot] = h.to(ssm_bank.dtype)
    if D is not None:
        y = y + D.float()[None, :, None] * xf
    return y.to(x.dtype)


def ssm_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, ssm_bank: Tensor,
             slots: Tensor, snap: Tensor | None = None) -> Tensor:
    """One token per row: x [n,H,P], dt [n,H], B/C [n,G,N]; state at bank[slot]; slot -1 skipped; snap [n,H,P,N]:
    live rows' new states also stored there."""
    n, H, P = x.shape
    rep = H // B.shape[1]
    valid = slots >= 0
    idx = slots.clamp(min=0).long()
    h = ssm_bank.index_select(0, idx).float()
    dtf = dt.float()
    Bh, Ch = B.float().repeat_interleave(rep, 1), C.float().repeat_interleave(rep, 1)
    h = torch.exp(dtf * A.float())[:, :, None, None] * h + \
        (dtf[:, :, None] * x.float())[:, :, :, None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", h, Ch)
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    write_rows(ssm_bank, idx, valid, h)
    _snapshot(snap, valid, h)
    return torch.where(valid[:, None, None], y, torch.zeros_like(y)).to(x.dtype)


def rms_norm_gated(y: Tensor, z: Tensor, weight: Tensor, n_groups: int, eps: float) -> Tensor:
    """Grouped gated RMSNorm over the last dim, fp32 statistics."""
    g = y.float() * F.silu(z.float())
    shp = g.shape
    g = g.reshape(*shp[:-1], n_groups, shp[-1] // n_groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * g.reshape(shp)).to(y.dtype)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: list[int],
                     cu: list[int], start_pos: list[int], scale: float) -> Tensor:
    """Write k/v [T,Hkv,d] into cache[slot, start:start+L], then causal GQA over cache[slot, :start+L]."""
    out = torch.zeros_like(q)
    rep = q.shape[1] // k.shape[1]
    for s, slot in enumerate(slots):
        lo, hi, p0 = cu[s], cu[s + 1], start_pos[s]
        if slot < 0 or hi == lo:
            continue
        k_cache[slot, p0:p0 + hi - lo] = k[lo:hi].to(k_cache.dtype)
        v_cache[slot, p0:p0 + hi - lo] = v[lo:hi].to(v_cache.dtype)
        kk = k_cache[slot, :p0 + hi - lo].float().repeat_interleave(rep, 1)
        vv = v_cache[slot, :p0 + hi - lo].float().repeat_interleave(rep, 1)
        sc = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), kk) * scale
        qpos = torch.arange(p0, p0 + hi - lo, device=q.device)
        kpos = torch.arange(0, p0 + hi - lo, device=q.device)
        sc = sc.masked_fill(~(kpos[None, :] <= qpos[:, None])[None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(sc, -1), vv).to(q.dtype)
    return out


def attention_step(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, pos: Tensor,
                   scale: float) -> Tensor:
    """One token per row q/k/v [n,H(kv),d]: k/v written at cache[slot, pos], then GQA over cache[slot, :pos+1];
    rows with slot -1 untouched (output 0). No host sync (CUDA-graph capturable)."""
    n, L = q.shape[0], k_cache.shape[1]
    rep = q.shape[1] // k.shape[1]
    valid = slots >= 0
    sl, ps = slots.clamp(min=0).long(), pos.clamp(min=0, max=L - 1).long()
    flat = sl * L + ps
    write_rows(k_cache.view(-1, *k_cache.shape[2:]), flat, valid, k)
    write_rows(v_cache.view(-1, *v_cache.shape[2:]), flat, valid, v)
    kk = k_cache.index_select(0, sl).float().repeat_interleave(rep, 2)          # [n, L, H, d]
    vv = v_cache.index_select(0, sl).float().repeat_interleave(rep, 2)
    sc = torch.einsum("nhd,nlhd->nhl", q.float(), kk) * scale
    seen = torch.arange(L, device=q.device)[None, :] <= ps[:, None]              # [n, L]
    sc = sc.masked_fill(~seen[:, None, :], float("-inf"))
    y = torch.einsum("nhl,nlhd->nhd", torch.softmax(sc, -1), vv)
    return torch.where(valid[:, None, None], y, torch.zeros_like(y)).to(q.dtype)
