"""Pure-PyTorch model code: decoder, positional encodings, attention dispatch, generation.

The config and the encoding registry import without torch (``tape_train.model.config``,
``tape_train.model.pe``); the torch-backed names below load on first use.
"""

from tape_train.model.config import POSITIONAL_ENCODINGS, ModelConfig, load_model_config

_LAZY = {"from_pretrained": "pretrained", "save_pretrained": "pretrained",
         "IGNORE_INDEX": "lm_head", "KVCache": "transformer", "ModelOutput": "transformer",
         "TransformerLM": "transformer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["IGNORE_INDEX", "POSITIONAL_ENCODINGS", "KVCache", "ModelConfig", "ModelOutput",
           "TransformerLM", "from_pretrained", "load_model_config",
           "save_pretrained"]
