"""Causal depthwise 1-D convolution with a rolling window (the Mamba2 short conv), literal form.

Shapes (one sequence): x [L, D], weight [D, K], bias [D] or None, window [D, K-1] = the last K-1 inputs
of each channel, oldest first (None = zeros: the sequence starts here). Pure convolution, no activation:

    y_t[d] = bias[d] + sum_{k=0}^{K-1} weight[d, k] * u[t + k][d],     u = concat(window, x) along time

so weight[:, K-1] multiplies the current input and weight[:, 0] the oldest one.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, window: Tensor | None) -> None:
    D, K = weight.shape
    if x.shape[-1] != D:
        raise ValueError(f"conv1d: x has {x.shape[-1]} channels, weight has {D}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"conv1d: bias shape {tuple(bias.shape)} != ({D},)")
    if window is not None and window.shape != (D, K - 1):
        raise ValueError(f"conv1d: window shape {tuple(window.shape)} != ({D}, {K - 1})")


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                  window: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [L, D] -> (y [L, D], new_window [D, K-1]): the causal conv continued from `window`."""
    _check(x, weight, bias, window)
    L, D = x.shape
    K = weight.shape[1]
    if window is None:
        window = x.new_zeros(D, K - 1)
    u = torch.cat([window.to(x.dtype).T, x], dim=0)                  # [K-1+L, D]
    y = x.new_zeros(L, D) if bias is None else bias.to(x.dtype).expand(L, D).clone()
    for k in range(K):
        y = y + weight[:, k].to(x.dtype) * u[k:k + L]
    new_window = u[L:].T.contiguous()                                  # last K-1 inputs, oldest first
    return y, new_window


def conv1d_step(x_t: Tensor, weight: Tensor, bias: Tensor | None = None,
                window: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One token x_t [D] -> (y_t [D], new_window [D, K-1])."""
    y, new_window = causal_conv1d(x_t[None, :], weight, bias, window)
    return y[0], new_window
