"""tape-train: distributed pretraining of language models with TAPE positional encoding."""

__version__ = "0.1.0"
