"""Megatron-Core's dynamic inference engine behind hybridqual's adapter protocol (docs/megatron.md).

`--engine megatron` (or `hybridqual.adapters.megatron:MegatronAdapter`) drives DynamicInferenceEngine through add_request /
step_modern. Importing this package needs no Megatron: the adapter, the weight mapping and the flash-attn stand-in
import megatron-core only when used, so the default test tier runs without it (scripts/install-megatron.sh makes
the venv that has it).
"""
from __future__ import annotations


from hybridqual.adapters.megatron.install import available, check_install  # noqa: F401


def __getattr__(name: str):
    if name in ("MegatronAdapter", "MegatronRoundedAdapter", "MegatronPrefixAdapter", "MegatronMTPAdapter",
                "MegatronGraphsAdapter"):
        from hybridqual.adapters.megatron import adapter
        return getattr(adapter, name)
    if name in ("MegatronPrefixMTPAdapter", "MegatronPreemptAdapter", "MegatronPauseAdapter",
                "MegatronPreemptMTPAdapter", "MegatronPauseMTPAdapter"):
        from hybridqual.adapters.megatron import variants
        return getattr(variants, name)
    raise AttributeError(name)
