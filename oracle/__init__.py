"""hybridqual's truth side: the explicit hybrid Mamba2/attention model, its config/checkpoint IO, and (lazily)
the trace format and reference scheduler.

    model = oracle.load("goldens/models/tiny-bamba", dtype=torch.float64)
    logits, state = model.prefill([1, 2, 3]);  logits, state = model.decode(7, state)
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .checkpoint import CheckpointError, check_dtype, load_checkpoint, save_checkpoint
from .config import ConfigError, HybridConfig, LayerSpec, from_hf_config
from .model import OracleModel, OracleState

__all__ = ["load", "OracleModel", "OracleState", "HybridConfig", "LayerSpec", "from_hf_config", "load_checkpoint",
           "save_checkpoint", "ConfigError", "CheckpointError", "load_trace", "run_trace"]


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float64,
         device: torch.device | str | None = None) -> OracleModel:
    """Load an HF-format folder (config.json + safetensors) as an OracleModel computing in `dtype` on `device`
    (default CPU; logits come back on that device); refuses (CheckpointError) before allocating when that needs
    more memory than is available (oracle.streamed.require_fits: host RAM, and GPU memory for cuda). A bad `dtype`
    (not one of checkpoint.FLOAT_DTYPES) or `device` (not cpu or cuda) is a ValueError naming the argument."""
    from .streamed import _device, require_fits
    check_dtype(dtype)
    dev = _device(device)
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        require_fits(path, dtype, dev)
    config, tensors = load_checkpoint(path)
    return OracleModel(config, tensors, dtype=dtype, device=dev)


_LAZY = {"load_trace": "oracle.trace", "run_trace": "oracle.scheduler"}


def __getattr__(name: str) -> Any:
    """Lazily expose load_trace (oracle.trace) and run_trace (oracle.scheduler) without importing them eagerly."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'oracle' has no attribute {name!r}")
