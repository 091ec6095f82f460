"""The KV cache of incremental decoding (shared by the decoder and ``generate``)."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer cached keys/values (k̃, v; a state-carrying encoding adds E⁰, E¹) and the
    positions seen so far."""

    def __init__(self, num_layers: int) -> None:
        self.layers: list[dict] = [{} for _ in range(num_layers)]
        self.positions: torch.Tensor | None = None  # (b|1, Nk)

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]
