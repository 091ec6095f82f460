"""Data configuration: the ``data:`` section of a run config.

Plain dataclasses, validated in ``__post_init__``; every error names the offending key as
``data.<field>`` (or ``data.sources[i].<field>``). File existence is checked later, when the
loader is built, so a default ``DataConfig()`` is always constructible.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from tape_train.hints import choice_error, finite_float, read_named_yaml, unknown_keys
from tape_train.resources import resource_dir

SHARDING_MODES = ("documents", "global")
DATA_FORMATS = ("text", "tokens")
# Packed blocks per block shuffle window (docs/data.md, "Order, shuffling and epochs").
BLOCK_SHUFFLE_WINDOW = 1024
DATA_CONFIG_DIR = resource_dir("configs/data")
# The `tape-data prepare` flag that sets each source field (errors name the flag).
CLI_FLAGS = {"path": "--input", "hub": "--hub", "config": "--hub-config", "split": "--split",
             "data_files": "--data-files", "text_field": "--text-field"}


class DataError(ValueError):
    """Bad input data or data configuration; the message names the file:line or key at fault."""


def _unknown_keys_error(where: str, unknown: list[str], known: set[str]) -> str:
    return (f"{where}: unknown key(s) {unknown_keys(unknown, known)}; known keys: "
            f"{', '.join(sorted(known))}")


@dataclass
class SourceConfig:
    """One corpus in the training mixture.

    Exactly one of ``path`` and ``hub`` is set.

    Attributes:
        path: local file, directory (searched recursively), glob, or a list of these. Supported
            files: ``.jsonl``/``.ndjson`` (optionally ``.gz``/``.zst``), ``.parquet``, and
            ``.txt``/``.md``/``.rst`` (optionally ``.gz``/``.zst``; one document per file). A
            directory holding ``manifest.json`` (written by ``tape-data prepare``) means its
            training shards; its held-out shards feed ``iter_eval_documents``.
        hub: a Hugging Face dataset name (or a local dataset directory) read with
            ``datasets.load_dataset(hub, config, split=split, streaming=True)``.
        config: dataset configuration name for ``hub`` (e.g. ``"en"`` for C4).
        split: dataset split for ``hub``.
        data_files: passed to ``load_dataset`` with ``hub`` — e.g. ``hub: json`` plus a glob
            streams local or remote files through any ``datasets`` builder (csv, arrow, ...).
        weight: relative probability that the next document of the mixture comes from this
            source (document-level sampling; need not sum to 1 over sources). With
            ``format: tokens``: the source's share of the training samples (blocks).
        text_field: record field holding the document text (JSONL, Parquet, Hub).
        name: label used in logs and the fingerprint; defaults to the path or hub name.
    """

    path: str | list[str] | None = None
    hub: str | None = None
    config: str | None = None
    split: str = "train"
    data_files: str | list[str] | None = None
    weight: float = 1.0
    text_field: str = "text"
    name: str | None = None
    key: str = field(default="data.sources[?]", repr=False, compare=False)

    def __post_init__(self) -> None:
        k = self.key
        if (self.path is None) == (self.hub is None):
            raise DataError(f"{k}: set exactly one of 'path' and 'hub' "
                            f"(got path={self.path!r}, hub={self.hub!r})")
        if self.path is not None:
            paths = [self.path] if isinstance(self.path, str) else self.path
            if not isinstance(paths, list) or not paths or not all(
                    isinstance(p, str) and p for p in paths):
                raise DataError(f"{k}.path must be a non-empty string or list of strings, "
                                f"got {self.path!r}")
            # A leading ~ is the home directory (no shell expands it in `key=~/x` or YAML).
            self.path = os.path.expanduser(self.path) if isinstance(self.path, str) \
                else [os.path.expanduser(p) for p in self.path]
        if self.hub is not None and (not isinstance(self.hub, str) or not self.hub):
            raise DataError(f"{k}.hub must be a non-empty string, got {self.hub!r}")
        if self.data_files is not None and self.hub is None:
            raise DataError(f"{k}.data_files needs 'hub' (a datasets builder such as json or "
                            f"parquet); for plain local files use 'path'")
        weight = finite_float(self.weight)
        if weight is None or not weight > 0:
            raise DataError(f"{k}.weight must be a finite number > 0, got {self.weight!r}")
        self.weight = weight
        if not isinstance(self.text_field, str) or not self.text_field:
            raise DataError(f"{k}.text_field must be a non-empty string, got {self.text_field!r}")
        if self.name is None:
            self.name = self.hub if self.hub is not None else (
                self.path if isinstance(self.path, str) else ",".join(self.path))

    def field_key(self, name: str) -> str:
        """How an error names field ``name``: ``data.sources[0].hub``; a source built from
        ``tape-data`` flags (its key is a flag, ``--input``/``--hub``) names the flag instead."""
        if self.key.startswith("--"):
            return CLI_FLAGS.get(name, self.key)
        return f"{self.key}.{name}"

    @property
    def paths(self) -> list[str]:
        if self.path is None:
            return []
        return [self.path] if isinstance(self.path, str) else list(self.path)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "key"}

    @classmethod
    def from_dict(cls, data: object, key: str) -> "SourceConfig":
        if isinstance(data, SourceConfig):
            return dataclasses.replace(data, key=key)
        if isinstance(data, str):  # shorthand: a bare path
            return cls(path=data, key=key)
        if not isinstance(data, dict):
            raise DataError(f"{key} must be a mapping like {{path: ..., weight: ...}}, "
                            f"got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"key"}
        data = {k: v for k, v in data.items() if k != "key"}  # dataclasses.asdict round trip
        unknown = sorted(set(data) - known)
        if unknown:
            raise DataError(_unknown_keys_error(key, unknown, known))
        return cls(**data, key=key)


# Where `tape-data prepare --demo` (and `make demo`) put the demo corpus: the default source.
DEMO_DIR = "data/demo"


def _default_sources() -> list[SourceConfig]:
    return [SourceConfig(path=DEMO_DIR, key="data.sources[0]")]


@dataclass
class DataConfig:
    """Where the training text comes from and how it becomes batches.

    Attributes:
        sources: the training mixture (list of ``SourceConfig`` or dicts; a bare string is a
            path). Relative paths resolve against the working directory; a leading ``~``
            is the home directory (expanded here, so the resolved config records it).
        tokenizer: path of a sentencepiece ``.model`` file.
        eval_sources: explicit held-out sources for ``iter_eval_documents`` (never trained on).
        eval_fraction: fraction of every training source's documents held out for evaluation,
            chosen by a hash of the document text (so duplicates land on the same side).
        eval_max_documents: cap on held-out documents yielded (``None``: all).
        eval_min_tokens: held-out documents with fewer tokens (BOS/EOS included) are skipped,
            so a long-context evaluation scores only documents that fill its longest window
            (``None``: keep all). Skipped documents do not count towards ``eval_max_documents``.
        shuffle: permute shard order per epoch and documents within windows.
        shuffle_buffer: documents per shuffle window; memory ≈ shuffle_buffer × mean document
            size. 1 keeps file order within shards.
        block_shuffle_window: packed blocks (``seq_len + 1`` tokens each) per block shuffle
            window: consecutive runs of this many blocks of the packed stream are each
            emitted in a seeded permutation, so that the rows of one batch are not consecutive
            windows of one long document. 1 emits blocks in packing order (off); so does
            ``shuffle: false``. Memory: two windows (the one emitted, the next one packed
            meanwhile) of block_shuffle_window × (seq_len + 1) × 2 bytes (4 with a
            vocabulary over 65 536); the first batch, and a resume, wait for one window to be
            tokenised.
        prefetch: batches produced ahead by a background thread (0: produce on demand).
        skip_bad_records: ``False`` raises on a malformed record (naming file:line); ``True``
            skips it, counts it and logs it. Empty documents are always skipped and counted.
        add_bos / add_eos: wrap every document in BOS ... EOS before packing.
        sharding: ``"documents"``: each data-parallel rank reads, tokenises and packs only its
            own share of every source (whole shards, or every k-th record of one shard when
            there are fewer shards than ranks; scales; a resume needs the same dp_size).
            ``"global"``: every rank tokenises the whole stream and takes packed blocks
            r, r+n, ...; the global token stream is independent of dp_size, so a run
            can resume on a different number of ranks (costs dp_size× tokenisation).
        format: ``"text"``: sources are text, tokenised while training (``sharding`` applies).
            ``"tokens"``: every source is a directory written by ``tape-data prepare
            --tokenize`` (or a list of them, concatenated); training reads fixed blocks of
            their token shards by a global sample index, several sources mixed by weight (one
            sequence for any number of ranks, O(1) resume; ``sharding``, ``shuffle_buffer``,
            ``block_shuffle_window`` and ``prefetch`` do not apply).
    """

    sources: list = field(default_factory=_default_sources)
    tokenizer: str = f"{DEMO_DIR}/tokenizer.model"
    eval_sources: list = field(default_factory=list)
    eval_fraction: float = 0.0
    eval_max_documents: int | None = None
    eval_min_tokens: int | None = None
    shuffle: bool = True
    shuffle_buffer: int = 1024
    block_shuffle_window: int = BLOCK_SHUFFLE_WINDOW
    prefetch: int = 4
    skip_bad_records: bool = False
    add_bos: bool = True
    add_eos: bool = True
    sharding: str = "documents"
    format: str = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.sources, list) or not self.sources:
            raise DataError(f"data.sources must be a non-empty list, got {self.sources!r}")
        self.sources = [SourceConfig.from_dict(s, f"data.sources[{i}]")
                        for i, s in enumerate(self.sources)]
        if not isinstance(self.eval_sources, list):
            raise DataError(f"data.eval_sources must be a list, got {self.eval_sources!r}")
        self.eval_sources = [SourceConfig.from_dict(s, f"data.eval_sources[{i}]")
                             for i, s in enumerate(self.eval_sources)]
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise DataError(f"data.tokenizer must be a path to a .model file, "
                            f"got {self.tokenizer!r}")
        self.tokenizer = os.path.expanduser(self.tokenizer)
        fraction = finite_float(self.eval_fraction)
        if fraction is None or not 0.0 <= fraction < 1.0:
            raise DataError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        self.eval_fraction = fraction
        if self.eval_max_documents is not None and not _positive_int(self.eval_max_documents):
            raise DataError(f"data.eval_max_documents must be a positive integer or null, "
                            f"got {self.eval_max_documents!r}")
        if self.eval_min_tokens is not None and not _positive_int(self.eval_min_tokens):
            raise DataError(f"data.eval_min_tokens must be a positive integer or null, "
                            f"got {self.eval_min_tokens!r}")
        if not _positive_int(self.shuffle_buffer):
            raise DataError(f"data.shuffle_buffer must be a positive integer, "
                            f"got {self.shuffle_buffer!r}")
        if not _positive_int(self.block_shuffle_window):
            raise DataError(f"data.block_shuffle_window must be a positive integer (blocks per "
                            f"window; 1: off), got {self.block_shuffle_window!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) \
                or self.prefetch < 0:
            raise DataError(f"data.prefetch must be an integer >= 0, got {self.prefetch!r}")
        for key in ("shuffle", "skip_bad_records", "add_bos", "add_eos"):
            if not isinstance(getattr(self, key), bool):
                raise DataError(f"data.{key} must be true or false, got {getattr(self, key)!r}")
        if self.sharding not in SHARDING_MODES:
            raise DataError(choice_error("data.sharding", self.sharding, SHARDING_MODES))
        if self.format not in DATA_FORMATS:
            raise DataError(choice_error("data.format", self.format, DATA_FORMATS))

    @property
    def block_window(self) -> int:
        """The block shuffle window in effect: ``block_shuffle_window``, or 1 without
        ``shuffle``."""
        return self.block_shuffle_window if self.shuffle else 1

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["sources"] = [s.to_dict() for s in self.sources]
        out["eval_sources"] = [s.to_dict() for s in self.eval_sources]
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str = "data config") -> "DataConfig":
        """Build from a plain mapping (a YAML ``data:`` section); unknown keys are errors that
        name ``source``, the key path and the closest known key."""
        if not isinstance(data, dict):
            raise DataError(f"{source}: the data section must be a mapping, "
                            f"got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DataError(f"{source}: " + _unknown_keys_error(
                "data", [u for u in unknown], known))
        try:
            return cls(**data)
        except DataError as exc:
            raise DataError(f"{source}: {exc}") from None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load_data_config(name_or_path: str, **overrides) -> DataConfig:
    """A named config from ``configs/data/<name>.yaml`` or a YAML file path, plus overrides."""
    path, data = read_named_yaml(name_or_path, DATA_CONFIG_DIR, "data", DataError)
    data.update(overrides)
    return DataConfig.from_dict(data, source=str(path))
