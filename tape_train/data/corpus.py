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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from tape_train.data.config import DataError
from tape_train.data.formats import (MANIFEST_FORMAT, MANIFEST_NAME,  # noqa: F401 - re-exported
                                      prepared_shard_name, read_complete_manifest)
from tape_train.data.sources import is_held_out
from tape_train.data.tokens import TokenShardWriter
from tape_train.files import (fsync_tree, raise_open_file_limit, remove_abandoned_scratch,
                              write_atomic)

log = logging.getLogger("tape_train.data")
# Where a prepare writes before its shards move into place (inside the output directory).
SCRATCH_PREFIX = ".tmp-prepare-"
# Text tokenised per batch (--tokenize): large enough to keep every thread busy, small enough
# that the batch's token lists (~40 bytes per token as Python ints) stay well under 1 GB.
TOKENIZE_BATCH_BYTES = 8 << 20

class _ShardSet:
    """Round-robin writer over ``n`` zstd-compressed JSONL shards of one split."""

    def __init__(self, directory: Path, split: str, n: int, frame_bytes: int = 1 << 20):
        import zstandard

        self.split = split
        self.names = [prepared_shard_name(split, i, n) for i in range(n)]
        self.files = [open(directory / name, "wb") for name in self.names]
        self.writers = [zstandard.ZstdCompressor(level=3).stream_writer(f) for f in self.files]
        self.documents = [0] * n
        self.text_bytes = [0] * n
        # A new zstd frame every ~frame_bytes of JSON: (compressed offset, first record) of
        # each frame lets a reader start at any record by decompressing at most one frame.
        self.frame_bytes = frame_bytes
        self.frames: list[list[list[int]]] = [[[0, 0]] for _ in range(n)]
        self.in_frame = [0] * n
        self.next = 0

    def write(self, record: dict, n_bytes: int) -> None:
        import zstandard

        i = self.next
        self.next = (i + 1) % len(self.writers)
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self.writers[i].write(line)
        self.documents[i] += 1
        self.text_bytes[i] += n_bytes
        self.in_frame[i] += len(line)
        if self.in_frame[i] >= self.frame_bytes:
            self.writers[i].flush(zstandard.FLUSH_FRAME)
            self.frames[i].append([self.files[i].tell(), self.documents[i]])
            self.in_frame[i] = 0

    def close(self, directory: Path) -> list[dict]:
        entries = []
        for i, name in enumerate(self.names):
            self.writers[i].close()  # also closes the file
            data = (directory / name).read_bytes()
            frames = [f for f in self.frames[i] if f[0] < len(data)]  # none starts at EOF
            entries.append({"path": name, "split": self.split, "documents": self.documents[i],
                            "text_bytes": self.text_bytes[i], "file_bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest(), "frames": frames})
        return entries


def write_corpus(documents: Iterable[dict], out_dir: str | os.PathLike, *, num_shards: int = 16,
                 eval_fraction: float = 0.01, seed: int = 0, shuffle_bytes: int = 256 << 20,
                 config: dict | None = None, extra: dict | None = None,
                 tokenizer=None, frame_bytes: int = 1 << 20, workers: int = 1) -> dict:
    """Write ``documents`` (dicts with ``text``, ``source``, ``id``) as a prepared corpus.

    With ``tokenizer``, every training shard also gets its token shard (``tokens.py``) in the
    same pass, listed in the manifest's ``tokens`` section; documents are tokenised in batches
    on ``workers`` threads (the output does not depend on ``workers``).

    Output goes to a temporary directory inside ``out_dir`` first; shards are moved into place
    and the manifest is written last with an atomic rename, so an interrupted run never leaves
    a directory that looks complete. Returns the manifest.
    """
    if num_shards <= 0:
        raise DataError(f"--num-shards must be positive, got {num_shards}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if workers <= 0:
        raise DataError(f"--workers must be positive, got {workers}")
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
    for left in remove_abandoned_scratch(out, SCRATCH_PREFIX):
        log.info("prepare: removed %s, left by an interrupted prepare", left)
    tmp = out / f"{SCRATCH_PREFIX}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    train = _ShardSet(tmp, "train", num_shards, frame_bytes)
    held = _ShardSet(tmp, "eval", 1)
    token_shards = TokenShardWriter(tmp, train.names, tokenizer) if tokenizer else None
    rng = np.random.default_rng([seed, 0x5052])
    seen: set[bytes] = set()
    per_source: dict[str, dict] = {}
    counts = {"duplicates": 0, "empty": 0}
    buffer: list[tuple[dict, int]] = []
    buffer_bytes = 0
    started = last_log = time.monotonic()

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

    try:
        for doc in documents:
            text = doc["text"]
            stats = per_source.setdefault(doc["source"], {"documents": 0, "text_bytes": 0})
            if not text.strip():
                counts["empty"] += 1
                continue
            data = text.encode("utf-8")
            digest = hashlib.blake2b(data, digest_size=16).digest()
            if digest in seen:
                counts["duplicates"] += 1
                continue
            seen.add(digest)
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
            if time.monotonic() - last_log > 5.0:
                last_log = time.monotonic()
                log.info("prepare: %d documents, %.1f MB so far", len(seen),
                         sum(s["text_bytes"] for s in per_source.values()) / 1e6)
        flush()
        entries = train.close(tmp) + held.close(tmp)
        tokens = token_shards.close() if token_shards is not None else None
        if not seen:
            raise DataError("prepare: no non-empty documents in the input")
        (out / MANIFEST_NAME).unlink(missing_ok=True)  # never pair an old manifest with new shards
        fsync_tree(tmp)  # the manifest written below must never vouch for shards still in cache
        for entry in entries + (tokens["shards"] if tokens else []):
            os.replace(tmp / entry["path"], out / entry["path"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    splits = {}
    for split in ("train", "eval"):
        chosen = [e for e in entries if e["split"] == split]
        splits[split] = {"shards": len(chosen), "documents": sum(e["documents"] for e in chosen),
                         "text_bytes": sum(e["text_bytes"] for e in chosen)}
    manifest = {
        "format": MANIFEST_FORMAT,
        "text_field": "text",
        "config": config or {},
        "held_out": {"eval_fraction": eval_fraction,
                     "rule": "blake2b-64(UTF-8 text) < eval_fraction * 2^64 "
                             "(tape_train.data.sources.is_held_out)"},
        "splits": splits,
        "sources": per_source,
        "dropped": counts,
        "shards": entries,
        **({"tokens": tokens} if tokens else {}),
        **(extra or {}),
    }
    write_atomic(out / MANIFEST_NAME, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    log.info("prepare: wrote %d train + %d eval documents (%.1f MB of text) in %d shards to %s "
             "in %.1f s", splits["train"]["documents"], splits["eval"]["documents"],
             (splits["train"]["text_bytes"] + splits["eval"]["text_bytes"]) / 1e6,
             len(entries), out, time.monotonic() - started)
    return manifest
