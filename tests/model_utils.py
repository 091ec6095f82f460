"""Small models and helpers shared by the model tests."""

from __future__ import annotations

import torch

from tape_train.model import ModelConfig, TransformerLM

SMALL = dict(vocab_size=97, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=96,
             tape_position_size=8, max_seq_len=64)


def small_config(pe: str = "tape", **overrides) -> ModelConfig:
    return ModelConfig(**{**SMALL, "pe": pe, "attn_backend": "eager", **overrides})


def small_model(pe: str = "tape", seed: int = 0, live_tape: bool = True, dtype=torch.float64,
                **overrides) -> TransformerLM:
    """A small model; with ``live_tape`` TAPE's zero-init W_up/W_pa get random values so that
    every positional path is active (properties must hold for any weights)."""
    torch.manual_seed(seed)
    model = TransformerLM(small_config(pe, **overrides))
    if live_tape:  # no-op for encodings without a state update
        randomise_tape(model, seed)
    return model.to(dtype).eval()


def randomise_tape(model: TransformerLM, seed: int = 0, std: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in model.layers:
            pu = layer.pos_update
            if pu is None:  # TAPE's last block carries no state
                continue
            for p in (pu.w_pa, pu.w_up, pu.w_dn):
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def tokens(batch: int = 2, length: int = 24, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
