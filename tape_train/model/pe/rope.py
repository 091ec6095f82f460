"""RoPE (Su et al.): rotate q and k by angle ω·n, rotate-half layout, θ = 10000."""

from __future__ import annotations

import torch

from tape_train.model.pe.base import PositionalEncoding, PositionContext, rotary_tables


class RoPE(PositionalEncoding):
    def context(self, q_pos, k_pos, dtype) -> PositionContext:
        d, theta = self.cfg.head_dim, self.cfg.rope_theta
        q_tables = rotary_tables(q_pos, d, theta, dtype)
        return PositionContext(q_pos=q_pos, k_pos=k_pos, q_tables=q_tables, k_tables=q_tables)


class RandPE(RoPE):
    """Randomised positions (Ruoss et al.): in training, each row's positions are a sorted
    random subset of [0, L_max); at evaluation and decoding the plain 0..N−1 (spec §5)."""

    def layer0_positions(self, batch, length, offset, device) -> torch.Tensor:
        if not self.training:
            return super().layer0_positions(batch, length, offset, device)
        l_max = max(self.cfg.randpe_max_len, offset + length)
        # torch's global RNG: seeded and checkpointed by the trainer, so runs are reproducible.
        scores = torch.rand(batch, l_max, device=device)
        picked = scores.topk(offset + length, dim=-1).indices.sort(dim=-1).values
        return picked[:, offset:]
