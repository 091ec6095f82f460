"""Pure-PyTorch model code: decoder, positional encodings, attention dispatch, generation.

The exports are resolved lazily (PEP 562): importing ``tape_train.model.config`` (the run
config does, and so does every ``--help``) must not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "POSITIONAL_ENCODINGS": "tape_train.model.config",
    "ModelConfig": "tape_train.model.config",
    "load_model_config": "tape_train.model.config",
    "from_pretrained": "tape_train.model.pretrained",
    "save_pretrained": "tape_train.model.pretrained",
    "IGNORE_INDEX": "tape_train.model.transformer",
    "KVCache": "tape_train.model.transformer",
    "ModelOutput": "tape_train.model.transformer",
    "TransformerLM": "tape_train.model.transformer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
