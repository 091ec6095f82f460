"""T5 relative bias (Raffel et al.): logits += b_h(bucket(i − j)), causal buckets.

Half the buckets are exact distances, the rest log-spaced up to ``t5_max_distance``; one bias
table shared by all layers (as in T5).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tape_train.model.pe.base import PositionalEncoding, PositionContext, relative_distance


def causal_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket of i − j (negative distances, i.e. future keys, go to bucket 0; they are masked)."""
    n = distance.clamp(min=0).long()
    exact = num_buckets // 2
    is_small = n < exact
    log_ratio = torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (num_buckets - exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return torch.where(is_small, n, large)


class T5Bias(PositionalEncoding):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.rel_bias = nn.Embedding(cfg.t5_num_buckets, cfg.num_heads)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.rel_bias.weight, std=self.cfg.init_std)

    def context(self, q_pos, k_pos, dtype) -> PositionContext:
        buckets = causal_bucket(relative_distance(q_pos, k_pos), self.cfg.t5_num_buckets,
                                self.cfg.t5_max_distance)
        bias = self.rel_bias(buckets).permute(0, 3, 1, 2)  # (b|1, H, Nq, Nk)
        return PositionContext(q_pos=q_pos, k_pos=k_pos, bias=bias.to(dtype))
