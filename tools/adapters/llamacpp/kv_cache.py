"""llama.cpp's quantized K/V cache as a declared precision (DESIGN §20): the configurations of the llama.cpp adapter
that set the attention cache's ggml type (llama_context_params.type_k = type_v) and the judging constants measured
for each (a MeasuredPrecision, as q8_0 weights got theirs: measure_tau.py --configuration; docs/findings.md, L13).

llama.cpp quantizes only the attention K/V cells (the recurrent conv and SSM rows stay f32 whatever type_k/type_v
say), refuses a quantized V cache without flash attention, and a quantized K or V type whose block (32 values for
q8_0 and q4_0) does not divide the attention head dim (src/llama-context.cpp, llama_init_from_model): so a
quantized setting runs with flash attention on, and reaches only models whose attention head dim is a multiple of
32; f16 has neither limit.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridqual.adapters.base import Configuration, MeasuredPrecision


@dataclass(frozen=True)
class KVCache:
    """One K/V cache setting: the ggml type of K and V (worker.Engine.KV_TYPES), flash attention, the precision it
    declares (None: not measured, so it is not offered), the shipped models it is measured on (those whose attention
    it reaches and whose GGUF is the model) and the shipped instances that reach it in qualify's main job."""
    name: str                          # the configuration's name (qualify --configuration NAME)
    kv_type: str
    flash_attn: str
    precision: MeasuredPrecision | None
    models: tuple[str, ...]
    reach: tuple[str, ...]
    why: str

    def configuration(self) -> Configuration:
        return Configuration(self.name, self.reach, self.why)


KV_Q8_0 = MeasuredPrecision("f32 weights, q8_0 K/V cache, flash attention on", tau=0.055, logits_c=0.054, top_k=5,
                            measured_err=2.187e-2)
KV_F16 = MeasuredPrecision("f32 weights, f16 K/V cache, flash attention off", tau=0.0031, logits_c=0.0029, top_k=5,
                           measured_err=1.217e-3)

KV_CACHES: dict[str, KVCache] = {
    "kv_q8_0": KVCache("kv_q8_0", "q8_0", "on", KV_Q8_0, ("zoo-nemotron_h_hd32",),
                       ("zoo-nemotron_h_hd32/seed_compaction", "zoo-nemotron_h_hd32/prefix_multi_turn"),
                       "the attention K/V cache in q8_0 (8-bit blocks of 32; flash attention, which a quantized V "
                       "cache needs), judged with the constants measured for it"),
    "kv_q4_0": KVCache("kv_q4_0", "q4_0", "on", None, ("zoo-nemotron_h_hd32",), (),
                       "the attention K/V cache in q4_0: measured (measure_tau --configuration kv_q4_0) to show what "
                       "q8_0's constants refuse, not offered"),
    "kv_f16": KVCache("kv_f16", "f16", "off", KV_F16, ("zoo-granitemoehybrid", "zoo-nemotron_h_hd32"),
                      ("zoo-granitemoehybrid/seed_compaction", "zoo-granitemoehybrid/prefix_multi_turn"),
                      "the attention K/V cache in f16 (llama.cpp's default cache type; flash attention off), judged "
                      "with the constants measured for it"),
}


def kv_cache(name: str | None) -> KVCache | None:
    """The K/V setting of configuration `name` (None: the adapter's own); a ValueError naming the known ones."""
    if name is None:
        return None
    if name not in KV_CACHES:
        raise ValueError(f"configuration: {name!r} is not a K/V cache setting of the llama.cpp adapter "
                         f"(known: {', '.join(KV_CACHES)})")
    return KV_CACHES[name]
