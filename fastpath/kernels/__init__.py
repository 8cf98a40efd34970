"""Triton kernels of the fast path, one op per module (docs/kernels.md): ssd (+ ssd_* stages), ssm_step,
conv1d, gated_norm, rope, attention, sampling. Import the module you need; importing this package imports
no Triton code (set TRITON_INTERPRET=1 before the first kernel import to run them on CPU)."""
