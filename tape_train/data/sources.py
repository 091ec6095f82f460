"""Deterministic, resumable document streams: one cursor per source, a seeded mixture on top.

Order of one source in epoch ``e``: its shards in a seeded permutation (per epoch), read
sequentially; consecutive runs of ``shuffle_buffer`` documents ("windows") are each emitted in
a seeded permutation. A cursor's whole state is five integers
``[epoch, window_index, window_start_shard, window_start_record, position_in_window]``:
resuming re-reads one window from its recorded start (from the nearest indexed zstd frame
of a prepared shard, else counting the lines before it without parsing them) and is exact — unlike ``datasets``' shuffle buffer, whose content
is not part of its state (see docs/data.md).

Sources loop forever (epoch counter in the state), so no data-parallel rank ever runs dry.

Reading share (``rank``/``world`` of a cursor; ``documents`` sharding): with ``S`` shards and
``n`` ranks, rank ``r`` reads only shards ``r, r + n, ...`` when ``S >= n`` (uneven when ``n``
does not divide ``S``), otherwise only shard ``r mod S``, keeping raw records
``i ≡ r // S (mod k)`` where ``k`` ranks share that shard (lines of other ranks are counted,
not parsed). Every record belongs to exactly one rank, and a rank reads at most
``ceil(S / n)`` shards, or one shard, per epoch of its share. An epoch is per rank: rank ``r``
starts its epoch ``e + 1`` when its own share is exhausted.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tape_train.data.config import DataError, SourceConfig
from tape_train.data.formats import (Shard, SkipLog, classify, hub_shards, is_prepared_dir,
                                     manifest_shard_paths, read_documents, resolve_local_shards)

log = logging.getLogger("tape_train.data")

# Tags mixed into seeds so the independent random streams never coincide.
_SHARD_ORDER_TAG, _WINDOW_TAG, _MIXTURE_TAG = 0x5348, 0x5749, 0x4D49
_MIXTURE_BLOCK = 4096


def is_held_out(text: str, fraction: float) -> bool:
    """Deterministic held-out membership by a hash of the text (duplicates agree)."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


class SourceCursor:
    """An endless, seeded, resumable stream of one source's training documents."""

    def __init__(self, source: SourceConfig, index: int, seed: int, shuffle: bool,
                 window_size: int, eval_fraction: float, skip_bad: bool, skips: SkipLog,
                 rank: int = 0, world: int = 1, hub_row_groups: bool = True):
        self.source = source
        self.index = index
        self.seed = seed
        self.shuffle = shuffle
        self.window_size = window_size
        self.eval_fraction = eval_fraction
        self.skip_bad = skip_bad
        self.skips = skips
        self.hub_dataset = None
        if source.hub is not None:
            self.hub_dataset, self.all_shards = hub_shards(source, min_shards=world,
                                                           row_groups=hub_row_groups)
        else:
            self.all_shards = resolve_local_shards(source, split="train")
        self.rank, self.world = rank, world
        self.shards, self.stride, self.phase = rank_share(len(self.all_shards), rank, world)
        self.shards = [self.all_shards[i] for i in self.shards]
        # Seeds of rank-specific orders carry (rank, world); a single rank keeps the old seeds.
        self._rank_seed = [rank, world] if world > 1 else []
        self.epoch = self.window_index = self.window_shard = self.window_record = 0
        self.position = 0
        self._window: list[str] | None = None
        self._order: np.ndarray | None = None
        self._docs: Iterator | None = None
        self._next_window_start = (0, 0)

    # -- state ------------------------------------------------------------------------------
    def state(self) -> tuple[int, int, int, int, int]:
        return (self.epoch, self.window_index, self.window_shard, self.window_record,
                self.position)

    def load_state(self, state) -> None:
        values = [int(v) for v in state]
        if len(values) != 5 or min(values) < 0:
            raise DataError(f"loader state: bad cursor {state!r} for source {self.source.name!r}")
        (self.epoch, self.window_index, self.window_shard, self.window_record,
         self.position) = values
        self._window = self._docs = None

    # -- reading ----------------------------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.shards)))
        rng = np.random.default_rng([self.seed, _SHARD_ORDER_TAG, self.index, epoch,
                                     *self._rank_seed])
        return rng.permutation(len(self.shards)).tolist()

    def _epoch_documents(self, shard_pos: int, record: int) -> Iterator[tuple[int, int, str]]:
        order = self.shard_order(self.epoch)
        for pos in range(shard_pos, len(order)):
            shard = self.shards[order[pos]]
            start = record if pos == shard_pos else 0
            for rec, text in read_documents(shard, start, self.source.text_field, self.skip_bad,
                                            self.skips, self.hub_dataset, self.stride,
                                            self.phase):
                if self.eval_fraction and is_held_out(text, self.eval_fraction):
                    continue
                yield pos, rec, text

    def _load_window(self) -> None:
        for attempt in range(2):
            if self._docs is None:
                self._docs = self._epoch_documents(self.window_shard, self.window_record)
            items = list(itertools.islice(self._docs, self.window_size))
            if items:
                break
            if self.window_index == 0 or attempt == 1:
                share = "" if self.world == 1 else (
                    f" for data-parallel rank {self.rank} of {self.world} (its share: "
                    f"{len(self.shards)} of {len(self.all_shards)} shard(s), one record in "
                    f"{self.stride}; give the source more shards/records than ranks)")
                raise DataError(
                    f"{self.source.key}: source {self.source.name!r} has no usable documents"
                    f"{share} ({len(self.shards)} shard(s); skipped so far: "
                    f"{dict(self.skips.counts)})")
            self.epoch += 1  # end of epoch: the next window opens the next epoch
            log.info("data: source %r starts epoch %d", self.source.name, self.epoch)
            self.window_index = self.window_shard = self.window_record = self.position = 0
            self._docs = None
        self._window = [text for _, _, text in items]
        last_shard, last_record, _ = items[-1]
        self._next_window_start = (last_shard, last_record + 1)
        if self.shuffle and len(items) > 1:
            rng = np.random.default_rng([self.seed, _WINDOW_TAG, self.index, self.epoch,
                                         self.window_index, *self._rank_seed])
            self._order = rng.permutation(len(items))
        else:
            self._order = np.arange(len(items))

    def next_document(self) -> str:
        if self._window is None:
            self._load_window()
        if self.position >= len(self._window):
            self.window_index += 1
            self.window_shard, self.window_record = self._next_window_start
            self.position = 0
            self._load_window()
        text = self._window[self._order[self.position]]
        self.position += 1
        return text


def rank_share(num_shards: int, rank: int, world: int) -> tuple[list[int], int, int]:
    """Rank ``rank`` of ``world``'s reading share of ``num_shards`` shards:
    ``(shard indices, record stride, record phase)`` (see the module docstring)."""
    if world <= 1:
        return list(range(num_shards)), 1, 0
    if num_shards >= world:
        return list(range(rank, num_shards, world)), 1, 0
    shard = rank % num_shards
    return [shard], len(range(shard, world, num_shards)), rank // num_shards


def shared_shard_warning(source: SourceConfig, num_shards: int, world: int) -> str | None:
    """What it costs when ``documents`` sharding gives ranks a shared shard (fewer shards than
    ranks), and the fix; None when every rank reads whole shards of its own."""
    if world <= 1 or num_shards >= world:
        return None
    k = -(-world // num_shards)  # ranks on the most shared shard (rank 0's)
    prepared = [p for p in source.paths if is_prepared_dir(Path(p))]
    if prepared:  # re-preparing from its shards would lose its eval split: from the inputs
        fix = (f"re-run the `tape-data prepare` that wrote {', '.join(prepared)} with "
               f"--num-shards {world}")
    elif source.hub is not None:
        config = f" --hub-config {source.config}" if source.config else ""
        fix = f"`tape-data prepare --hub {source.hub}{config} --out DIR --num-shards {world}`"
    else:
        fix = (f"`tape-data prepare --input {' '.join(source.paths)} --out DIR --num-shards "
               f"{world}`")
    return (f"{source.key} ({source.name}): {num_shards} shard(s) for {world} data-parallel "
            f"ranks: up to {k} ranks share one shard, and each reads all of it every epoch to "
            f"keep 1/{k} of its records ({k}x the bytes read per document; tokens/s per rank "
            f"falls as k grows). Fix: {fix} (or more shards), or pre-tokenise it "
            f"(`--tokenize`, data.format: tokens)")


class DocumentStream:
    """The training document stream: a seeded weighted mixture over source cursors.

    Document ``g`` comes from source ``choice(g)``, drawn from a random stream seeded by
    ``(seed, g // 4096)`` so it is computable without replaying earlier documents.
    State: ``{"g": next document index, "sources": [cursor state, ...]}``.
    """

    def __init__(self, cursors: list[SourceCursor], seed: int, stream_id: list[int] | None = None):
        self.cursors = cursors
        self.seed = seed
        self._stream_id = list(stream_id or [])  # (rank, world) of a per-rank stream
        weights = np.array([c.source.weight for c in cursors], dtype=np.float64)
        with np.errstate(over="ignore"):
            overflows = not np.isfinite(weights.sum())
        if overflows:  # finite weights whose sum does not fit a float (1e308 each)
            weights = weights / weights.max()
        self._cdf = np.cumsum(weights / weights.sum())
        self._cdf[-1] = 1.0
        self.g = 0
        self._block = -1
        self._choices: np.ndarray | None = None

    def state(self) -> dict:
        return {"g": self.g, "sources": [list(c.state()) for c in self.cursors]}

    def load_state(self, state: dict) -> None:
        if len(state["sources"]) != len(self.cursors):
            raise DataError(f"loader state has {len(state['sources'])} source cursor(s), "
                            f"the config has {len(self.cursors)} source(s)")
        self.g = int(state["g"])
        for cursor, cursor_state in zip(self.cursors, state["sources"]):
            cursor.load_state(cursor_state)

    def choice(self, g: int) -> int:
        if len(self.cursors) == 1:
            return 0
        block = g // _MIXTURE_BLOCK
        if block != self._block:
            rng = np.random.default_rng([self.seed, _MIXTURE_TAG, block, *self._stream_id])
            u = rng.random(_MIXTURE_BLOCK)
            self._choices = np.searchsorted(self._cdf, u, side="right").clip(
                0, len(self.cursors) - 1)
            self._block = block
        return int(self._choices[g % _MIXTURE_BLOCK])

    def next_document(self) -> str:
        text = self.cursors[self.choice(self.g)].next_document()
        self.g += 1
        return text



def iter_held_out_texts(sources: list[SourceConfig], eval_sources: list[SourceConfig],
                        eval_fraction: float, skip_bad: bool,
                        skips: SkipLog) -> Iterator[str]:
    """Held-out documents, in a fixed order: explicit ``eval_sources``, then each prepared
    directory's eval split, then the hash-held-out fraction of every training source."""
    found_any = False
    for source in eval_sources:
        found_any = True
        if source.hub is not None:
            ds, shards = hub_shards(source)
        else:
            ds, shards = None, resolve_local_shards(source, split="eval")
        for shard in shards:
            for _, text in read_documents(shard, 0, source.text_field, skip_bad, skips, ds):
                yield text
    for source in sources:
        for pattern in source.paths:
            directory = Path(pattern)
            if directory.is_dir() and is_prepared_dir(directory):
                for path in manifest_shard_paths(directory, "eval"):
                    found_any = True
                    kind, compression = classify(path)
                    shard = Shard(kind, str(path), compression, path.stat().st_size)
                    for _, text in read_documents(shard, 0, source.text_field, skip_bad, skips):
                        yield text
    if eval_fraction > 0:
        found_any = True
        for source in sources:
            if source.hub is not None:
                ds, shards = hub_shards(source)
            else:
                ds, shards = None, resolve_local_shards(source, split="train")
            for shard in shards:
                for _, text in read_documents(shard, 0, source.text_field, skip_bad, skips, ds):
                    if is_held_out(text, eval_fraction):
                        yield text
    if not found_any:
        raise DataError("no held-out data: set data.eval_fraction > 0, list data.eval_sources, "
                        "or train on a directory prepared by `tape-data prepare` (it has an "
                        "eval split)")
