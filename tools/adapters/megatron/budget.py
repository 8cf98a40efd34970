"""Megatron's KV block budget from a trace's `engine.kv_tokens` (DESIGN §18), so its own pause / evict path runs.

Megatron-Core 0.19.2 sizes its KV cache in bytes (`InferenceConfig.buffer_size_gb`, `paused_buffer_size_gb`); a
hybrid context first takes `max_requests` Mamba states out of the total, proportionally from both buffers
(contexts/dynamic_context.py:510-528), then cuts each into blocks: `block_count` total (one a dummy block) of
which `paused_count` are reserved for paused requests (`kv_block_allocator.py:45-49`, active = total - paused -
1). `sizes` solves those lines for byte counts that give exactly the wanted block counts; `check` reads the
built allocator back and raises naming the field if Megatron made other counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1024 ** 3


@dataclass(frozen=True)
class BlockBudget:
    """The KV blocks Megatron should have: `active` for running requests, `paused` reserved for paused ones."""
    active: int
    paused: int

    @classmethod
    def from_trace(cls, trace, block: int, paused: int) -> "BlockBudget | None":
        """engine.kv_tokens positions as whole blocks of `block` tokens (None: the trace sets no KV budget)."""
        kv = getattr(trace.engine, "kv_tokens", None)
        if kv is None:
            return None
        if kv < block:
            raise ValueError(f"engine.kv_tokens: {kv} positions hold no whole KV block of {block} tokens")
        return cls(kv // block, paused)


def mamba_bytes_per_request(ctx) -> int:
    """One request's Mamba state bytes as Megatron counts them (dynamic_context.py:428-445)."""
    one = (math.prod(ctx.mamba_conv_states_shape) * ctx.mamba_conv_states_dtype.itemsize
           + math.prod(ctx.mamba_ssm_states_shape) * ctx.mamba_ssm_states_dtype.itemsize)
    per = one * ctx.num_mamba_layers
    if ctx.num_speculative_tokens > 0:
        per += one * ctx.num_mamba_layers * (ctx.num_speculative_tokens + 1)
    return per


def sizes(ctx, budget: BlockBudget) -> tuple[float, float | None]:
    """(buffer_size_gb, paused_buffer_size_gb) for a context like `ctx` (same model and max_requests) to cut
    `budget.active + budget.paused + 1` blocks, `budget.paused` of them paused (with uvm 0 the paused buffer is
    inside the first); each count is aimed half a block above so Megatron's integer divisions land on it."""
    mamba = ctx.max_requests * mamba_bytes_per_request(ctx)
    block = ctx.block_size_bytes
    kv_total = (budget.active + budget.paused + 1.5) * block       # what Megatron keeps of each buffer for KV
    kv_paused = (budget.paused + 0.5) * block if budget.paused else 0.0
    keep = (kv_total + kv_paused) / (kv_total + kv_paused + mamba)  # the share left after the Mamba states
    return kv_total / keep / GB, (kv_paused / keep / GB if budget.paused else None)


def check(ctx, budget: BlockBudget) -> None:
    """Raise naming the field when Megatron's allocator does not hold the budget's block counts."""
    alloc = ctx.kv_block_allocator
    if alloc.active_count != budget.active or alloc.paused_count != budget.paused:
        raise RuntimeError(f"engine.kv_tokens: Megatron cut {alloc.active_count} active / {alloc.paused_count} "
                           f"paused KV blocks, the budget is {budget.active} / {budget.paused}")
