"""llama.cpp's quantized K/V cache as a declared precision (DESIGN §20): the configurations of the llama.cpp adapter
that set the attention cache's ggml type (llama_context_params.type_k = type_v) and the judging constants measured
for each (a MeasuredPrecision, as q8_0 weights got theirs: measure_tau.py --kv-type; docs/findings.md, L12).

llama.cpp quantizes only the attention K/V cells (the recurrent conv and SSM rows stay f32 whatever type_k/type_v
say), refuses a quantized V cache without flash attention, and a quantized K or V type whose block (32 values for
q8_0 and q4_0) does not divide the attention head dim (src/llama-context.cpp, llama_init_from_model): so a
configuration runs with flash attention on, and reaches only models whose attention head dim is a multiple of 32.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridqual.adapters.base import Configuration, MeasuredPrecision


@dataclass(frozen=True)
class KVCache:
    """One K/V cache setting: the ggml type of K and V (worker.Engine.KV_TYPES), flash attention, the precision it
    declares (None: not measured, so it is not offered), and the shipped instances that reach it."""
    name: str                          # the configuration's name (qualify --configuration NAME)
    kv_type: str
    flash_attn: str
    precision: MeasuredPrecision | None
    reach: tuple[str, ...]
    why: str

    def configuration(self) -> Configuration:
        return Configuration(self.name, self.reach, self.why)


KV_Q8_0: MeasuredPrecision | None = None

KV_CACHES: dict[str, KVCache] = {
    "kv_q8_0": KVCache("kv_q8_0", "q8_0", "on", KV_Q8_0,
                       ("zoo-granite_hd32/seed_compaction", "zoo-granite_hd32/prefix_multi_turn"),
                       "the attention K/V cache in q8_0 (8-bit blocks of 32; flash attention, which a quantized V "
                       "cache needs), judged with the constants measured for it"),
}


def kv_cache(name: str | None) -> KVCache | None:
    """The K/V setting of configuration `name` (None: the adapter's own); a ValueError naming the known ones."""
    if name is None:
        return None
    if name not in KV_CACHES:
        raise ValueError(f"configuration: {name!r} is not a K/V cache setting of the llama.cpp adapter "
                         f"(known: {', '.join(KV_CACHES)})")
    return KV_CACHES[name]
