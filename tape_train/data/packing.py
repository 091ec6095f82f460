"""Packing by concatenation: documents (already wrapped in BOS/EOS) → blocks of fixed length.

Documents are concatenated into one token stream cut every ``block_len`` tokens (a document
may span blocks; nothing is padded, dropped or duplicated except the unfinished tail when the
input ends). Every block carries the position where it starts — the stream position *before*
the document holding its first token, and the offset of that token in the document — which is
all a resume needs: re-open the stream there, re-tokenise that document, drop ``offset``
tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def wrap_document(tokens: list[int], bos_id: int | None, eos_id: int | None) -> list[int]:
    """``[BOS] + tokens + [EOS]`` (each only if its id is given)."""
    if bos_id is not None:
        tokens = [bos_id] + tokens
    if eos_id is not None:
        tokens.append(eos_id)
    return tokens


def pack_documents(documents: Iterable[tuple[Any, list[int]]], block_len: int,
                   first_offset: int = 0) -> Iterator[tuple[list[int], tuple[Any, int]]]:
    """Pack ``(position, tokens)`` documents into blocks of exactly ``block_len`` tokens.

    Args:
        documents: ``position`` is opaque (the stream state before that document).
        block_len: tokens per block (``seq_len + 1`` for next-token training).
        first_offset: tokens of the first document already consumed (resume).

    Yields:
        ``(block, (position, offset))``: ``block`` is a list of ``block_len`` ids; its first
        token is token ``offset`` of the document that started at ``position``.
    """
    if block_len <= 0:
        raise ValueError(f"block_len must be positive, got {block_len}")
    pending: list[int] = []
    start: tuple[Any, int] | None = None
    skip = first_offset
    for position, tokens in documents:
        i = min(skip, len(tokens))
        skip = 0
        if not pending:
            start = (position, i)
        need = block_len - len(pending)
        n = len(tokens)
        while n - i >= need:
            if pending:
                pending.extend(tokens[i:i + need])
                block = pending
            else:
                block = tokens[i:i + need]
            i += need
            yield block, start
            pending = []
            need = block_len
            start = (position, i)
        if i < n:
            pending.extend(tokens[i:])
