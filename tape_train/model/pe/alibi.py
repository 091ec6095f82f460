"""ALiBi (Press et al.): logits += −m_h·(i − j), geometric slopes per head."""

from __future__ import annotations

import math

import torch

from tape_train.model.pe.base import PositionalEncoding, PositionContext, relative_distance


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """m_h = 2^(−8h/M) for M a power of two; otherwise the standard interleave: the slopes of
    the nearest lower power of two p, then every other slope of 2p. Shape (M,), fp32."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(p)
    if p < num_heads:
        slopes += power_of_two(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(PositionalEncoding):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.register_buffer("slopes", alibi_slopes(cfg.num_heads), persistent=False)

    def context(self, q_pos, k_pos, dtype) -> PositionContext:
        dist = relative_distance(q_pos, k_pos)  # (b|1, Nq, Nk)
        bias = -self.slopes[:, None, None] * dist[:, None]
        return PositionContext(q_pos=q_pos, k_pos=k_pos, bias=bias.to(dtype),
                               alibi_slopes=self.slopes)
