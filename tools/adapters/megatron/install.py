"""Whether the Megatron-Core pieces this adapter needs are importable (the venv of scripts/install-megatron.sh)."""
from __future__ import annotations


def available() -> str | None:
    """None when megatron-core and the Triton mamba_ssm / causal_conv1d pieces import, else the reason why not."""
    import importlib.util
    for mod in ("megatron.core", "mamba_ssm.ops.triton.layernorm_gated", "causal_conv1d.causal_conv1d_varlen",
                "einops"):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not importable (run scripts/install-megatron.sh and use .venv-megatron/bin/python)"
        except ModuleNotFoundError as e:
            return f"{mod} is not importable ({e}; run scripts/install-megatron.sh)"
    return None


def check_install() -> None:
    """Raise with the reason when the Megatron pieces are missing; print what is installed otherwise."""
    why = available()
    if why:
        raise SystemExit(why)
    from importlib.metadata import version
    print("megatron-core", version("megatron-core"), "| mamba-ssm (Triton only)", version("mamba-ssm"),
          "| causal-conv1d (Triton only)", version("causal-conv1d"), "| torch", version("torch"))
