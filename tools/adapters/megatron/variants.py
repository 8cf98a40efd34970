"""Megatron adapters that combine its features (docs/megatron.md): prefix caching with MTP speculation, and a KV
budget small enough that its engine pauses and evicts (DESIGN §17, §18 through Megatron-Core 0.19.2)."""
from __future__ import annotations

from hybridqual.adapters.megatron.adapter import MegatronMTPAdapter, MegatronRoundedAdapter

__all__ = ["MegatronPrefixMTPAdapter", "MegatronPreemptAdapter", "MegatronPauseAdapter", "MegatronPreemptMTPAdapter",
           "MegatronPauseMTPAdapter"]


class MegatronPrefixMTPAdapter(MegatronMTPAdapter):
    """MegatronMTPAdapter with Megatron's hybrid prefix caching on as in MegatronPrefixAdapter (LRU, Mamba states at
    KV block boundaries of the trace's prefix_cache block_size): both features in one engine, nothing in 0.19.2
    refuses the pair. The truth is unchanged: each request's tokens alone, cache and speculation off."""
    prefix_caching = True

    @classmethod
    def version(cls) -> str:
        return super().version() + "; hybrid prefix caching (LRU)"


class MegatronPreemptAdapter(MegatronRoundedAdapter):
    """MegatronRoundedAdapter whose KV cache holds the trace's engine.kv_tokens positions as blocks of `kv_block`
    tokens, with no block reserved for paused requests: a request that needs a new block when none is left is
    paused (`update_requests` step 5, dynamic_context.py) and, the paused buffer being empty, evicted at once
    (`evict_overflow_paused_requests`): its blocks and Mamba slot freed, it waits again first in line, and its
    record is checkpointed so it prefills prompt + the tokens it generated (`dynamic_engine.py:1533-1548`). Without
    kv_tokens the buffer is the default one and nothing preempts."""
    kv_block = 8
    paused_blocks = 0

    @classmethod
    def version(cls) -> str:
        return (super().version() + f"; KV buffer = engine.kv_tokens in blocks of {cls.kv_block} tokens, "
                f"{cls.paused_blocks} reserved for paused requests (evict and recompute)")


class MegatronPauseAdapter(MegatronPreemptAdapter):
    """MegatronPreemptAdapter with paused-request blocks reserved (`paused_buffer_size_gb`): a request without a
    block is paused with its KV blocks and Mamba state slot kept, and resumes in place when blocks free up; one
    that overflows the paused blocks is evicted as in MegatronPreemptAdapter."""
    paused_blocks = 2


class MegatronPreemptMTPAdapter(MegatronPreemptAdapter, MegatronMTPAdapter):
    """MegatronPreemptAdapter with MTP speculation (k = the trace's, else MegatronMTPAdapter.default_k): a request
    evicted between verify steps drops its drafts and is recomputed from prompt + its emitted tokens."""


class MegatronPauseMTPAdapter(MegatronPauseAdapter, MegatronMTPAdapter):
    """MegatronPauseAdapter with MTP speculation: a paused request keeps its sampled token and drafts
    (`paused_speculative_tokens`, dynamic_context.py update_requests step 7) and verifies them when it resumes."""
