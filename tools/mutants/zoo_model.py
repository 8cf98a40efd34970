"""Architecture details of the fast model: MoE routing, the Granite multipliers and the logit transforms."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import MODEL, K, T_GEN, T_ARCH, T_CORPUS, T_ATTN


# ------------------------------------------------ model (architecture details)
ARCHITECTURE: list[Mutant] = [
    Mutant("gqa_heads_interleaved", "attention heads",
           "query head h reads KV head h % q_per_kv (repeat vs repeat_interleave confusion)",
           K + "attention.py", "    kvh = hq // q_per_kv\n", "    kvh = hq % q_per_kv\n",
           (T_ATTN,)),
    Mutant("moe_softmax_before_topk", "MoE routing",
           "router softmax over all experts, then top-k, without renormalising (the other family's convention)",
           MODEL, "            gates = torch.softmax(top_logits, dim=-1)\n",
           "            gates = torch.softmax(logits, dim=-1).gather(1, idx)\n",
           (T_ARCH,)),
    Mutant("residual_multiplier_dropped", "multipliers",
           "Granite's residual_multiplier is not applied to the mixer/FFN outputs",
           MODEL, "        return h + (out if m == 1.0 else out * m).to(self.stream_dtype)",
           "        return h + out.to(self.stream_dtype)",
           (T_ARCH,)),
]

# ------------------------------------------------ logit transforms (found by the blind run)
# greedy tokens unchanged: only seeded sampling or a logits-level check can see them
LOGIT_TRANSFORMS: list[Mutant] = [
    Mutant("logits_scaling_multiplied", "logit transform",
           "Granite's logits_scaling multiplies the final logits instead of dividing them (argmax unchanged)",
           MODEL, "return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits",
           "return logits * c.logits_scaling if c.logits_scaling != 1.0 else logits",
           (T_ARCH + "[granitemoehybrid]",)),
    Mutant("final_logit_softcap", "logit transform",
           "a Gemma-style final-logit softcap (30·tanh(x/30)) applied although no hybrid config asks for one "
           "(monotone: greedy tokens unchanged)",
           MODEL, "return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits",
           "logits = 30.0 * torch.tanh(logits / 30.0)\n"
           "        return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits",
           (T_CORPUS + "[seeded_sampling]", T_GEN)),
]

# ------------------------------------------------ multipliers (found by the blind run)
MULTIPLIERS: list[Mutant] = [
    Mutant("attention_multiplier_ignored", "multipliers",
           "Granite's attention_multiplier is ignored: the fast path scales scores by the default head_dim^-0.5",
           MODEL, "c.attn_scale, out=o[:n],", "c.attn_head_dim ** -0.5, out=o[:n],",
           (T_ARCH + "[granitemoehybrid]",),
           more=((MODEL, "c.attn_scale, out=o[n:]", "c.attn_head_dim ** -0.5, out=o[n:]"),)),
    Mutant("embedding_multiplier_prefill_only", "multipliers",
           "Granite's embedding_multiplier is applied to the prefill tokens only (decode rows' embeddings skip it)",
           MODEL, "            h = h * c.embedding_multiplier\n",
           "            h = torch.cat([h[:b.n_dec], h[b.n_dec:] * c.embedding_multiplier])\n",
           (T_ARCH + "[granitemoehybrid]",)),
    Mutant("residual_multiplier_on_sum", "multipliers",
           "the fused add+norm applies the residual multiplier to the sum h + out instead of to the sublayer "
           "output alone",
           K + "fused_add_norm.py", "            d = (d * mult).to(d_ptr.dtype.element_ty).to(tl.float32)\n"
                                    "        x = (x + d).to(hout_ptr.dtype.element_ty)\n",
           "            x = x * mult\n            d = (d * mult).to(d_ptr.dtype.element_ty).to(tl.float32)\n"
           "        x = (x + d).to(hout_ptr.dtype.element_ty)\n",
           ("tests/test_kernel_fused_add_norm.py::test_add_rms_norm_matches_fp64_math",)),
]
