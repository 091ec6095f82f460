"""Shards and record readers: turn a source's files (or Hub dataset) into documents.

A *shard* is one file (or one shard of a streamed Hub dataset). ``read_documents(shard,
start)`` yields ``(record_index, text)`` for every valid, non-empty document from raw record
``start`` on. Record indices count raw records (JSONL lines, Parquet rows), including blank,
bad and skipped ones, so a position (shard, record) is stable across runs — the basis of
exact resume. Skipping to ``start`` in JSONL only counts lines (no JSON parsing).

A UTF-8 byte-order mark at the start of a JSONL file (Windows editors write one) is not part
of its first record and is dropped; it moves no position, which counts records, not bytes
(the file's size in a state's fingerprint is its size on disk, unchanged). Such a file was
refused before (malformed JSON at line 1), so no earlier run read it otherwise. Plain-text
files are read byte for byte, a mark included.

We read local files ourselves rather than through ``datasets``' JSON builder because that
builder cannot name the failing line or skip a bad record; Hub datasets go through
``datasets.load_dataset(..., streaming=True)``.
"""

from __future__ import annotations

import _io
import atexit
import gc
import glob
import gzip
import json
import logging
import os
import re
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tape_train.data.config import DEMO_DIR, DataError, SourceConfig

log = logging.getLogger("tape_train.data")

JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt", ".md", ".rst")
COMPRESSION_SUFFIXES = (".gz", ".zst")
UTF8_BOM = b"\xef\xbb\xbf"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tape-data/1"
# Names of the shards ``tape-data prepare`` writes (train-00003-of-00016.jsonl.zst); a
# directory holding them but no manifest is a prepare that did not finish.
PREPARED_SHARD = re.compile(r"(train|eval)-\d{5}-of-\d{5}\.jsonl\.zst")


def prepared_shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.jsonl.zst"


class SkipLog:
    """Counts skipped records per reason and logs them (the first few in full with file:line,
    then every 1000th), so skipping is never silent. ``flags``: the records come from a
    command line (``tape-data``, ``tape-tokenizer``), so errors name its flags
    (``--skip-bad-records``, ``--text-field``) instead of the config keys."""

    FULL_LOGS_PER_REASON = 10

    def __init__(self, flags: bool = False) -> None:
        self.counts: Counter[str] = Counter()
        self.skip_option = ("add --skip-bad-records" if flags
                            else "set data.skip_bad_records=true")
        self.text_field_option = ("pass --text-field NAME" if flags
                                  else "set the source's text_field")

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        n = self.counts[reason]
        if n <= self.FULL_LOGS_PER_REASON or n % 1000 == 0:
            log.warning("data: skipped record (%s) at %s%s [%d %s so far]", reason, where,
                        f": {detail}" if detail else "", n, reason)


def classify(path: Path) -> tuple[str, str] | None:
    """(kind, compression) of a file name, kind in jsonl/text/parquet; None if unsupported."""
    name = path.name.lower()
    compression = ""
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            compression, name = suffix[1:], name[: -len(suffix)]
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(TEXT_SUFFIXES):
        return "text", compression
    if name.endswith(".parquet") and not compression:
        return "parquet", ""
    return None


@dataclass(frozen=True)
class Shard:
    """One readable unit: a local file, or shard ``hub_index`` of a streamed Hub dataset."""

    kind: str  # jsonl | text | parquet | hub
    path: str  # file path, or "hub:<name>/<config>/<split>#<index>"
    compression: str = ""
    size: int = 0  # bytes on disk (0 for hub)
    hub_index: int = -1
    # Prepared zstd shards: ((compressed byte offset, first record), ...) of each zstd frame,
    # so reading from record k decompresses only from the frame holding k (manifest "frames").
    frames: tuple = ()

    @property
    def identity(self) -> list:
        """What the fingerprint records: file name and size (not the absolute path, so a run
        can resume after moving the data)."""
        return [Path(self.path).name if self.kind != "hub" else self.path, self.size]

    def content_sample(self, per_file: int = 1 << 20) -> str | None:
        """A digest of the file's bytes, or of samples of them (``content_sample``), which the
        resume check compares beside name and size; ``None`` for a Hub shard, or a file that
        cannot be read now (its reading then fails with its own error)."""
        if self.kind == "hub":
            return None
        try:
            return content_sample(self.path, self.size, per_file)
        except OSError:
            return None


# A file's content sample reads at most ``per_file`` bytes of it: the whole file up to that
# size, else CONTENT_SAMPLES chunks of per_file / CONTENT_SAMPLES bytes, evenly spaced from its
# head to its tail. ``per_file`` is 1 MiB for a source of up to 64 files and shrinks with more
# (CONTENT_BUDGET per source, at least CONTENT_MIN_PER_FILE per file), so that every rank's
# loader reads a bounded amount of a large corpus (1024 files: 64 KiB each; the page cache of
# a shared file system then serves the ranks of a node). Modification times are not used (a
# copy of the corpus to node-local scratch changes them and must still resume).
CONTENT_MAX_PER_FILE = 1 << 20
CONTENT_BUDGET = 64 << 20
CONTENT_MIN_PER_FILE = 8 << 10
CONTENT_SAMPLES = 16


def content_plan(n_files: int) -> tuple[int, str]:
    """``(per_file, rule)`` for a source of ``n_files`` files: the bytes read of each (a power
    of two) and the name a state records (samples taken by another rule are not compared)."""
    per_file = CONTENT_MAX_PER_FILE
    while per_file > CONTENT_MIN_PER_FILE and per_file * n_files > CONTENT_BUDGET:
        per_file //= 2
    return per_file, f"xxh3/{per_file}/{CONTENT_SAMPLES}"


def content_sample(path: str | os.PathLike, size: int, per_file: int = 1 << 20) -> str:
    """xxh3-64 (hex) of the first ``size`` bytes of a file of up to ``per_file`` bytes, else of
    samples of them: the head, the tail and evenly spaced chunks between (``per_file`` bytes
    in all). An edit in place that keeps the size is seen anywhere in a file read whole, in a
    larger one when it touches a sample. Raises ``OSError``."""
    import xxhash

    digest = xxhash.xxh3_64()
    digest.update(str(size).encode())
    chunk = per_file // CONTENT_SAMPLES
    with open(path, "rb") as fh:
        if size <= per_file:
            digest.update(fh.read(size))
        else:
            for i in range(CONTENT_SAMPLES):
                fh.seek((size - chunk) * i // (CONTENT_SAMPLES - 1))
                digest.update(fh.read(chunk))
    return digest.hexdigest()


def resolve_local_shards(source: SourceConfig, split: str = "train") -> list[Shard]:
    """Files of ``source.path`` (files, dirs, globs), sorted; a prepared directory contributes
    the manifest's shards of ``split``. Errors name the config key and the path."""
    key = source.field_key("path")
    found: list[Path] = []
    frames: dict[Path, tuple] = {}
    for pattern in source.paths:
        p = Path(pattern)
        if any(ch in pattern for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
            files = [m for m in matches if m.is_file() and classify(m)]
            if not files:
                raise DataError(f"{key}: glob {pattern!r} matched no supported files "
                                f"({len(matches)} paths matched)")
            found.extend(files)
        elif p.is_dir():
            if is_prepared_dir(p):
                found.extend(manifest_shard_paths(p, split, frames))
                continue
            files = sorted(f for f in p.rglob("*") if f.is_file() and classify(f)
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            nested = sorted(d for d in {f.parent for f in files} if is_prepared_dir(d))
            if nested:
                raise DataError(
                    f"{key}: directory {pattern!r} holds the prepared directory "
                    f"{str(nested[0])!r}{' (and more)' if len(nested) > 1 else ''}, which would "
                    f"be read as raw files, its held-out eval split and any unfinished shards "
                    f"included; name the prepared directory itself as the path (its training "
                    f"shards), and keep it outside directories given as raw input")
            unfinished = [f.name for f in files if PREPARED_SHARD.fullmatch(f.name)]
            if unfinished:
                raise DataError(
                    f"{key}: directory {pattern!r} holds shards of `tape-data prepare` "
                    f"({unfinished[0]}, ...) but no {MANIFEST_NAME}: the prepare was "
                    f"interrupted (or the manifest deleted), so shards may be missing and its "
                    f"eval split would be read as training data; re-run the `tape-data "
                    f"prepare` that writes it")
            if not files:
                from tape_train.data.prepare_scratch import unfinished_prepare_note

                raise DataError(f"{key}: directory {pattern!r} holds no supported files "
                                f"(.jsonl/.ndjson[.gz|.zst], .parquet, .txt/.md/.rst[.gz|.zst])"
                                f"{_saved_dataset_note(p)}{unfinished_prepare_note(p)}")
            found.extend(files)
        elif p.is_file():
            if not classify(p):
                raise DataError(f"{key}: unsupported file type {pattern!r} (supported: "
                                f".jsonl/.ndjson[.gz|.zst], .parquet, .txt/.md/.rst[.gz|.zst])")
            found.append(p)
        else:
            raise DataError(f"{key}: no such file or directory {pattern!r}{_missing_hint(p)}")
    if split == "train":
        held_out = [f for f in found if _is_held_out_shard(f)]
        if held_out:
            raise DataError(
                f"{key}: {str(held_out[0])!r} is the held-out (eval) split of the prepared "
                f"directory {str(held_out[0].parent)!r}; reading it as training text would "
                f"train on the documents evaluation scores. Name the directory itself (its "
                f"training shards), or select only its train-* shards")
    shards = []
    for f in found:
        kind, compression = classify(f)
        shards.append(Shard(kind, str(f), compression, f.stat().st_size,
                            frames=frames.get(f, ())))
    return shards


def _is_held_out_shard(path: Path) -> bool:
    """An eval shard of a prepared directory (named so, beside its manifest)."""
    return (path.name.startswith("eval-") and bool(PREPARED_SHARD.fullmatch(path.name))
            and is_prepared_dir(path.parent))


def _missing_hint(path: Path) -> str:
    """What to do about a source path that does not exist (the first error of a new checkout)."""
    if path.is_absolute():
        return ""
    hint = f" (relative to the working directory {Path.cwd()})"
    if path == Path(DEMO_DIR):
        hint += (f"; the demo corpus is built by `tape-data prepare --demo --out {DEMO_DIR}` "
                 f"and its tokenizer by `tape-tokenizer train --input {DEMO_DIR} --spec demo "
                 f"--out {DEMO_DIR}/tokenizer` (`make demo` in a checkout does both)")
    return hint


def _saved_dataset_note(directory: Path) -> str:
    """How to read a directory written by ``datasets``' ``save_to_disk`` (Arrow files, which
    ``path`` does not read): as a ``hub`` source; "" for any other directory."""
    if not any((directory / name).is_file() for name in ("dataset_dict.json", "state.json")):
        return ""
    return (f"; it is a directory of Hugging Face `datasets` (save_to_disk): read it as a Hub "
            f"source, `hub: {directory}` in a data config, or prepare it once with "
            f"`tape-data prepare --hub {directory} --out DIR` and name DIR")


def is_prepared_dir(directory: Path) -> bool:
    """Whether ``directory`` is a ``tape-data prepare`` output: it holds a ``manifest.json``
    of our format. Another tool's ``manifest.json`` in a raw corpus makes no prepared
    directory; one of ours that no longer parses still does (reading it names the damage)."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return True
    if not isinstance(manifest, dict):
        return True
    if "format" in manifest:
        return manifest["format"] == MANIFEST_FORMAT
    return "shards" in manifest


def manifest_shard_paths(directory: Path, split: str,
                         frames: dict | None = None) -> list[Path]:
    """Shard files of one split listed in ``directory/manifest.json``; their zstd frame
    indexes (where the manifest has them) are added to ``frames`` by path. A listed shard
    that is missing or not of its listed size (an interrupted copy, a truncated file) is an
    error: the completeness rule of ``read_complete_manifest``, naming the shard."""
    manifest_path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = [s for s in manifest["shards"] if s["split"] == split]
        listed = [int(entry["file_bytes"]) for entry in entries]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{manifest_path}: not a valid tape-data manifest ({exc})") from None
    paths = []
    for entry, size in zip(entries, listed):
        path = directory / entry["path"]
        if not path.is_file():
            raise DataError(f"{manifest_path}: listed shard {entry['path']!r} is missing; "
                            f"re-run `tape-data prepare`")
        if path.stat().st_size != size:
            raise DataError(f"{manifest_path}: shard {entry['path']!r} is "
                            f"{path.stat().st_size} bytes, but the manifest lists {size}: the "
                            f"directory is incomplete or damaged (a copy cut short?); copy it "
                            f"again or re-run `tape-data prepare`")
        paths.append(path)
        if frames is not None and entry.get("frames"):
            frames[path] = tuple((int(o), int(r)) for o, r in entry["frames"])
    return paths


def _zstd_chunks(path: str, chunk_bytes: int = 1 << 20, offset: int = 0) -> Iterator[bytes]:
    """Decompressed chunks of a (possibly multi-frame) zstd file from byte ``offset`` (a frame
    start). Raises on a truncated last frame — zstandard's stream_reader just stops there,
    which would lose data silently."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    dobj, fed = dctx.decompressobj(), False
    with open(path, "rb") as fh:
        fh.seek(offset)
        while chunk := fh.read(chunk_bytes):
            while chunk:
                fed = True
                try:
                    out = dobj.decompress(chunk)
                except zstandard.ZstdError as exc:
                    raise OSError(f"corrupt zstd data: {exc}") from None
                if out:
                    yield out
                if dobj.eof:  # frame complete; the rest of the chunk starts the next frame
                    chunk = dobj.unused_data
                    dobj, fed = dctx.decompressobj(), False
                else:
                    chunk = b""
    if fed and not dobj.eof:
        raise EOFError("zstd stream ends inside a frame (truncated file)")


def _chunk_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    tail = b""
    for chunk in chunks:
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        yield from lines
    if tail:
        yield tail


def _seek_frame(shard: Shard, start: int) -> tuple[int, int]:
    """(byte offset, record index) of the last indexed zstd frame starting at or before record
    ``start``; (0, 0) without an index."""
    best = (0, 0)
    for offset, record in shard.frames:
        if record > start:
            break
        best = (offset, record)
    return best


def _iter_lines(shard: Shard, offset: int = 0) -> Iterator[bytes]:
    """Raw lines (without the newline) of a plain, gzip or zstd file (zstd: from the frame at
    byte ``offset``)."""
    if shard.compression == "zst":
        yield from _chunk_lines(_zstd_chunks(shard.path, offset=offset))
        return
    opener = gzip.open if shard.compression == "gz" else open
    with opener(shard.path, "rb") as fh:
        for line in fh:
            yield line.rstrip(b"\n")


def _read_all(shard: Shard) -> bytes:
    if shard.compression == "zst":
        return b"".join(_zstd_chunks(shard.path))
    opener = gzip.open if shard.compression == "gz" else open
    with opener(shard.path, "rb") as fh:
        return fh.read()


def read_documents(shard: Shard, start: int, text_field: str, skip_bad: bool,
                   skips: SkipLog, hub_dataset=None, stride: int = 1,
                   phase: int = 0) -> Iterator[tuple[int, str]]:
    """Yield ``(record_index, text)`` of valid non-empty documents from record ``start`` on,
    only of raw records ``i ≡ phase (mod stride)`` (a rank's share of a shared shard; the other
    records are counted, not parsed)."""
    if shard.kind == "jsonl":
        yield from _read_jsonl(shard, start, text_field, skip_bad, skips, stride, phase)
    elif shard.kind == "text":
        if start == 0 and phase == 0:
            yield from _read_text_file(shard, skip_bad, skips)
    elif shard.kind == "parquet":
        yield from _read_parquet(shard, start, text_field, skip_bad, skips, stride, phase)
    elif shard.kind == "hub":
        yield from _read_hub(shard, hub_dataset, start, text_field, skip_bad, skips, stride,
                             phase)
    else:
        raise DataError(f"{shard.path}: unknown shard kind {shard.kind!r}")


def _damage_hint(shard: Shard) -> str:
    """What a bad record means in a shard that ``tape-data prepare`` wrote ("" elsewhere):
    prepare writes only valid records, so the file was damaged after it was written."""
    path = Path(shard.path)
    if not (PREPARED_SHARD.fullmatch(path.name) and is_prepared_dir(path.parent)):
        return ""
    return (f"; tape-data prepare wrote this shard with valid records only, so it was damaged "
            f"since: `tape-data info {path.parent} --verify` checks every shard against its "
            f"sha256 (copy the directory again, or re-run the prepare)")


def _bad(skip_bad: bool, skips: SkipLog, reason: str, where: str, detail: str) -> None:
    if not skip_bad:
        raise DataError(f"{where}: {reason}: {detail} ({skips.skip_option} to skip and "
                        f"count such records instead)")
    skips.skip(reason, where, detail)


def _check_text(text: object, where: str, text_field: str, record: object, skip_bad: bool,
                skips: SkipLog) -> str | None:
    if text is _MISSING:
        if isinstance(record, dict):
            detail = f"record has no field {text_field!r} (it has: {', '.join(sorted(record))})"
        else:
            detail = (f"record is a JSON {type(record).__name__}, not an object with field "
                      f"{text_field!r}")
        _bad(skip_bad, skips, "missing text field", where, detail)
        return None
    if not isinstance(text, str):
        _bad(skip_bad, skips, "text not a string", where,
             f"field {text_field!r} is {type(text).__name__}, not a string")
        return None
    if not text.strip():
        skips.skip("empty document", where)
        return None
    try:  # JSON escapes can smuggle in lone surrogates, which no tokenizer can encode
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _bad(skip_bad, skips, "invalid UTF-8", where,
             f"lone surrogate {text[exc.start]!r} at character {exc.start}")
        return None
    return text


_MISSING = object()


def _read_jsonl(shard: Shard, start: int, text_field: str, skip_bad: bool,
                skips: SkipLog, stride: int = 1, phase: int = 0) -> Iterator[tuple[int, str]]:
    offset, first = _seek_frame(shard, start) if shard.compression == "zst" else (0, 0)
    line_no = first
    try:
        for line_no, raw in enumerate(_iter_lines(shard, offset), start=first + 1):
            index = line_no - 1
            if index == 0 and raw.startswith(UTF8_BOM):  # the file's start: see the docstring
                raw = raw[len(UTF8_BOM):]
            if index < start or index % stride != phase or not raw.strip():
                continue
            where = f"{shard.path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                _bad(skip_bad, skips, "invalid UTF-8", where,
                     f"byte {exc.start} of the line ({raw[exc.start:exc.start + 4]!r})"
                     + _damage_hint(shard))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                # json's "Unexpected UTF-8 BOM (decode using utf-8-sig)" speaks to programmers
                bom = line.startswith("\ufeff")
                _bad(skip_bad, skips, "malformed JSON", where,
                     "a UTF-8 byte-order mark starts this line, not the file (files joined with "
                     "theirs?): save them without BOM" if bom else
                     f"{exc.msg}: column {exc.colno}{_damage_hint(shard)}")
                continue
            value = record.get(text_field, _MISSING) if isinstance(record, dict) else _MISSING
            text = _check_text(value, where, text_field, record, skip_bad, skips)
            if text is not None:
                yield index, text
    except (OSError, EOFError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{shard.path}: cannot read after line {line_no} "
                        f"({type(exc).__name__}: {exc}); corrupt or truncated file?"
                        f"{_damage_hint(shard)}") from None
    if line_no == 0:
        skips.skip("empty file", shard.path)


def _read_text_file(shard: Shard, skip_bad: bool, skips: SkipLog) -> Iterator[tuple[int, str]]:
    try:
        data = _read_all(shard)
    except (OSError, EOFError, ValueError) as exc:
        raise DataError(f"{shard.path}: cannot read ({type(exc).__name__}: {exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        _bad(skip_bad, skips, "invalid UTF-8", f"{shard.path}:{line}",
             f"byte offset {exc.start} ({data[exc.start:exc.start + 4]!r})")
        return
    if not data:
        skips.skip("empty file", shard.path)
        return
    checked = _check_text(text, f"{shard.path}:1", "text", None, skip_bad, skips)
    if checked is not None:
        yield 0, checked


def _read_parquet(shard: Shard, start: int, text_field: str, skip_bad: bool,
                  skips: SkipLog, stride: int = 1, phase: int = 0) -> Iterator[tuple[int, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(shard.path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses
        raise DataError(f"{shard.path}: not a readable Parquet file ({exc})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{shard.path}: Parquet file has no column {text_field!r} "
                        f"(columns: {', '.join(names)}); {skips.text_field_option}")
    if pf.metadata.num_rows == 0:
        skips.skip("empty file", shard.path)
        return
    row = 0
    for group in range(pf.num_row_groups):
        n_rows = pf.metadata.row_group(group).num_rows
        if row + n_rows <= start:  # whole row group before the resume point
            row += n_rows
            continue
        try:
            column = pf.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        except (OSError, pa.ArrowException) as exc:  # "Corrupt snappy compressed data": no path
            raise DataError(f"{shard.path}: cannot read row group {group} of "
                            f"{pf.num_row_groups} ({exc}); corrupt or truncated file?") from None
        for value in column:
            if row >= start and row % stride == phase:
                where = f"{shard.path}:row {row}"
                text = _check_text(value, where, text_field, {text_field: value}, skip_bad,
                                   skips)
                if text is not None:
                    yield row, text
            row += 1


_hub_opened = False
# The Arrow batch iterators of the Hub shards being read (``_read_hub``), closed at exit.
_hub_streams: "weakref.WeakSet" = weakref.WeakSet()
_RELEASE_WAIT_S = 30.0  # at exit, the longest wait for Arrow's threads to let go of files


@atexit.register  # registered on import, before the loader's prefetch stop: runs after it
def _end_hub_streams() -> None:
    """Close the Hub streams still open and wait until Arrow's threads have let go of the files
    they read, before the interpreter finalises. A Parquet stream of ``datasets`` reads a Python
    file object on Arrow's threads; the last reference to it is often dropped there, a moment
    after the stream ends or is closed. A thread that needs the GIL for that once finalisation
    has begun is ended by Python mid-C++ and aborts the process ("terminate called without an
    active exception", huggingface/datasets#7566): seen on a busy machine when a stream ended
    just before exit (a loader freed as the process returned), or when one was left to the
    interpreter's teardown (readers in reference cycles, loaders held to the end)."""
    if not _hub_opened:
        return
    for stream in list(_hub_streams):
        try:
            stream.close()
        except Exception:  # noqa: BLE001 - a stream already broken: nothing left to end
            pass
    gc.collect()
    held = _files_held_natively()
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while any(ref() is not None for ref in held) and time.monotonic() < deadline:
        time.sleep(0.01)  # without the GIL: the thread holding the file can drop it


def _files_held_natively() -> list:
    """Weak references to the closed file objects that no Python object refers to: what only
    native code (Arrow's threads) still holds."""
    closed = tuple(obj for obj in gc.get_objects() if _is_closed_file(obj))
    if not closed:
        return []
    ids = {id(obj) for obj in closed}
    # The call's own argument tuple is a referrer of every one of them on Python 3.13 (it is
    # tracked there): passed as `closed` itself, it is told apart from the real holders.
    referred = {id(ref) for holder in gc.get_referrers(*closed) if holder is not closed
                and not _is_the_same_tuple(holder, closed)
                for ref in gc.get_referents(holder) if id(ref) in ids}
    held = []
    for obj in closed:
        if id(obj) not in referred:
            try:
                held.append(weakref.ref(obj))
            except TypeError:  # cannot be watched: not waited for
                pass
    return held


def _is_the_same_tuple(holder, items: tuple) -> bool:
    """Whether ``holder`` is a tuple of exactly ``items`` (a copy of the argument tuple)."""
    return (type(holder) is tuple and len(holder) == len(items)
            and all(a is b for a, b in zip(holder, items)))


def _is_closed_file(obj) -> bool:
    try:  # _io._IOBase: every file object, io's and fsspec's (the type only: no attribute hooks)
        return issubclass(type(obj), _io._IOBase) and obj.closed is True
    except Exception:  # noqa: BLE001 - an object half torn down
        return False


def open_hub_dataset(source: SourceConfig):
    """``source.hub`` as a streaming ``IterableDataset``, and what identifies it:
    ``(dataset, facts)``; facts: ``builder``, ``revision`` (the Hub commit; None for local
    files), ``fingerprint`` (``datasets``' config id: configuration + data files), ``files``
    (the dataset's own shards) and ``fields``. Errors name the source's key (or flag)."""
    import datasets

    global _hub_opened
    _hub_opened = True
    try:  # what load_dataset(..., streaming=True) does, keeping the builder for its facts
        builder = datasets.load_dataset_builder(source.hub, source.config,
                                                data_files=source.data_files)
        ds = builder.as_streaming_dataset(split=source.split)
    except Exception as exc:  # network, missing dataset, bad config or split: user-facing
        offline = isinstance(exc, ConnectionError) or "Couldn't reach" in str(exc)
        files = "" if source.data_files is None else f", data_files={source.data_files!r}"
        # A builder that met no record (an empty data file) raises a bare StopIteration.
        why = str(exc)[:300] or ("no record to read: are the data files empty?"
                                 if isinstance(exc, StopIteration) else "")
        raise DataError(f"{source.field_key('hub')}: cannot open dataset {source.hub!r} "
                        f"(config={source.config!r}, split={source.split!r}{files}): "
                        f"{type(exc).__name__}: {why}"
                        + (_offline_hint(source) if offline else "")) from None
    fields = list(ds.features) if ds.features is not None else None
    if fields is not None and source.text_field not in fields:
        raise DataError(f"{source.field_key('text_field')}: dataset {source.hub!r} has no field "
                        f"{source.text_field!r} (its fields: {', '.join(fields)})")
    facts = {"builder": builder.name,
             "revision": builder.hash if getattr(builder, "repo_id", None) else None,
             "fingerprint": builder.config_id, "files": ds.n_shards, "fields": fields}
    return ds, facts


def _offline_hint(source: SourceConfig) -> str:
    """What to do when the Hub cannot be reached: with HF_HUB_OFFLINE already set, the cache
    simply lacks the dataset (suggesting the variable again would send the user in a circle)."""
    if source.field_key("hub").startswith("--"):  # `tape-data prepare --hub` itself
        prepare = ("run this prepare where the Hub is reachable and copy the prepared "
                   "directory here (`tape-data info DIR --verify` checks the copy)")
    else:
        prepare = ("prepare the corpus where the Hub is reachable (`tape-data prepare --hub`, "
                   "docs/data.md) and train from the prepared directory")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return (f". HF_HUB_OFFLINE is set and the Hugging Face cache holds no copy of "
                f"{source.hub!r} with this config and split: {prepare}, or fill the cache "
                f"where the Hub is reachable (same HF_HOME)")
    return (f". No connection to the Hub: {prepare}, or set HF_HUB_OFFLINE=1 to read what the "
            f"Hugging Face cache already holds")


def hub_shards(source: SourceConfig, min_shards: int = 1, row_groups: bool = True,
               dataset=None):
    """Shards of ``source.hub`` (opened unless ``dataset`` is given); returns (dataset, shards).

    With ``row_groups`` (the default) a Parquet stream is re-sharded with
    ``IterableDataset.reshard()`` into one shard per row group, so that resuming inside a
    shard re-reads at most one row group whatever the position. Formats ``reshard()`` cannot
    split (JSON) keep one shard per file. ``row_groups=False`` keeps file shards unless there
    are fewer than ``min_shards`` (the rule before row-group shards; states saved then still
    resume, see ``TrainLoader.load_state_dict``).
    """
    ds = dataset if dataset is not None else open_hub_dataset(source)[0]
    files = ds.n_shards
    if (row_groups or files < min_shards) and hasattr(ds, "reshard"):
        ds = ds.reshard()
        if ds.n_shards != files:
            log.info("data: %s: %d file(s) streamed as %d row-group shards", source.key, files,
                     ds.n_shards)
    n = max(1, ds.n_shards)
    label = f"hub:{source.hub}/{source.config or 'default'}/{source.split}"
    if source.data_files is not None:
        label += f"[{source.data_files}]"
    return ds, [Shard("hub", f"{label}#{i}", hub_index=i) for i in range(n)]


_HUB_BATCH = 1024  # rows per Arrow batch taken from a streamed Hub shard


def _read_hub(shard: Shard, ds, start: int, text_field: str, skip_bad: bool,
              skips: SkipLog, stride: int = 1, phase: int = 0) -> Iterator[tuple[int, str]]:
    """Records of one Hub shard, taken from Arrow batches: only the text of this rank's records
    from ``start`` on becomes Python; the rows before ``start`` are still streamed (a stream
    cannot seek), which row-group shards bound to one row group."""
    part = ds.shard(num_shards=max(1, ds.n_shards), index=shard.hub_index)
    if start:
        log.info("data: %s: resuming at record %d (the shard is streamed up to it)",
                 shard.path, start)
    index = 0
    tables = part.with_format("arrow").iter(batch_size=_HUB_BATCH)
    _hub_streams.add(tables)
    for table in tables:
        first = max(index, start)
        own = range(first + (phase - first) % stride, index + table.num_rows, stride)
        names = table.column_names
        if len(own) and text_field in names:
            values = table.column(text_field).take([i - index for i in own]).to_pylist()
        else:
            values = [_MISSING] * len(own)
        for i, value in zip(own, values):
            where = f"{shard.path}:record {i}"
            record = dict.fromkeys(names) if value is _MISSING else {text_field: value}
            text = _check_text(value, where, text_field, record, skip_bad, skips)
            if text is not None:
                yield i, text
        index += table.num_rows


def read_complete_manifest(out_dir: Path) -> dict | None:
    """The manifest of a complete prepared directory, or None (missing, corrupt, or a listed
    shard missing / of the wrong size)."""
    path = Path(out_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            return None
        for shard in manifest["shards"] + (manifest.get("tokens") or {}).get("shards", []):
            f = Path(out_dir) / shard["path"]
            if not f.is_file() or f.stat().st_size != shard["file_bytes"]:
                return None
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    return manifest
