"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest

from tape_train.data.testing import train_small_tokenizer


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A small sentencepiece tokenizer trained on real text (deterministic; read-only)."""
    return train_small_tokenizer(tmp_path_factory.mktemp("tok"))
