"""The resumable training loader: document stream → tokenise → pack → shard → batches.

Sharding is over data-parallel ranks only (every rank of a tensor/sequence-parallel group
passes the same ``dp_rank`` and so receives the identical batch). Two modes
(``data.sharding``):

* ``documents`` (default): each rank reads, tokenises and packs only its own share of every
  source (whole shards, or every k-th record of one shard when there are fewer shards than
  ranks; ``sources.rank_share``), with its own seeded mixture, shard order and windows. The
  state is per rank; resume with the same dp_size.
* ``global``: every rank tokenises the whole stream into ONE sequence of packed blocks and
  takes blocks ``J0 + r, J0 + r + n, ...``. The state is identical on all ranks and names a
  global block index, so a run can resume on a different number of ranks and continue the
  same global token stream — at n× the tokenisation work per rank.

Packed blocks are emitted in seeded windows of ``data.block_shuffle_window`` blocks
(``packing.shuffle_windows``; in ``global`` sharding over the global block index, so every
rank computes the same permutation).

State (``state_dict()``): the stream position where the window of the next unconsumed block
starts (a few integers per source), the token offset into that document, that window's first
block index, the index of the next block, and the fingerprint; a resume re-packs that one
window and skips the blocks already emitted. A state without the window's start (saved before
block windows) resumes its stream in packing order (window 1) for the rest of the run. With
prefetching on, the state travels with each batch through the queue, so it always describes
what the consumer has *received*.
"""

from __future__ import annotations

import json
import logging
import atexit
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from tape_train.data.config import DataConfig, DataError
from tape_train.data.formats import SkipLog, content_plan
from tape_train.data.packing import pack_documents, shuffle_windows, wrap_document
from tape_train.data.sources import (DocumentStream, SourceCursor, iter_held_out_texts,
                                     shared_shard_warning)
from tape_train.data.state import (STATE_VERSION, packing_options, source_inputs,
                                   state_differences)
from tape_train.data.tokens import token_dtype
from tape_train.data.state import digest as _digest

log = logging.getLogger("tape_train.data")

def _check_loader_arguments(seq_len, micro_batch_size, dp_rank, dp_size) -> None:
    for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size),
                        ("dp_size", dp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise DataError(f"build_train_loader: {name} must be a positive integer, "
                            f"got {value!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise DataError(f"build_train_loader: dp_rank must be in [0, {dp_size}), "
                        f"got {dp_rank!r}")


def text_fingerprint(cfg: DataConfig, shards: list, tokenizer, seq_len: int, seed: int,
                     rank_share: bool, block_window: int | None = None) -> tuple[dict, dict]:
    """``(fingerprint_fields, fingerprint_inputs)`` of a ``data.format: text`` loader whose
    sources have ``shards`` (per source: all ranks' ``Shard`` list, or ``None`` where it is not
    known here — a Hub source offline — which leaves ``fields["sources"]`` ``None``).
    ``rank_share``: ``documents`` sharding over more than one rank. Nothing is read but the
    file names and sizes the shards carry and, for the inputs, a content sample of each local
    file (``Shard.content_sample``: at most 1 MiB of it, less in a source of many files:
    ``formats.content_plan``). ``block_window``: the block shuffle window in effect
    (``cfg.block_window`` unless given; 1 fingerprints as before block windows existed)."""
    per_source = [None if found is None else
                  [source.weight, source.text_field, [s.identity for s in found]]
                  for source, found in zip(cfg.sources, shards)]
    options = packing_options({
        "data.add_bos": cfg.add_bos, "data.add_eos": cfg.add_eos, "data.shuffle": cfg.shuffle,
        "data.shuffle_buffer": cfg.shuffle_buffer, "data.eval_fraction": cfg.eval_fraction,
        "data.sharding": cfg.sharding,
        "data.block_shuffle_window": cfg.block_window if block_window is None else block_window})
    fields = {
        "sources": None if any(p is None for p in per_source) else _digest(per_source),
        "tokenizer": getattr(tokenizer, "sha256", None)
        or _digest([type(tokenizer).__name__, tokenizer.vocab_size]),
        "seq_len": seq_len,
        "seed": int(seed),
        # Per-rank reading shares (documents, n > 1) changed the streams: states saved
        # when every rank dealt from one global stream are flagged as a mismatch.
        "packing": _digest(list(options.values()) + (["rank-share/1"] if rank_share else [])),
    }
    inputs = {
        "sources": [None if p is None else source_inputs(
            source, p[2], "bytes", {"weight": source.weight, "text_field": source.text_field},
            *_content_samples(found))
            for source, p, found in zip(cfg.sources, per_source, shards)],
        "tokenizer": getattr(tokenizer, "path", None),
        "packing": {**options, "documents sharding over dp > 1 ranks":
                    rank_share},
    }
    return fields, inputs


def _content_samples(found: list) -> tuple[list | None, str | None]:
    """``(content sample per file, rule)`` of one source's local files; ``(None, None)`` for a
    Hub source (not sampled)."""
    if any(s.kind == "hub" for s in found):
        return None, None
    per_file, rule = content_plan(len(found))
    return [s.content_sample(per_file) for s in found], rule


def resume_differences(state: dict, cfg: DataConfig, tokenizer, seq_len: int, seed: int,
                       text_shards: list | None = None) -> list[str]:
    """What a loader built now from ``cfg`` would find changed in the saved loader ``state``
    (a checkpoint's, before any loader exists), one ``"<field> (<what changed>)"`` each;
    empty when it fits. Reads a text source's file names, sizes and content samples
    (``text_shards``, per source, where already resolved), a token source's manifests. Hub
    sources are listed only online: not compared. The data-parallel layout is not compared
    (``train.relayout`` rules on it); a text ``documents`` state is fingerprinted on the
    number of ranks it was saved on. Raises ``DataError`` where a source does not resolve."""
    saved_format = "tokens" if state.get("format") == "tokens" else "text"
    if saved_format != cfg.format:
        return [f"data.format (saved {saved_format!r}, now {cfg.format!r})"]
    if cfg.format == "tokens":
        from tape_train.data.token_loader import (open_token_sources, token_fingerprint,
                                                  token_mixture)

        sources = open_token_sources(cfg, tokenizer, seq_len)
        try:
            fields, inputs = token_fingerprint(cfg, sources, tokenizer, seq_len, seed,
                                               token_mixture(cfg, seed))
        finally:
            for source in sources:
                source.close()
        return state_differences(state, fields, inputs)
    from tape_train.data.formats import resolve_local_shards

    if text_shards is None:
        text_shards = [None if s.hub is not None else resolve_local_shards(s, split="train")
                       for s in cfg.sources]
    saved_ranks = state.get("dp_size")
    rank_share = cfg.sharding == "documents" and isinstance(saved_ranks, int) and saved_ranks > 1
    window = 1 if saved_before_block_windows(state) else cfg.block_window
    fields, inputs = text_fingerprint(cfg, text_shards, tokenizer, seq_len, seed, rank_share,
                                      window)
    return state_differences(state, fields, inputs)


def saved_before_block_windows(state: dict) -> bool:
    """Whether a text loader ``state`` was saved before block shuffle windows (its position
    names no window start): it resumes in packing order, as it was saved."""
    position = state.get("position")
    return not (isinstance(position, dict) and "window_start" in position)


class TrainLoader:
    """Endless iterator of ``{"input_ids": (b, L) int64, "labels": (b, L) int64}`` batches.

    ``labels[i, t] == input_ids[i, t + 1]`` within a row's ``L + 1``-token block, i.e. labels
    are already shifted. Build with ``build_train_loader``.
    """

    def __init__(self, cfg: DataConfig, tokenizer, seq_len: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int):
        _check_loader_arguments(seq_len, micro_batch_size, dp_rank, dp_size)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = int(seed)
        self.skips = SkipLog()
        self._packing_order = False  # True: resuming a state saved before block windows
        self._dtype = token_dtype(tokenizer.vocab_size)
        # documents: each rank reads only its own share; global: every rank reads everything.
        self._share = (dp_rank, dp_size) if cfg.sharding == "documents" else (0, 1)
        self._adopt(self._cursors(hub_row_groups=True))
        if self._share[1] > 1 and dp_rank == 0:
            for cursor in self._stream.cursors:
                warning = shared_shard_warning(cursor.source, len(cursor.all_shards), dp_size)
                if warning:
                    log.warning("data: %s", warning)
        self.batches_received = 0
        self.documents_tokenized = 0
        self.wait_seconds = 0.0
        self._batches: Iterator | None = None
        self._prefetcher: _Prefetcher | None = None

    def _cursors(self, hub_row_groups: bool) -> list[SourceCursor]:
        cfg = self.cfg
        return [SourceCursor(src, i, self.seed, cfg.shuffle, cfg.shuffle_buffer,
                             cfg.eval_fraction, cfg.skip_bad_records, self.skips, *self._share,
                             hub_row_groups=hub_row_groups)
                for i, src in enumerate(cfg.sources)]

    def _adopt(self, cursors: list[SourceCursor]) -> None:
        """Read from ``cursors`` from the start: the stream, its fingerprint, the position."""
        share = self._share
        self._stream_id = list(share) if share[1] > 1 else []
        self._stream = DocumentStream(cursors, self.seed, self._stream_id)
        self._initial_stream = self._stream.state()
        self._refingerprint()
        self._position = json.loads(json.dumps(self._initial_position))

    @property
    def block_window(self) -> int:
        """Blocks per shuffle window in effect (1 when resuming a state saved before them)."""
        return 1 if self._packing_order else self.cfg.block_window

    def _refingerprint(self) -> None:
        self.fingerprint_fields, self.fingerprint_inputs = self._fingerprint(self._stream.cursors)
        self.fingerprint = _digest(self.fingerprint_fields)
        self._initial_position = self._position_at(self._initial_stream, 0, 0, 0)

    def _position_at(self, stream: dict, offset: int, blocks: int, window_start: int) -> dict:
        """The state's position: the window of block ``blocks`` starts at block
        ``window_start``, token ``offset`` of the document at ``stream``. In packing order a
        state saved before block windows keeps their format (no ``window_start``)."""
        position = {"stream": stream, "offset": offset, "blocks": blocks}
        if not self._packing_order:
            position["window_start"] = window_start
        return position

    def _fingerprint(self, cursors: list[SourceCursor]) -> tuple[dict, dict]:
        return text_fingerprint(self.cfg, [c.all_shards for c in cursors], self.tokenizer,
                                self.seq_len, self.seed, rank_share=self._share[1] > 1,
                                block_window=self.block_window)

    def _fingerprint_fields(self, cursors: list[SourceCursor]) -> dict:
        return self._fingerprint(cursors)[0]

    def _adopt_file_level_hub_shards(self, state: dict) -> None:
        """A state saved when Parquet Hub streams were read file by file (before row-group
        shards) fingerprints file shards: if its sources are this config's sources read by
        file, read them so again, so that the run continues its own stream (any other
        difference is then reported as usual)."""
        saved = state.get("fingerprint_fields")
        sources = saved.get("sources") if isinstance(saved, dict) else None
        if sources in (None, self.fingerprint_fields["sources"]) or not any(
                c.source.hub is not None for c in self._stream.cursors):
            return
        legacy = self._cursors(hub_row_groups=False)
        if self._fingerprint_fields(legacy)["sources"] != sources:
            return
        log.warning("data: the saved state reads Hub sources file by file (it was saved before "
                    "Parquet streams were sharded by row group); resuming it exactly so, where a "
                    "resume re-streams a file up to its saved record. A new data stream (a run "
                    "without this state) uses row-group shards")
        self._adopt(legacy)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Small JSON-serialisable state of what the consumer has received so far."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "fingerprint_fields": dict(self.fingerprint_fields),
            "sharding": self.cfg.sharding,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "position": json.loads(json.dumps(self._position)),
            "batches_received": self.batches_received,
            "fingerprint_inputs": json.loads(json.dumps(self.fingerprint_inputs)),
        }

    def load_state_dict(self, state: dict, allow_mismatch: bool = False) -> None:
        """Continue exactly where ``state`` was taken.

        A different fingerprint (sources, tokenizer, seq_len, seed, packing options) or, in
        ``documents`` sharding, a different dp_rank/dp_size is an error unless
        ``allow_mismatch=True``, which resumes from the saved position anyway (the stream then
        is *not* the one the original run would have seen). A state saved before Parquet Hub
        streams were sharded by row group resumes exactly on file shards (with a warning).
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"loader state: unsupported or missing version "
                            f"(got {state.get('version') if isinstance(state, dict) else state!r}"
                            f", expected {STATE_VERSION})")
        self._stop()  # the producer thread must not touch the stream while we rewind it
        packing_order = saved_before_block_windows(state)
        if packing_order != self._packing_order:
            self._packing_order = packing_order
            self._refingerprint()
        if packing_order and self.cfg.block_window != 1:
            log.warning("data: the saved loader state predates block shuffle windows: resuming "
                        "its stream exactly, in packing order (as data.block_shuffle_window=1, "
                        "not %d) for the rest of this run; a new run shuffles blocks",
                        self.cfg.block_window)
        if state.get("fingerprint") != self.fingerprint:
            self._adopt_file_level_hub_shards(state)
        problems = []
        differences = state_differences(state, self.fingerprint_fields, self.fingerprint_inputs)
        if differences or state.get("fingerprint") != self.fingerprint:
            # (the same fingerprint differs only in a file edited at the same size)
            problems.append("data fingerprint differs in " + ", ".join(differences))
        if state.get("sharding") != self.cfg.sharding:
            problems.append(f"sharding mode differs (saved {state.get('sharding')!r}, "
                            f"now {self.cfg.sharding!r})")
        elif self.cfg.sharding == "documents" and (state.get("dp_rank"), state.get("dp_size")) \
                != (self.dp_rank, self.dp_size):
            problems.append(f"dp_rank/dp_size differ (saved {state.get('dp_rank')}/"
                            f"{state.get('dp_size')}, now {self.dp_rank}/{self.dp_size}); "
                            f"use data.sharding=global to resume on another number of ranks")
        if problems and not allow_mismatch:
            raise DataError("cannot resume the data loader: " + "; ".join(problems)
                            + ". Pass allow_mismatch=True (tape-train: --allow-config-change) "
                              "to resume from the saved position anyway")
        for problem in problems:
            log.warning("data: resuming despite mismatch (allow_mismatch=True): %s", problem)
        try:
            position = state["position"]
            self._stream.load_state(position["stream"])  # validates the shape
            offset, blocks = int(position["offset"]), int(position["blocks"])
            window_start = int(position.get("window_start", blocks))
            if not 0 <= window_start <= blocks or offset < 0:
                raise ValueError(f"window_start {window_start}, blocks {blocks}, "
                                 f"offset {offset}")
        except (DataError, KeyError, TypeError, ValueError) as exc:
            if not allow_mismatch:
                raise DataError(f"loader state: position does not fit this config: "
                                f"{type(exc).__name__}: {exc}") from None
            log.warning("data: saved position does not fit the new config (%s); starting the "
                        "stream from the beginning", exc)
            position = json.loads(json.dumps(self._initial_position))
            offset = blocks = window_start = 0
        self._position = self._position_at(position["stream"], offset, blocks, window_start)
        self.batches_received = int(state.get("batches_received", 0))

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> "TrainLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        if self.cfg.prefetch > 0:
            if self._prefetcher is None:
                self._prefetcher = _Prefetcher(self._produce(dict(self._position)),
                                               self.cfg.prefetch)
            batch, position = self._prefetcher.get()
        else:
            if self._batches is None:
                self._batches = self._produce(dict(self._position))
            batch, position = next(self._batches)
        self.wait_seconds += time.perf_counter() - started
        self._position = position
        self.batches_received += 1
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (iteration may continue afterwards)."""
        self._stop()

    def __del__(self) -> None:
        try:
            self._stop()
        except Exception:  # interpreter shutdown: attributes may already be gone
            pass

    def _stop(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None
        self._batches = None

    @property
    def epochs(self) -> list[int]:
        """Per source, the epoch of the first document of the next block's window (for
        logging)."""
        return [cursor[0] for cursor in self._position["stream"]["sources"]]

    @property
    def stats(self) -> dict:
        return {"batches_received": self.batches_received,
                "documents_tokenized": self.documents_tokenized,
                "skipped": dict(self.skips.counts), "wait_seconds": self.wait_seconds}

    # -- production (runs in the prefetch thread when prefetch > 0) ---------------------------
    def _documents(self) -> Iterator[tuple[dict, list[int]]]:
        stream, tok, cfg = self._stream, self.tokenizer, self.cfg
        bos = tok.bos_id if cfg.add_bos else None
        eos = tok.eos_id if cfg.add_eos else None
        while True:
            position = stream.state()
            text = stream.next_document()
            self.documents_tokenized += 1
            yield position, wrap_document(tok.encode(text), bos, eos)

    def _window_wait_note(self, position: dict, base: int) -> str:
        """What the first batch of this stream waits for (at the start or a resume: one block
        window packed whole; ``docs/data.md``, "Order, shuffling and epochs")."""
        window_start = position.get("window_start", base)
        what = ("the first block window" if base == 0 else
                f"block window {window_start}.. again (resuming at block {base})")
        return (f"{what}: data.block_shuffle_window={self.block_window} blocks of "
                f"{self.seq_len + 1} tokens, {self.block_window * (self.seq_len + 1) / 1e6:.1f} M")

    def _produce(self, position: dict) -> Iterator[tuple[dict, dict]]:
        """Yield ``(batch, position after this batch)`` forever from ``position``: re-pack
        from the start of its window, skip the blocks of it already emitted."""
        self._stream.load_state(position["stream"])
        blocks = pack_documents(self._documents(), self.seq_len + 1,
                                first_offset=position["offset"])
        base = position["blocks"]
        emitted = shuffle_windows(blocks, self.block_window, position.get("window_start", base),
                                  self.seed, self._stream_id, self._dtype)
        numbered = itertools.dropwhile(lambda item: item[0] < base, emitted)
        stride, phase = ((self.dp_size, self.dp_rank) if self.cfg.sharding == "global"
                         else (1, 0))
        held = None
        if self.block_window > 1:  # a wait of seconds at long seq_len: say what it is
            note, started = self._window_wait_note(position, base), time.perf_counter()
            log.info("data: tokenising %s tokens before the first batch", note)
            held = next(numbered)
            log.info("data: tokenised %s tokens in %.1f s", note, time.perf_counter() - started)
        while True:
            rows = []
            while len(rows) < self.micro_batch_size:
                j, block, _ = held if held is not None else next(numbered)
                held = None
                if (j - base) % stride == phase:
                    rows.append(block)
            array = np.asarray(rows, dtype=np.int64)
            batch = {"input_ids": torch.from_numpy(array[:, :-1].copy()),
                     "labels": torch.from_numpy(array[:, 1:].copy())}
            # Peek to the first block of the next round: its window is the resume position.
            held = next(numbered)
            while (held[0] - base) % stride:
                held = next(numbered)
            j, _, (window_start, (stream, offset)) = held
            yield batch, self._position_at(stream, offset, j, window_start)


class _Prefetcher:
    """Runs a generator in a daemon thread, ``depth`` items ahead, through a bounded queue.
    Exceptions in the thread are re-raised in the consumer."""

    def __init__(self, generator: Iterator, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop_event = threading.Event()
        self._generator = generator
        self._thread = threading.Thread(target=self._run, name="tape-data-prefetch", daemon=True)
        self._thread.start()
        _LIVE_PREFETCHERS.add(self)

    def _run(self) -> None:
        try:
            for item in self._generator:
                if not self._put(("item", item)):
                    return
        except BaseException as exc:  # delivered to the consumer, which re-raises
            self._put(("error", exc))

    def _put(self, entry) -> bool:
        while not self._stop_event.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        while True:
            try:
                kind, value = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise DataError("data prefetch thread died without reporting an error")
        if kind == "error":
            raise value
        return value

    def stop(self) -> None:
        self._stop_event.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)


# A daemon thread still inside sentencepiece's C++ code while the interpreter finalises aborts
# the process ("terminate called without an active exception"), so stop them at exit.
_LIVE_PREFETCHERS: "weakref.WeakSet[_Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_all_prefetchers() -> None:
    for prefetcher in list(_LIVE_PREFETCHERS):
        prefetcher.stop()


def build_train_loader(data_cfg: DataConfig | dict, tokenizer, seq_len: int,
                       micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                       seed: int = 0):
    """The training loader of data-parallel rank ``dp_rank`` of ``dp_size``: a ``TrainLoader``
    (``data.format: text``) or a ``token_loader.TokenLoader`` (``tokens``). Raises
    ``DataError`` naming the key or file at fault if a source cannot be resolved."""
    if isinstance(data_cfg, dict):
        data_cfg = DataConfig.from_dict(data_cfg)
    if data_cfg.format == "tokens":
        from tape_train.data.token_loader import TokenLoader

        _check_loader_arguments(seq_len, micro_batch_size, dp_rank, dp_size)
        return TokenLoader(data_cfg, tokenizer, seq_len, micro_batch_size, dp_rank, dp_size,
                           seed)
    return TrainLoader(data_cfg, tokenizer, seq_len, micro_batch_size, dp_rank, dp_size, seed)


def iter_eval_documents(data_cfg: DataConfig | dict, tokenizer,
                        byte_ends: bool = False) -> Iterator[tuple]:
    """Held-out documents, never overlapping training documents, in a fixed order.

    Yields ``(token_ids, n_bytes)``: ids wrapped in BOS/EOS as in training, and the UTF-8 byte
    count of the document text (for bits per byte). With ``byte_ends``, ``(token_ids, n_bytes,
    ends)``: for each id, where in the UTF-8 text the text it covers ends (BOS: 0, EOS:
    ``n_bytes``), so an evaluation counts the bytes of exactly the tokens it scores (a
    document cut by ``max_tokens``; the first token, when there is no BOS, is never scored).
    """
    if isinstance(data_cfg, dict):
        data_cfg = DataConfig.from_dict(data_cfg)
    bos = tokenizer.bos_id if data_cfg.add_bos else None
    eos = tokenizer.eos_id if data_cfg.add_eos else None
    skips = SkipLog()
    texts = iter_held_out_texts(data_cfg.sources, data_cfg.eval_sources,
                                data_cfg.eval_fraction, data_cfg.skip_bad_records, skips)
    count = 0
    for text in texts:
        if data_cfg.eval_max_documents is not None and count >= data_cfg.eval_max_documents:
            return
        n_bytes = len(text.encode("utf-8"))
        if byte_ends:
            ids, ends = tokenizer.encode_with_byte_ends(text)
            ends = [0] * (bos is not None) + ends + [n_bytes] * (eos is not None)
        else:
            ids, ends = tokenizer.encode(text), None
        ids = wrap_document(ids, bos, eos)
        if data_cfg.eval_min_tokens is not None and len(ids) < data_cfg.eval_min_tokens:
            continue
        count += 1
        yield (ids, n_bytes) if ends is None else (ids, n_bytes, ends)
