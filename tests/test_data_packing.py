"""Packing invariants: fixed block length, no token lost or duplicated, exact start positions;
block windows: each window emits its own blocks once, in a seeded order, packed evenly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tape_train.data.packing import pack_documents, shuffle_windows, wrap_document


def random_documents(seed: int, n: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    # Lengths from 1 to well beyond the block length, so documents span several blocks.
    return [[rng.randrange(4, 1000) for _ in range(rng.choice([1, 2, 5, 17, 64, 300]))]
            for _ in range(n)]


def check_packing(docs: list[list[int]], packed, block_len: int) -> None:
    """Raise AssertionError unless ``packed`` is a valid packing of ``docs``."""
    stream = [t for d in docs for t in d]
    flat = [t for block, _ in packed for t in block]
    assert all(len(block) == block_len for block, _ in packed), "block length"
    assert flat == stream[:len(flat)], "tokens lost, duplicated or reordered"
    assert len(stream) - len(flat) < block_len, "a full block was not emitted"
    for block, (position, offset) in packed:  # each block's recorded start is exact
        assert docs[position][offset:offset + 1] == block[:1]


@pytest.mark.parametrize("block_len", [1, 7, 64, 129])
@pytest.mark.parametrize("seed", [0, 1])
def test_packing_invariants(seed, block_len):
    docs = random_documents(seed)
    packed = list(pack_documents(enumerate(docs), block_len))
    check_packing(docs, packed, block_len)


def test_packing_checker_catches_a_broken_packer():
    """Negative controls: the checker rejects a dropped token and a duplicated token."""
    docs = random_documents(3, 50)
    packed = list(pack_documents(enumerate(docs), 33))
    dropped = [(b[:5] + b[6:] + [0], s) if i == 4 else (b, s) for i, (b, s) in enumerate(packed)]
    duplicated = [(b[:1] + b[:-1], s) if i == 2 else (b, s) for i, (b, s) in enumerate(packed)]
    for broken in (dropped, duplicated, packed[:-1] + [(packed[-1][0][:-1], packed[-1][1])]):
        with pytest.raises(AssertionError):
            check_packing(docs, broken, 33)


def test_resume_from_any_block_start_reproduces_the_rest():
    docs = random_documents(5, 80)
    block_len = 50
    packed = list(pack_documents(enumerate(docs), block_len))
    for k in (0, 1, 7, len(packed) // 2, len(packed) - 1):
        position, offset = packed[k][1]
        rest = list(pack_documents(((i, docs[i]) for i in range(position, len(docs))),
                                   block_len, first_offset=offset))
        assert [b for b, _ in rest] == [b for b, _ in packed[k:]]


def test_wrap_document():
    assert wrap_document([5, 6], 2, 3) == [2, 5, 6, 3]
    assert wrap_document([5, 6], None, 3) == [5, 6, 3]
    assert wrap_document([], 2, None) == [2]


def test_block_windows_permute_each_window_and_pack_evenly():
    """Each window of 8 emits exactly its own blocks (a finite input's last, short window
    too), seeded by its first block index and the stream id; window 1 is packing order.
    After the first window, at most one block is packed per block emitted (the next window
    is packed while this one is emitted: no burst of tokenising at a window boundary)."""
    blocks = [([k, k + 1000], ("start", k)) for k in range(30, 30 + 37)]
    pulled = []

    def source():
        for block in blocks:
            pulled.append(block)
            yield block

    out, pulls = [], []
    for j, row, (first, start) in shuffle_windows(source(), 8, 30, 5, [], np.uint16):
        out.append((j, row.tolist(), first, start))
        pulls.append(len(pulled))
    assert [j for j, *_ in out] == list(range(30, 67))
    for w in range(5):
        window = out[8 * w:8 * w + 8]
        assert {first for *_, first, _ in window} == {30 + 8 * w}
        assert {start for *_, start in window} == {("start", 30 + 8 * w)}
        assert sorted(row[0] for _, row, *_ in window) == list(range(30 + 8 * w,
                                                                   min(30 + 8 * w + 8, 67)))
    assert [row[0] for _, row, *_ in out[:8]] != list(range(30, 38))
    assert 8 <= pulls[0] <= 9 and all(b - a <= 1 for a, b in zip(pulls, pulls[1:]))
    again = [row.tolist() for _, row, _ in shuffle_windows(iter(blocks), 8, 30, 5, [],
                                                               np.uint16)]
    assert again == [row for _, row, *_ in out]  # seeded
    other_rank = [row.tolist() for _, row, _ in shuffle_windows(iter(blocks), 8, 30, 5,
                                                                    [1, 2], np.uint16)]
    assert other_rank != again
    in_order = [row.tolist() for _, row, _ in shuffle_windows(iter(blocks), 1, 30, 5, [],
                                                                  np.uint16)]
    assert in_order == [block for block, _ in blocks]
