"""xPos (Sun et al.): RoPE with a per-dimension exponential scale.

q̃_n = ρ(ω·n)(q ⊙ ζ^{n/s}),  k̃_m = ρ(ω·m)(k ⊙ ζ^{−m/s}),  ζ_β = (β/(D/2) + γ)/(1 + γ),
γ = 0.4, s = ``xpos_scale_base``; so the logit decays like ζ^{(n−m)/s} with distance.
The scale is folded into the rotary tables (cos·ζ^{±n/s}, sin·ζ^{±n/s}).
"""

from __future__ import annotations

import torch

from tape_train.model.pe.base import PositionalEncoding, PositionContext, rotary_tables

GAMMA = 0.4


def xpos_zeta(head_dim: int, device=None) -> torch.Tensor:
    """ζ per channel in rotate-half layout: (D,), fp32, each in (0.29, 1)."""
    half = torch.arange(0, head_dim // 2, device=device, dtype=torch.float32) / (head_dim // 2)
    zeta = (half + GAMMA) / (1.0 + GAMMA)
    return torch.cat((zeta, zeta))


class XPos(PositionalEncoding):
    def _tables(self, pos: torch.Tensor, sign: float, dtype: torch.dtype):
        work = torch.promote_types(torch.float32, dtype)  # fp64 models get fp64 tables
        cos, sin = rotary_tables(pos, self.cfg.head_dim, self.cfg.rope_theta, work)
        zeta = xpos_zeta(self.cfg.head_dim, pos.device).to(work)
        scale = zeta ** (sign * pos.to(work)[:, None, :, None] / self.cfg.xpos_scale_base)
        return (cos * scale).to(dtype), (sin * scale).to(dtype)

    def context(self, q_pos, k_pos, dtype) -> PositionContext:
        return PositionContext(q_pos=q_pos, k_pos=k_pos, q_tables=self._tables(q_pos, 1.0, dtype),
                               k_tables=self._tables(q_pos, -1.0, dtype))
