"""Helpers shared by the pre-tokenised loader tests."""

from __future__ import annotations

import torch


def rows(loader, n_batches: int) -> list[torch.Tensor]:
    """The next ``n_batches`` batches of ``loader`` as their ``seq_len + 1``-token blocks, one
    row per sample (``input_ids`` plus the last label)."""
    out = []
    for _ in range(n_batches):
        b = next(loader)
        out.extend(torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1))
    return out
