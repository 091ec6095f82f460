"""FIRE (Li et al.): logits += f_θ(ψ(i − j) / ψ(max(i, L))), ψ(x) = log(c·x + 1).

f is an MLP 1 → ``fire_hidden`` → M (one output per head); c and the threshold L are learned.
One FIRE module is shared by all layers. c and L enter through |·| so they stay valid.
"""

from __future__ import annotations

import torch
from torch import nn

from tape_train.model.pe.base import PositionalEncoding, PositionContext, relative_distance


class FIRE(PositionalEncoding):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.mlp = nn.Sequential(nn.Linear(1, cfg.fire_hidden), nn.ReLU(),
                                 nn.Linear(cfg.fire_hidden, cfg.num_heads))
        # Shape (1,), not 0-d: DeepSpeed's parameter broadcast views every parameter as bytes,
        # which a 0-d bf16 tensor cannot do.
        self.c = nn.Parameter(torch.full((1,), float(cfg.fire_init_c)))
        self.threshold = nn.Parameter(torch.full((1,), float(cfg.fire_init_L)))

    def reset_parameters(self) -> None:
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(layer.weight, std=self.cfg.init_std)
            nn.init.zeros_(layer.bias)
        with torch.no_grad():
            self.c.fill_(self.cfg.fire_init_c)
            self.threshold.fill_(self.cfg.fire_init_L)

    def psi(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.c.abs() * x + 1.0)

    def context(self, q_pos, k_pos, dtype) -> PositionContext:
        dist = relative_distance(q_pos, k_pos).clamp(min=0)          # (b|1, Nq, Nk)
        denom = self.psi(torch.maximum(q_pos.float(), self.threshold.abs()))[..., None]
        ratio = (self.psi(dist) / denom).to(self.mlp[0].weight.dtype)
        bias = self.mlp(ratio[..., None]).permute(0, 3, 1, 2)         # (b|1, H, Nq, Nk)
        return PositionContext(q_pos=q_pos, k_pos=k_pos, bias=bias.to(dtype))
