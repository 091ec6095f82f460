"""Data subsystem: sources → tokenise → pack → shard over data-parallel ranks → resumable loader.

Public API (the contract in docs/ARCHITECTURE.md)::

    from tape_train.data import DataConfig, load_tokenizer, build_train_loader, iter_eval_documents

The exports are resolved lazily (PEP 562), so the config and the command-line tools' ``--help``
do not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DataConfig": "tape_train.data.config",
    "DataError": "tape_train.data.config",
    "SourceConfig": "tape_train.data.config",
    "load_data_config": "tape_train.data.config",
    "TrainLoader": "tape_train.data.loader",
    "build_train_loader": "tape_train.data.loader",
    "iter_eval_documents": "tape_train.data.loader",
    "SPECIAL_IDS": "tape_train.data.tokenizer",
    "Tokenizer": "tape_train.data.tokenizer",
    "TokenizerError": "tape_train.data.tokenizer",
    "load_tokenizer": "tape_train.data.tokenizer",
    "load_model_tokenizer": "tape_train.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
