"""Packing by concatenation: documents (already wrapped in BOS/EOS) → blocks of fixed length.

Documents are concatenated into one token stream cut every ``block_len`` tokens (a document
may span blocks; nothing is padded, dropped or duplicated except the unfinished tail when the
input ends). Every block carries the position where it starts — the stream position *before*
the document holding its first token, and the offset of that token in the document — which is
all a resume needs: re-open the stream there, re-tokenise that document, drop ``offset``
tokens.

``shuffle_windows`` then emits the packed blocks in seeded windows: block ``k`` of the packed
stream lies in the window of blocks ``[s, s + W)``; each window is emitted in a permutation
seeded by its first block index ``s``, so that the rows of a batch are not consecutive
windows of one long document. A window carries the start of its first block: a resume
re-packs from there and skips the blocks already emitted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

# Mixed into the permutation seed of a block window (sources.py has the document-level tags).
_BLOCK_WINDOW_TAG = 0x424C


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


def shuffle_windows(blocks: Iterable[tuple[list[int], Any]], window: int, first_index: int,
                    seed: int, stream_id: list[int], dtype: np.dtype
                    ) -> Iterator[tuple[int, np.ndarray, tuple[int, Any]]]:
    """Emit packed ``blocks`` (``pack_documents``'s output) in seeded windows of ``window``.

    The first window is packed whole before its first block is emitted; each next one is
    packed one block per block emitted of the current one, so that the tokenising work stays
    spread evenly over the batches (at most two windows are held).

    Args:
        blocks: ``(block, start)`` pairs; the first is block ``first_index`` of the stream,
            and a window begins there (windows are ``[first_index + m·window, ...)``).
        window: blocks per window; 1 emits them in packing order.
        seed, stream_id: window ``s`` (its first block index) is permuted by
            ``np.random.default_rng([seed, tag, s, *stream_id])`` (``stream_id``: ``[rank,
            world]`` of a per-rank stream, else empty).
        dtype: the integer dtype a window is held in (``window × block_len`` of it).

    Yields:
        ``(j, block, (s, start))``: the ``j``-th block emitted (counted from ``first_index``),
        a ``(block_len,)`` array, and its window's first block index and ``start``.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    blocks = iter(blocks)
    upcoming = _Window(window, dtype)
    upcoming.pull(blocks, window)
    first = first_index
    while upcoming.size:
        current, upcoming = upcoming, _Window(window, dtype)
        # (size < window only where a finite input ends: its last window is permuted as it is)
        order = (np.random.default_rng([seed, _BLOCK_WINDOW_TAG, first, *stream_id])
                 .permutation(current.size) if window > 1 else range(current.size))
        for i, row in enumerate(order):
            upcoming.pull(blocks, 1)
            yield first + i, current.rows[row], (first, current.start)
        upcoming.pull(blocks, window)  # (only after a short window: the input has ended)
        first += current.size


class _Window:
    """Up to ``capacity`` packed blocks as the rows of one array, and the start of the first."""

    def __init__(self, capacity: int, dtype: np.dtype):
        self.capacity, self.dtype = capacity, dtype
        self.rows: np.ndarray | None = None
        self.size = 0
        self.start: Any = None

    def pull(self, blocks: Iterator[tuple[list[int], Any]], n: int) -> None:
        """Append up to ``n`` more blocks from ``blocks`` (fewer where it or the window ends)."""
        for block, start in itertools.islice(blocks, min(n, self.capacity - self.size)):
            if self.rows is None:
                self.rows = np.empty((self.capacity, len(block)), dtype=self.dtype)
                self.start = start
            self.rows[self.size] = block
            self.size += 1
