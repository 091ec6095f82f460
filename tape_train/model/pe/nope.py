"""NoPE: no positional signal; the causal mask alone orders tokens."""

from tape_train.model.pe.base import PositionalEncoding


class NoPE(PositionalEncoding):
    pass
