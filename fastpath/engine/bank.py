"""The ONE state bank: every request's recurrent state and KV cache, indexed by slot, allocated once.

    conv_state[m, slot, conv_dim, d_conv-1]   (m = index among the Mamba layers; oldest input first)
    ssm_state [m, slot, H, P, N]              (fp32 by default)
    k_cache / v_cache[a, slot, max_len, Hkv, d]   (a = index among the attention layers; model dtype)

With a prefix cache (`pool = M`), the same tensors hold M more slots R..R+M-1: the checkpoint pool
(docs/engine.md "Prefix cache"); rows never map to them, and `copy_state` moves a checkpoint in or out.

The tensors are allocated in __init__ and never reallocated: their data_ptr is stable for the engine's life
(compaction moves row bookkeeping only, never state).  Kernels receive per-layer views `bank.ssm(layer)` etc.,
which share that storage.  Admission zeroes the slot's recurrent state (conv + ssm) before its first
prefill; the KV cache needs no zeroing because attention only reads positions below the request's length.
"""
from __future__ import annotations

import torch
from torch import Tensor


class StateBank:
    """Slot-indexed conv/ssm state for the Mamba layers and KV cache for the attention layers."""

    def __init__(self, config, max_requests: int, max_len: int, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype = torch.float32, state_dtype: torch.dtype = torch.float32, pool: int = 0):
        if max_requests < 1:
            raise ValueError(f"StateBank: max_requests must be >= 1, got {max_requests}")
        if max_len < 1:
            raise ValueError(f"StateBank: max_len must be >= 1, got {max_len}")
        if pool < 0:
            raise ValueError(f"StateBank: pool must be >= 0, got {pool}")
        self.config, self.R, self.max_len, self.pool = config, max_requests, max_len, pool
        n_slots = max_requests + pool
        self.device = torch.device(device)
        self.mamba_index = {lid: i for i, lid in enumerate(config.mamba_layer_ids)}
        self.attn_index = {lid: i for i, lid in enumerate(config.attention_layer_ids)}
        n_m, n_a = len(self.mamba_index), len(self.attn_index)
        c = config
        self.conv_state = torch.zeros(n_m, n_slots, c.conv_dim, c.mamba_d_conv - 1,
                                      dtype=state_dtype, device=self.device)
        self.ssm_state = torch.zeros(n_m, n_slots, c.mamba_n_heads, c.mamba_head_dim, c.mamba_d_state,
                                     dtype=state_dtype, device=self.device)
        kv_shape = (n_a, n_slots, max_len, c.n_kv_heads, c.attn_head_dim) if n_a else (0,)
        self.k_cache = torch.zeros(kv_shape, dtype=kv_dtype, device=self.device)
        self.v_cache = torch.zeros(kv_shape, dtype=kv_dtype, device=self.device)
        self._ptrs = self.data_ptrs()

    # ---- per-layer views (same storage) -----------------------------------------------------------------
    def conv(self, layer_id: int) -> Tensor:
        """conv_state view [R, conv_dim, d_conv-1] of Mamba layer `layer_id`."""
        return self.conv_state[self.mamba_index[layer_id]]

    def ssm(self, layer_id: int) -> Tensor:
        """ssm_state view [R, H, P, N] of Mamba layer `layer_id`."""
        return self.ssm_state[self.mamba_index[layer_id]]

    def kv(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """(k_cache, v_cache) views [R, max_len, Hkv, d] of attention layer `layer_id`."""
        i = self.attn_index[layer_id]
        return self.k_cache[i], self.v_cache[i]

    # ---- slot lifecycle ----------------------------------------------------------------------------------
    def zero_slot(self, slot: int) -> None:
        """Zero the recurrent state of `slot` (every Mamba layer), in place."""
        if not 0 <= slot < self.R:
            raise IndexError(f"StateBank.zero_slot: slot {slot} outside 0..{self.R - 1}")
        self.conv_state[:, slot].zero_()
        self.ssm_state[:, slot].zero_()

    def pool_slot(self, index: int) -> int:
        """Bank slot of checkpoint `index` of the prefix-cache pool (0 <= index < pool)."""
        if not 0 <= index < self.pool:
            raise IndexError(f"StateBank.pool_slot: index {index} outside 0..{self.pool - 1}")
        return self.R + index

    def copy_state(self, src: int, dst: int, kv_len: int, state: bool = True) -> None:
        """Slot dst := slot src: every Mamba layer's conv window and SSM state (unless `state` is False), and K/V
        of positions [0, kv_len) of every attention layer (device copies, in stream order; the prefix cache's
        store and restore)."""
        if state:
            self.conv_state[:, dst].copy_(self.conv_state[:, src])
            self.ssm_state[:, dst].copy_(self.ssm_state[:, src])
        if self.k_cache.numel() and kv_len:
            self.k_cache[:, dst, :kv_len].copy_(self.k_cache[:, src, :kv_len])
            self.v_cache[:, dst, :kv_len].copy_(self.v_cache[:, src, :kv_len])

    def slot_state(self, slot: int) -> dict[str, Tensor]:
        """A copy of everything `slot` holds (for tests: state must not move under compaction)."""
        out = {"conv": self.conv_state[:, slot].clone(), "ssm": self.ssm_state[:, slot].clone()}
        if self.k_cache.numel():
            out["k"], out["v"] = self.k_cache[:, slot].clone(), self.v_cache[:, slot].clone()
        return out

    # ---- stability / size --------------------------------------------------------------------------------
    def data_ptrs(self) -> tuple[int, int, int, int]:
        """data_ptr of the four bank tensors."""
        return (self.conv_state.data_ptr(), self.ssm_state.data_ptr(),
                self.k_cache.data_ptr(), self.v_cache.data_ptr())

    def assert_stable(self) -> None:
        """Raise if any bank tensor was reallocated since construction."""
        if self.data_ptrs() != self._ptrs:
            raise AssertionError("StateBank: a bank tensor moved (data_ptr changed)")

    def nbytes(self) -> int:
        """Bytes held by the bank (state + KV)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.conv_state, self.ssm_state, self.k_cache, self.v_cache))
