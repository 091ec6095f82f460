"""Data subsystem: sources → tokenise → pack → shard over data-parallel ranks → resumable loader.

Public API (the contract in docs/ARCHITECTURE.md)::

    from tape_train.data import DataConfig, load_tokenizer, build_train_loader, iter_eval_documents
"""

from tape_train.data.config import DataConfig, DataError, SourceConfig, load_data_config
from tape_train.data.loader import TrainLoader, build_train_loader, iter_eval_documents
from tape_train.data.tokenizer import SPECIAL_IDS, Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "DataConfig", "DataError", "SourceConfig", "SPECIAL_IDS", "Tokenizer", "TokenizerError",
    "TrainLoader", "build_train_loader", "iter_eval_documents", "load_data_config", "load_tokenizer",
]
