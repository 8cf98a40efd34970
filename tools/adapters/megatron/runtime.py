"""Process set-up for Megatron-Core (once per process) and the HybridModel built from our HF folder.

`setup(device)`: the flash-attn stand-in registered as `flash_attn` before Megatron is imported; on CPU the
Triton interpreter and a device shim (Megatron allocates with `device=torch.cuda.current_device()`: on CPU that
answers "cpu", and the `torch.cuda.device(i)` context of the Triton launch wrappers does nothing; nothing else of
torch.cuda is faked; autotuned Triton kernels take their first config, as the interpreter cannot time them); torch.distributed (world size 1, gloo on CPU, nccl on CUDA)
and Megatron's model-parallel state (TP = PP = 1). `build_model(path, device)` makes the model from a local layer
spec: Megatron's own MambaLayer / TransformerLayer / MLPLayer with its plain ColumnParallelLinear /
RowParallelLinear, local DotProductAttention and torch RMSNorm (the shipped hybrid specs are Transformer Engine
layers); HybridStack's final norm is TENorm by name in hybrid_block.py, so that one name is pointed at Megatron's
WrappedTorchNorm for the build (the "final-norm hook", docs/megatron.md).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

_DONE: dict[str, str] = {}


class _NoCudaDevice:
    """CPU stand-in for the `torch.cuda.device(idx)` context the Triton launch wrappers enter: nothing to select."""

    def __init__(self, device=None) -> None:
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def _block_volume(config) -> int:
    vol = 1
    for k, v in config.kwargs.items():
        if k.startswith("BLOCK") and isinstance(v, int):
            vol *= v
    return vol


def _first_config_autotune() -> None:
    """The interpreter cannot time configs (no driver): every @triton.autotune kernel runs the config with the
    smallest block volume (product of its BLOCK_* sizes; ties: the first listed), a deterministic rule instead of
    a benchmark that keeps the interpreter's per-program work small. Results do not depend on it beyond rounding."""
    from triton.runtime.autotuner import Autotuner
    orig_prune = Autotuner.prune_configs

    def prune(self, kwargs, *a):
        configs = orig_prune(self, kwargs, *a)
        return [min(configs, key=_block_volume)]
    Autotuner.prune_configs = prune
    Autotuner._bench = lambda self, *args, config=None, **kwargs: [0.0, 0.0, 0.0]


def setup(device: str = "cpu") -> None:
    """Idempotent per process; a second call with another device type is refused (one engine device per process)."""
    kind = torch.device(device).type
    if _DONE:
        if _DONE["kind"] != kind:
            raise RuntimeError(f"Megatron was set up for {_DONE['kind']} in this process; cannot switch to {kind}")
        return
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from hybridqual.adapters.megatron import cpu_shim
        cpu_shim.install()                                  # allocations, events, streams: docs in cpu_shim
        torch.cuda.device = _NoCudaDevice                   # Triton launch wrappers select the tensor's device
        _first_config_autotune()
    elif not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: CUDA is not available")
    else:
        torch.cuda.set_device(torch.device(device).index or 0)
    from hybridqual.adapters.megatron import flash_attn_standin
    flash_attn_standin.install()
    import torch.distributed as dist
    if not dist.is_initialized():
        init = Path(tempfile.mkdtemp(prefix="hq-megatron-")) / "store"
        dist.init_process_group("gloo" if kind == "cpu" else "nccl", init_method=f"file://{init}",
                                rank=0, world_size=1)
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if kind == "cpu":       # parameter init forks the CUDA RNG; every parameter is overwritten by our weights
        import contextlib
        from hybridqual.adapters.megatron import cpu_shim
        cpu_shim.install_after_import()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    else:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)
    _DONE["kind"] = kind


MTP_PATTERN = "-"     # one MTP depth, reused for every draft (mtp_use_repeated_layer): an MLP layer


def transformer_config(cfg, dtype: torch.dtype, mtp: bool = False, cuda_graphs: bool = False):
    """Megatron TransformerConfig for a mappable HybridConfig (mapping.check_mappable first); `mtp`: one repeated
    MTP layer (Megatron's async scheduling needs one MTP depth per draft, dynamic_engine.py:1045)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from hybridqual.adapters.megatron.mapping import layer_plan
    n_heads = cfg.n_attn_heads or 1
    return TransformerConfig(
        num_layers=len(layer_plan(cfg)),
        hidden_size=cfg.hidden_size, num_attention_heads=n_heads,
        num_query_groups=cfg.n_kv_heads or 1, kv_channels=cfg.attn_head_dim or cfg.hidden_size // n_heads,
        ffn_hidden_size=cfg.mlp_intermediate_size or 4 * cfg.hidden_size,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps,
        add_bias_linear=False, add_qkv_bias=False,
        mamba_state_dim=cfg.mamba_d_state or 16, mamba_head_dim=cfg.mamba_head_dim or 16,
        mamba_num_groups=cfg.mamba_n_groups, mamba_num_heads=cfg.mamba_n_heads or None,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=True, perform_initialization=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, tensor_model_parallel_size=1,
        use_mamba_mem_eff_path=False,
        **({"mtp_num_layers": 1, "mtp_use_repeated_layer": True} if mtp else {}),
        **({"cuda_graph_impl": "local"} if cuda_graphs else {}),    # per-layer inference graphs, no TE needed
    )


def local_mtp_block_spec():
    """Megatron's hybrid MTP block spec (hybrid_layer_specs.py's `_hybrid_mtp_block_spec`) with its TE norms and
    projection replaced by the plain ones: the inner layers come from the MTP pattern and the stack's submodules."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock, MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    return ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[
        ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
            enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
            layer_norm=WrappedTorchNorm))]))


def local_stack_spec(chunk_size: int = 128, mtp: bool = False):
    """HybridStack spec from Megatron's plain (non-TE) layers (`mtp`: with the MTP block spec)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=MambaMixer, params={"chunk_size": chunk_size}, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=SelfAttentionSubmodules(
                                          linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                          linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add)),
        mtp_block_spec=local_mtp_block_spec() if mtp else None,
    ))


def build_model(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32, mtp_seed: int | None = None,
                cuda_graphs: bool = False):
    """(HybridModel with our weights loaded strictly, HybridConfig); UnsupportedConfig names what cannot map.
    `mtp_seed`: also one MTP layer (pattern `MTP_PATTERN`) with random weights from that seed (our checkpoints
    have no MTP head; the truth of a speculative run is the non-speculative output, whatever the drafts)."""
    from oracle.checkpoint import load_checkpoint
    from hybridqual.adapters.megatron import mapping
    cfg, tensors = load_checkpoint(Path(path))
    mapping.check_mappable(cfg)
    setup(device)
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    mtp = mtp_seed is not None
    if cuda_graphs:     # CudaGraphManager asserts a graph-safe RNG tracker (cuda_graphs.py:1822): the inference one
        if torch.device(device).type != "cuda":
            raise RuntimeError("Megatron's CUDA graphs need a CUDA device")
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    tconf = transformer_config(cfg, dtype, mtp, cuda_graphs)
    saved = hybrid_block.TENorm
    hybrid_block.TENorm = WrappedTorchNorm          # the final-norm hook (see the module docstring)
    try:
        model = HybridModel(
            config=tconf, hybrid_stack_spec=local_stack_spec(cfg.chunk_size, mtp), vocab_size=cfg.vocab_size,
            max_sequence_length=4096, hybrid_layer_pattern=mapping.pattern(cfg) + (f"/{MTP_PATTERN}" if mtp else ""),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope" if cfg.attention_layer_ids and cfg.rope_dim else "none",
            rotary_percent=(cfg.rope_dim / cfg.attn_head_dim) if cfg.attention_layer_ids and cfg.rope_dim else 1.0,
            rotary_base=int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta)
    finally:
        hybrid_block.TENorm = saved
    sd = mapping.to_megatron(cfg, tensors)
    own = {k for k, _ in model.named_parameters() if not k.startswith("mtp.")}
    missing, unexpected = sorted(own - set(sd)), sorted(set(sd) - own)
    if missing or unexpected:
        raise RuntimeError(f"Megatron state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(mtp_seed or 0)
        for name, p in model.named_parameters():
            if name.startswith("mtp."):        # random MTP head: norms 1, matrices N(0, 0.02) (seeded)
                p.copy_(torch.ones_like(p) if p.dim() == 1 else
                        (0.02 * torch.randn(p.shape, generator=gen, dtype=torch.float32)).to(p.dtype))
                continue
            src = sd[name]
            if tuple(src.shape) != tuple(p.shape):
                raise RuntimeError(f"{name}: ours {tuple(src.shape)} vs Megatron's {tuple(p.shape)}")
            p.copy_(src.to(p.dtype))
    model = model.to(device).eval()
    return model, cfg
