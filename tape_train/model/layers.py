"""Llama building blocks: RMSNorm and the SwiGLU MLP.

Both keep for the backward only what it cannot cheaply recompute (activation memory is what
bounds the micro-batch on a GPU):

* ``RMSNorm`` saves its input x and the (…, 1) fp32 reciprocal RMS, not the fp32 copy of x
  and the normalised x that autograd would keep for the ops of the formula (3× x's bytes in
  bf16; 1× here).
* ``SwiGLU`` saves the gate and up projections, not silu(gate) as well (recomputed in the
  backward: one elementwise op on the gate).

The forward values are bit-identical to the plain formulas; SwiGLU's gradients too (the same
ops in the same order); RMSNorm's gradients are computed in fp32 (autograd rounds the
gradient through w to x's dtype first), checked against autograd in fp64 in
``tests/test_model_layers.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 statistics for 16-bit and fp32 inputs; fp64 stays fp64 (the reference)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _RMSNormFunction(torch.autograd.Function):
    """y = w ⊙ (x · r).to(x.dtype) with r = rsqrt(mean(x²) + eps) in fp32 (as Llama).

    x (…, C), w (C,). Saves x, w and r (…, 1).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(_stat_dtype(x))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        acc = _stat_dtype(x)
        x_hat = x.to(acc) * rstd
        dx = dw = None
        if ctx.needs_input_grad[1]:
            # Like autograd, w's gradient sees the normalised x as rounded to x's dtype.
            dw = (grad.to(acc) * x_hat.to(x.dtype).to(acc)).reshape(-1, x.shape[-1]).sum(0)
            dw = dw.to(weight.dtype)
        if ctx.needs_input_grad[0]:
            # d/dx of x·r: r·(g − x̂·mean(g ⊙ x̂)), g = grad ⊙ w.
            g = grad.to(acc) * weight.to(acc)
            dx = (rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None


class RMSNorm(nn.Module):
    """x / rms(x) · w, the statistics in fp32 (as Llama does). x (…, C) → (…, C)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)  # no grad: nothing is kept


class _SiluMulFunction(torch.autograd.Function):
    """silu(gate) ⊙ up, both (…, F); saves gate and up, recomputes silu(gate)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate = d_up = None
        if ctx.needs_input_grad[1]:
            d_up = grad * F.silu(gate)
        if ctx.needs_input_grad[0]:
            d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return d_gate, d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) ⊙ up, saving only gate and up for the backward."""
    return _SiluMulFunction.apply(gate, up)


class SwiGLU(nn.Module):
    """y = W_down(silu(x·W_gate) ⊙ x·W_up). x (…, C) → (…, C)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
