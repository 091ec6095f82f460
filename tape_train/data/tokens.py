"""Pre-tokenised corpora: token shards written by ``tape-data prepare --tokenize``.

Next to each training text shard ``train-0000i-of-0000n.jsonl.zst`` a prepared directory then
holds ``train-0000i-of-0000n.tokens``: the same documents in the same order, each as
``[BOS] ids [EOS]``, concatenated into one flat little-endian array of ``uint16`` (vocabulary
≤ 65 536) or ``uint32`` — readable with ``np.memmap(path, dtype, mode="r")``. The manifest's
``tokens`` section is the index: per shard its token and document counts, file size and
sha256, plus the dtype, the tokenizer's sha256 and the BOS/EOS convention.

The training view of one source (``TokenBlocks``) concatenates the shards of its prepared
directories in manifest order into one stream of ``T`` tokens, cut into ``N = T // block_len``
fixed blocks (the last ``T mod block_len`` tokens are never used). The source's sample ``j``
is block ``perm_e(j mod N)`` of its epoch ``e = j // N``, where ``perm_e`` is a keyed
bijection of ``[0, N)`` (``feistel_permutation``) evaluated per index — no per-epoch array, so
a corpus of any size costs O(1) memory and any sample index is reachable in O(1).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from tape_train.data.config import DataError
from tape_train.data.formats import MANIFEST_NAME

TOKENS_SUFFIX = ".tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size ≤ 65 536), else ``uint32`` (little-endian)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class TokenShardWriter:
    """Appends wrapped documents to ``n`` token shard files (one per text shard), tracking
    counts and a running sha256 per shard. ``names[i]`` pairs with text shard ``i``.

    ``state`` (a ``checkpoint()``) continues files already cut back to that checkpoint: their
    running sha256 is rebuilt by reading what they hold (a hash object cannot be saved)."""

    def __init__(self, directory: Path, text_names: list[str], tokenizer,
                 add_bos: bool = True, add_eos: bool = True, state: dict | None = None):
        self.tokenizer = tokenizer
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.add_bos, self.add_eos = add_bos, add_eos
        self.names = [name.split(".", 1)[0] + TOKENS_SUFFIX for name in text_names]
        self.files = [open(directory / name, "r+b" if state else "wb") for name in self.names]
        self.hashes = [hashlib.sha256() for _ in self.names]
        self.tokens = list(state["tokens"]) if state else [0] * len(self.names)
        self.documents = list(state["documents"]) if state else [0] * len(self.names)
        for f, running in zip(self.files, self.hashes if state else []):
            while chunk := f.read(8 << 20):  # leaves the file at its end, where writing goes on
                running.update(chunk)

    def write(self, shard: int, ids: list[int]) -> None:
        """Append one document: ``ids`` is its text's ``tokenizer.encode`` (BOS/EOS are added
        here, possibly to that very list)."""
        if self.add_bos:
            ids = [self.tokenizer.bos_id] + ids
        if self.add_eos:
            ids.append(self.tokenizer.eos_id)
        data = np.asarray(ids, dtype=self.dtype).tobytes()
        self.files[shard].write(data)
        self.hashes[shard].update(data)
        self.tokens[shard] += len(ids)
        self.documents[shard] += 1

    def checkpoint(self) -> dict:
        """What continues the token shards from here (their sizes follow from ``tokens``)."""
        return {"tokens": list(self.tokens), "documents": list(self.documents)}

    def abandon(self) -> None:
        for f in self.files:
            f.close()

    def close(self) -> dict:
        """Close the files; returns the manifest's ``tokens`` section."""
        for f in self.files:
            f.close()
        return {
            "dtype": self.dtype.str,
            "vocab_size": self.tokenizer.vocab_size,
            "tokenizer_sha256": self.tokenizer.sha256,
            "tokenizer": Path(self.tokenizer.path).name,
            "add_bos": self.add_bos, "add_eos": self.add_eos,
            "total_tokens": sum(self.tokens),
            "shards": [{"path": name, "tokens": self.tokens[i], "documents": self.documents[i],
                        "file_bytes": self.tokens[i] * self.dtype.itemsize,
                        "sha256": self.hashes[i].hexdigest()}
                       for i, name in enumerate(self.names)],
        }


def read_token_manifest(directory: Path, key: str) -> dict:
    """The ``tokens`` section of a complete prepared directory; ``DataError`` naming ``key``
    and the directory if it is not one (not prepared, incomplete, not tokenised)."""
    from tape_train.data.formats import read_complete_manifest

    manifest = read_complete_manifest(directory)
    if manifest is None:
        from tape_train.data.prepare_scratch import unfinished_prepare_note

        raise DataError(f"{key}: {directory} is not a complete prepared directory (no valid "
                        f"{MANIFEST_NAME}, or a listed shard is missing or has the wrong size); "
                        f"run `tape-data prepare --tokenize`{unfinished_prepare_note(directory)}")
    tokens = manifest.get("tokens")
    if not tokens:
        raise DataError(f"{key}: {directory} was prepared without --tokenize (no token shards); "
                        f"re-run `tape-data prepare ... --tokenize --tokenizer MODEL`, or use "
                        f"data.format=text")
    _check_token_index(tokens, Path(directory) / MANIFEST_NAME, key)
    for shard in tokens["shards"]:
        path = Path(directory) / shard["path"]
        if not path.is_file() or path.stat().st_size != shard["file_bytes"]:
            raise DataError(f"{directory / MANIFEST_NAME}: token shard {shard['path']!r} is "
                            f"missing or not {shard['file_bytes']} bytes; re-run `tape-data "
                            f"prepare --tokenize`")
    return tokens


def _check_token_index(tokens: dict, manifest: Path, key: str) -> None:
    """The ``tokens`` section agrees with itself as ``TokenShardWriter.close`` writes it: a
    dtype it writes, wide enough for the vocabulary, and per shard ``tokens × itemsize ==
    file_bytes`` (else blocks would be cut at the wrong offsets or ids misread). A manifest
    edited by hand or damaged is a ``DataError`` naming the manifest and the entry."""
    fix = "re-run `tape-data prepare --tokenize` (the manifest was edited or damaged)"
    where = f"{key}: {manifest}"
    dtype, vocab = tokens.get("dtype"), tokens.get("vocab_size")
    if dtype not in ("<u2", "<u4"):
        raise DataError(f"{where}: tokens.dtype {dtype!r} is not a token dtype `tape-data "
                        f"prepare` writes ('<u2' or '<u4'); {fix}")
    if not isinstance(vocab, int) or isinstance(vocab, bool) \
            or np.dtype(dtype) != token_dtype(max(vocab, 1)):
        raise DataError(f"{where}: tokens.vocab_size {vocab!r} does not go with tokens.dtype "
                        f"{dtype!r}; {fix}")
    itemsize = np.dtype(dtype).itemsize
    for i, shard in enumerate(tokens.get("shards") or []):
        count, size = shard.get("tokens"), shard.get("file_bytes")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (count, size)) or count * itemsize != size:
            raise DataError(f"{where}: tokens.shards[{i}] ({shard.get('path')!r}) lists "
                            f"{count!r} tokens of {itemsize} bytes but file_bytes {size!r}; "
                            f"{fix}")


_M64 = (1 << 64) - 1


def _mix(x: int, key: int) -> int:
    """splitmix64 finaliser of ``x ^ key`` on Python ints (mod 2^64)."""
    z = ((x ^ key) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=64)
def _round_keys(key: tuple, rounds: int) -> tuple[int, ...]:
    return tuple(int(k) for k in np.random.default_rng([*key, 0xFE15]).integers(
        0, 2**63, size=rounds, dtype=np.int64))


def feistel_permutation(index, n: int, key: list[int], rounds: int = 6) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` applied to ``index`` (ints), in O(len(index)).

    A balanced Feistel network on the smallest even bit width ``2h`` with ``2^(2h) ≥ n``,
    cycle-walking values that land outside ``[0, n)`` (expected < 4 steps since
    ``2^(2h) < 4n``). Different keys give independent-looking permutations. Plain Python
    integers: a batch needs a few dozen rounds, where numpy's per-call overhead would dominate.
    """
    values = [int(i) for i in np.asarray(index).reshape(-1)]
    if n <= 1:
        return np.zeros(len(values), dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    low = (1 << half) - 1
    keys = _round_keys(tuple(int(k) for k in key), rounds)
    out = []
    for x in values:
        if not 0 <= x < n:
            raise ValueError(f"feistel_permutation: index {x} outside [0, {n})")
        while True:
            left, right = x >> half, x & low
            for k in keys:
                left, right = right, left ^ (_mix(right, k) & low)
            x = (left << half) | right
            if x < n:
                break
        out.append(x)
    return np.asarray(out, dtype=np.int64)


class TokenBlocks:
    """Fixed ``block_len``-token blocks over the concatenated token shards of ``directories``
    (one source; ``name`` is its config key in errors).

    Reads with ``os.pread`` (each block is one or two reads of ``block_len × itemsize``
    bytes), so the I/O is exactly the blocks delivered.
    """

    def __init__(self, directories: list[tuple[Path, str]], block_len: int,
                 name: str = "data.sources"):
        self.block_len = block_len
        self.manifests = [read_token_manifest(Path(d), key) for d, key in directories]
        dtypes = {m["dtype"] for m in self.manifests}
        if len(dtypes) != 1:
            raise DataError(f"{name}: token shards of different dtypes {sorted(dtypes)} "
                            f"(tokenised with different vocabularies?)")
        self.dtype = np.dtype(dtypes.pop())
        self.paths: list[Path] = []
        counts = []
        for (directory, _), manifest in zip(directories, self.manifests):
            for shard in manifest["shards"]:
                self.paths.append(Path(directory) / shard["path"])
                counts.append(int(shard["tokens"]))
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.total_tokens = int(self.starts[-1])
        self.num_blocks = self.total_tokens // block_len
        if self.num_blocks == 0:
            raise DataError(f"{name}: the token corpus has {self.total_tokens} tokens, "
                            f"fewer than one block of seq_len + 1 = {block_len}")
        self._fds: dict[int, int] = {}

    def _fd(self, shard: int) -> int:
        if shard not in self._fds:
            self._fds[shard] = os.open(self.paths[shard], os.O_RDONLY)
        return self._fds[shard]

    def read(self, block: int) -> np.ndarray:
        """Tokens ``[block × L, (block + 1) × L)`` of the concatenated stream, as int64."""
        begin, end = block * self.block_len, (block + 1) * self.block_len
        parts = []
        shard = int(np.searchsorted(self.starts, begin, side="right")) - 1
        while begin < end:
            stop = min(end, int(self.starts[shard + 1]))
            offset = (begin - int(self.starts[shard])) * self.dtype.itemsize
            nbytes = (stop - begin) * self.dtype.itemsize
            data = os.pread(self._fd(shard), nbytes, offset)
            if len(data) != nbytes:
                raise DataError(f"{self.paths[shard]}: short read ({len(data)} of {nbytes} "
                                f"bytes at offset {offset}); file truncated since prepare?")
            parts.append(np.frombuffer(data, dtype=self.dtype))
            begin, shard = stop, shard + 1
        return np.concatenate(parts).astype(np.int64)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
