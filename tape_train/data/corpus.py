"""Write prepared corpora: JSONL.zst shards + a held-out split + ``manifest.json``.

Layout of a prepared directory::

    train-00000-of-00016.jsonl.zst ... train-00015-of-00016.jsonl.zst
    eval-00000-of-00001.jsonl.zst
    train-00000-of-00016.tokens ...     # only with --tokenize (tokens.py)
    manifest.json        # written last, atomically: its presence means "complete"

Each line is ``{"text": ..., "source": ..., "id": ...}``. Documents are deduplicated by
content, held out by the same text hash the loader uses (``sources.is_held_out``), shuffled in
seeded buffers of up to ``shuffle_bytes`` and dealt round-robin to shards. The shard count
defaults to 16, a multiple of every likely data-parallel size up to 16.

After each buffer flush the pass takes a checkpoint (``prepare_scratch.py``): an interrupted
prepare re-run with the same options and inputs resumes from its last one, with output
byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from tape_train.data.config import DataError
from tape_train.data.formats import (MANIFEST_FORMAT, MANIFEST_NAME,  # noqa: F401 - re-exported
                                      prepared_shard_name, read_complete_manifest)
from tape_train.data.sources import is_held_out
from tape_train.data.prepare_scratch import (SCRATCH_PREFIX, SEEN_NAME,  # noqa: F401
                                              DigestLog, PrepareScratch, kill_point)
from tape_train.data.tokens import TokenShardWriter
from tape_train.files import fsync_dir, fsync_tree, raise_open_file_limit, write_atomic

log = logging.getLogger("tape_train.data")
# Text tokenised per batch (--tokenize): large enough to keep every thread busy, small enough
# that the batch's token lists (~40 bytes per token as Python ints) stay well under 1 GB.
TOKENIZE_BATCH_BYTES = 8 << 20
# Training text per shuffle buffer (the default of --shuffle-bytes); a checkpoint follows each.
SHUFFLE_BYTES = 256 << 20

# A source of documents that can start anywhere: called with a position it yielded before (or
# None: from the first document), it yields ``(document, position after it)``; positions are
# JSON-able (local files: [file, record]).
DocumentSource = Callable[[list | None], Iterator[tuple[dict, list]]]


class _ShardSet:
    """Round-robin writer over ``n`` zstd-compressed JSONL shards of one split; ``state`` (a
    ``checkpoint()``) continues files already cut back to that checkpoint."""

    def __init__(self, directory: Path, split: str, n: int, frame_bytes: int = 1 << 20,
                 state: dict | None = None):
        import zstandard

        self.split = split
        self.names = [prepared_shard_name(split, i, n) for i in range(n)]
        self.files = [open(directory / name, "r+b" if state else "wb") for name in self.names]
        for f in self.files:
            f.seek(0, os.SEEK_END)
        # Each frame is ended explicitly, and the files are closed without closing the writers
        # (which would append an empty frame): a resumed file's bytes equal an unbroken one's.
        # Each frame ends with its content's checksum, which every read checks at the frame's
        # end: bytes changed on disk or in a copy fail the read, naming the shard, where they
        # could decode to other text without a word.
        self.writers = [zstandard.ZstdCompressor(level=3, write_checksum=True)
                        .stream_writer(f, closefd=False) for f in self.files]
        state = state or {}
        self.documents = state.get("documents", [0] * n)
        self.text_bytes = state.get("text_bytes", [0] * n)
        # A new zstd frame every ~frame_bytes of JSON and at every checkpoint: (compressed
        # offset, first record) of each frame lets a reader start at any record by
        # decompressing at most one frame.
        self.frame_bytes = frame_bytes
        self.frames: list[list[list[int]]] = state.get("frames", [[[0, 0]] for _ in range(n)])
        self.in_frame = [0] * n
        self.next = state.get("next", 0)

    def write(self, record: dict, n_bytes: int) -> None:
        i = self.next
        self.next = (i + 1) % len(self.writers)
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self.writers[i].write(line)
        self.documents[i] += 1
        self.text_bytes[i] += n_bytes
        self.in_frame[i] += len(line)
        if self.in_frame[i] >= self.frame_bytes:
            self._end_frame(i)

    def _end_frame(self, i: int) -> None:
        import zstandard

        self.writers[i].flush(zstandard.FLUSH_FRAME)
        self.frames[i].append([self.files[i].tell(), self.documents[i]])
        self.in_frame[i] = 0

    def checkpoint(self) -> dict:
        """End every open frame; returns what continues the shards from here."""
        for i, pending in enumerate(self.in_frame):
            if pending:
                self._end_frame(i)
        return {"documents": self.documents, "text_bytes": self.text_bytes,
                "frames": self.frames, "next": self.next}

    def close(self, directory: Path) -> list[dict]:
        self.checkpoint()
        entries = []
        for i, name in enumerate(self.names):
            self.files[i].close()
            digest, size = hashlib.sha256(), 0
            with open(directory / name, "rb") as f:  # in chunks: a shard may be many GB
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
                    size += len(chunk)
            frames = [f for f in self.frames[i] if f[0] < size]  # none starts at EOF
            entries.append({"path": name, "split": self.split, "documents": self.documents[i],
                            "text_bytes": self.text_bytes[i], "file_bytes": size,
                            "sha256": digest.hexdigest(), "frames": frames})
        return entries

    def abandon(self) -> None:
        for f in self.files:
            f.close()


def _counted(documents: Iterable[dict]) -> DocumentSource:
    """A plain iterable of documents as a source whose position is the count taken (resuming
    takes and drops that many again)."""
    def source(position: list | None) -> Iterator[tuple[dict, list]]:
        skip = position[0] if position else 0
        for taken, doc in enumerate(documents, start=1):
            if taken > skip:
                yield doc, [taken]
    return source


def write_corpus(documents: Iterable[dict] | DocumentSource, out_dir: str | os.PathLike, *,
                 num_shards: int = 16, eval_fraction: float = 0.01, seed: int = 0,
                 shuffle_bytes: int = SHUFFLE_BYTES, config: dict | None = None,
                 extra: dict | None = None, tokenizer=None, frame_bytes: int = 1 << 20,
                 workers: int = 1, inputs=None, fresh: bool = False) -> dict:
    """Write ``documents`` (dicts with ``text``, ``source``, ``id``; or a ``DocumentSource``
    of them) as a prepared corpus.

    With ``tokenizer``, every training shard also gets its token shard (``tokens.py``) in the
    same pass, listed in the manifest's ``tokens`` section; documents are tokenised in batches
    on ``workers`` threads (the output does not depend on ``workers``).

    Output goes to a scratch directory inside ``out_dir`` first; shards are moved into place
    and the manifest is written last with an atomic rename, so an interrupted run never leaves
    a directory that looks complete. An interrupted run with the same options, and the same
    ``inputs`` (a JSON-able identity of the input files), resumes from its last checkpoint
    (``fresh``: start over). Returns the manifest.
    """
    if num_shards <= 0:
        raise DataError(f"--num-shards must be positive, got {num_shards}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if workers <= 0:
        raise DataError(f"--workers must be positive, got {workers}")
    if shuffle_bytes <= 0:
        raise DataError(f"--shuffle-bytes must be positive, got {shuffle_bytes}")
    # Every shard (and its token shard) stays open for the whole pass; 64 for everything else.
    needed = (num_shards + 1) * (2 if tokenizer is not None else 1) + 64
    limit = raise_open_file_limit(needed)
    if limit < needed:
        raise DataError(f"--num-shards {num_shards} keeps {needed - 64} files open at once, but "
                        f"this process may open only {limit} (ulimit -n); use at most "
                        f"{max(1, (limit - 64) // (2 if tokenizer is not None else 1) - 1)} "
                        f"shards or raise the limit")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    options = {"config": config or {}, "num_shards": num_shards, "eval_fraction": eval_fraction,
               "seed": seed, "shuffle_bytes": shuffle_bytes, "frame_bytes": frame_bytes,
               "tokenizer": tokenizer.sha256 if tokenizer is not None else None}
    scratch = PrepareScratch.open(out, options, inputs, fresh)
    if scratch.state is not None and "manifest" in scratch.state:
        log.info("prepare: resuming the interrupted prepare in %s: its shards are complete",
                 scratch.dir)
        manifest = scratch.state["manifest"]
    else:
        source = documents if callable(documents) else _counted(documents)
        manifest = _write_shards(source, scratch, num_shards=num_shards,
                                 eval_fraction=eval_fraction, seed=seed,
                                 shuffle_bytes=shuffle_bytes, tokenizer=tokenizer,
                                 frame_bytes=frame_bytes, workers=workers, inputs=inputs)
        manifest = {"format": MANIFEST_FORMAT, "text_field": "text", "config": config or {},
                    **manifest, **(extra or {})}
        scratch.save_final(inputs, manifest)
    _move_into_place(scratch, out, manifest)
    splits = manifest["splits"]
    log.info("prepare: wrote %d train + %d eval documents (%.1f MB of text) in %d shards to %s "
             "in %.1f s", splits["train"]["documents"], splits["eval"]["documents"],
             (splits["train"]["text_bytes"] + splits["eval"]["text_bytes"]) / 1e6,
             len(manifest["shards"]), out, time.monotonic() - started)
    return manifest


def _write_shards(source: DocumentSource, scratch: PrepareScratch, *, num_shards: int,
                  eval_fraction: float, seed: int, shuffle_bytes: int, tokenizer,
                  frame_bytes: int, workers: int, inputs) -> dict:
    """The pass over the documents into ``scratch``, from its last checkpoint; returns the
    manifest's sections that describe the shards (their files fsynced)."""
    tmp = scratch.dir
    state = scratch.state["progress"] if scratch.state is not None else {}
    train = _ShardSet(tmp, "train", num_shards, frame_bytes, state.get("train"))
    held = _ShardSet(tmp, "eval", 1, state=state.get("eval"))
    token_shards = (TokenShardWriter(tmp, train.names, tokenizer, state=state.get("tokens"))
                    if tokenizer else None)
    seen = DigestLog(tmp / SEEN_NAME, state.get("seen"))
    rng = np.random.default_rng([seed, 0x5052])
    if state:
        rng.bit_generator.state = state["rng"]
    per_source: dict[str, dict] = state.get("per_source", {})
    counts = state.get("dropped", {"duplicates": 0, "empty": 0})
    taken = state.get("documents", 0)  # documents taken from the source so far
    checkpoint = scratch.state["checkpoint"] if scratch.state is not None else 0
    if state:
        log.info("prepare: resuming prepare from %d documents (%.1f MB), checkpoint %d",
                 taken, sum(s["text_bytes"] for s in per_source.values()) / 1e6, checkpoint)
    buffer: list[tuple[dict, int]] = []
    buffer_bytes = 0
    last_log = time.monotonic()

    def flush() -> None:
        nonlocal buffer, buffer_bytes
        order = [buffer[k] for k in rng.permutation(len(buffer))]
        start = 0
        while start < len(order):  # batches of ~TOKENIZE_BATCH_BYTES of text
            end, size = start, 0
            while end < len(order) and (end == start or size < TOKENIZE_BATCH_BYTES):
                size += order[end][1]
                end += 1
            batch = order[start:end]
            ids = (tokenizer.encode_batch([record["text"] for record, _ in batch], workers)
                   if token_shards is not None else None)
            for j, (record, n_bytes) in enumerate(batch):
                if ids is not None:
                    token_shards.write(train.next, ids[j])
                train.write(record, n_bytes)
            start = end
        buffer, buffer_bytes = [], 0

    def save(position: list) -> None:
        nonlocal checkpoint
        checkpoint += 1
        progress = {"position": position, "documents": taken, "seen": seen.checkpoint(),
                    "rng": rng.bit_generator.state, "per_source": per_source, "dropped": counts,
                    "train": train.checkpoint(), "eval": held.checkpoint(),
                    "tokens": token_shards.checkpoint() if token_shards is not None else None}
        files = train.files + held.files + [seen.file]
        scratch.save(checkpoint, inputs, progress,
                     files + (token_shards.files if token_shards is not None else []))

    try:
        for doc, position in source(state.get("position")):
            taken += 1
            text = doc["text"]
            stats = per_source.setdefault(doc["source"], {"documents": 0, "text_bytes": 0})
            if not text.strip():
                counts["empty"] += 1
                continue
            data = text.encode("utf-8")
            if not seen.add(hashlib.blake2b(data, digest_size=16).digest()):
                counts["duplicates"] += 1
                continue
            stats["documents"] += 1
            stats["text_bytes"] += len(data)
            record = {"text": text, "source": doc["source"], "id": doc["id"]}
            if is_held_out(text, eval_fraction):
                held.write(record, len(data))
            else:
                buffer.append((record, len(data)))
                buffer_bytes += len(data)
                if buffer_bytes >= shuffle_bytes:
                    flush()
                    save(position)
            if time.monotonic() - last_log > 5.0:
                last_log = time.monotonic()
                log.info("prepare: %d documents, %.1f MB so far", len(seen),
                         sum(s["text_bytes"] for s in per_source.values()) / 1e6)
        flush()
        if not len(seen):
            raise DataError("prepare: no non-empty documents in the input")
        entries = train.close(tmp) + held.close(tmp)
        tokens = token_shards.close() if token_shards is not None else None
        seen.file.close()
    except BaseException:
        for writer in (train, held, token_shards):
            if writer is not None:
                writer.abandon()
        seen.file.close()
        # The last checkpoint whose state was written (not one that failed part-way).
        saved = scratch.saved_checkpoint()
        if saved == 0 or not len(seen):
            scratch.remove()  # nothing to resume from
        else:
            log.info("prepare: stopped; the same command resumes from checkpoint %d (%s), "
                     "--fresh starts over", saved, tmp)
        raise
    fsync_tree(tmp)  # the manifest written later must never vouch for shards still in cache
    splits = {}
    for split in ("train", "eval"):
        chosen = [e for e in entries if e["split"] == split]
        splits[split] = {"shards": len(chosen), "documents": sum(e["documents"] for e in chosen),
                         "text_bytes": sum(e["text_bytes"] for e in chosen)}
    return {
        "held_out": {"eval_fraction": eval_fraction,
                     "rule": "blake2b-64(UTF-8 text) < eval_fraction * 2^64 "
                             "(tape_train.data.sources.is_held_out)"},
        "splits": splits,
        "sources": per_source,
        "dropped": counts,
        "shards": entries,
        **({"tokens": tokens} if tokens else {}),
    }


def _listed_names(directory: Path) -> list[str]:
    """The file names the manifest in ``directory`` lists; none without a readable one."""
    from tape_train.data.verify import listed_files

    try:
        return [item.name for item in listed_files(directory)]
    except DataError:
        return []


def _move_into_place(scratch: PrepareScratch, out: Path, manifest: dict) -> None:
    """Move the finished shards from the scratch into ``out`` and write the manifest last;
    repeatable after a kill part-way (a shard already moved is checked by size).

    A corpus this one replaces (other options) loses the shards the new manifest does not
    list, e.g. 16 of them where 4 are written: left beside it they made the directory fail
    ``tape-data info --verify`` and a glob read them. They go while the old manifest still
    names them, so a kill here leaves it listing missing files (incomplete, never mistaken
    for complete) and the re-run finishes the job."""
    entries = manifest["shards"] + (manifest.get("tokens") or {}).get("shards", [])
    new = {entry["path"] for entry in entries}
    for name in _listed_names(out):
        if name not in new:
            (out / name).unlink(missing_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # never pair an old manifest with new shards
    for entry in entries:
        source, target = scratch.dir / entry["path"], out / entry["path"]
        if source.is_file():
            os.replace(source, target)
            kill_point("moved")
        elif not (target.is_file() and target.stat().st_size == entry["file_bytes"]):
            raise DataError(f"prepare: {target} should have been moved into place by the "
                            f"interrupted prepare in {scratch.dir} but is missing or not "
                            f"{entry['file_bytes']} bytes; re-run with --fresh")
    fsync_dir(out)
    write_atomic(out / MANIFEST_NAME, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    kill_point("manifest")
    scratch.remove()
