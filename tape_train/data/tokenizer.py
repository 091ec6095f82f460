"""Sentencepiece tokenizers: load any ``.model`` file, train our own with fixed special ids.

Special ids of tokenizers trained here (``SPECIAL_IDS``): PAD=0, UNK=1, BOS=2, EOS=3. PAD is 0
so zero-filled buffers are padding. A foreign model (e.g. Llama's: UNK=0, BOS=1, EOS=2, no PAD)
keeps its own ids; when it defines no PAD, ``pad_id`` falls back to ``unk_id`` (packing never
pads, so PAD only matters to code that pads for evaluation and masks those positions).

Tokenizers trained here use identity normalisation and keep whitespace, so
``decode(encode(text)) == text`` for any text whose characters are covered or byte-encodable
(``byte_fallback``): indentation in code and documentation survives. The exception is
U+2581 ``▁``, sentencepiece's mark for a space: it encodes and decodes as a space.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from tape_train.data.config import DataError
from tape_train.files import write_atomic
from tape_train.hints import seed_error
from tape_train.machine_cache import usable_cpus

log = logging.getLogger("tape_train.data")

SPECIAL_IDS = {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
MODEL_TYPES = ("bpe", "unigram")
# Sentencepiece rejects longer training "sentences"; we cut paragraphs into pieces this long.
MAX_SENTENCE_BYTES = 8192


class TokenizerError(DataError):
    """A tokenizer file is missing, unreadable or inconsistent."""


class Tokenizer:
    """A loaded sentencepiece model with the interface the pipeline and trainer use.

    ``encode(str) -> list[int]`` adds no BOS/EOS (the packer does that per document).
    """

    def __init__(self, processor: spm.SentencePieceProcessor, path: str, sha256: str):
        self._sp = processor
        self.path = path
        self.sha256 = sha256
        self.vocab_size: int = processor.get_piece_size()
        self.unk_id: int = processor.unk_id()
        self.bos_id: int = processor.bos_id()
        self.eos_id: int = processor.eos_id()
        pad = processor.pad_id()
        self.pad_id: int = pad if pad >= 0 else self.unk_id
        if self.bos_id < 0 or self.eos_id < 0:
            raise TokenizerError(f"tokenizer {path}: the model defines no BOS or EOS piece "
                                 f"(bos_id={self.bos_id}, eos_id={self.eos_id}); documents "
                                 f"cannot be delimited")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_with_byte_ends(self, text: str) -> tuple[list[int], list[int]]:
        """``encode(text)`` and, per token, the UTF-8 byte offset in ``text`` where the text it
        covers ends (sentencepiece's own alignment to the input: the dummy-prefix piece covers
        nothing; of the byte pieces of one character, the last ends after it). For bits per
        byte of exactly the scored text (tape_train.eval)."""
        pieces = self._sp.encode(text, out_type="proto").pieces
        return [piece.id for piece in pieces], [piece.end for piece in pieces]

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """``[encode(t) for t in texts]``, on ``num_threads`` of sentencepiece's threads (the
        result does not depend on the thread count)."""
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))

    def decode_continuation(self, context: Iterable[int], ids: Iterable[int]) -> str:
        """The text ``ids`` add after the text of ``context``: ``decode(context + ids)`` less
        ``decode(context)``. ``decode(ids)`` alone would take the space that starts their
        first piece ("Hello" then ``▁world``) for a text's dummy prefix and drop it.

        Only the end of ``context`` is decoded (:meth:`context_tail`), so a streamed
        continuation costs the same per token after a prompt of any length."""
        context, ids = list(context), list(ids)
        for head in (self.context_tail(context), context):
            before = self._sp.decode(head)
            text = self._sp.decode(head + ids)
            if text.startswith(before):
                return text[len(before):]
        # not seen: context ends a valid character
        raise ValueError(f"decoding {len(context)} context ids changed their text")

    def context_tail(self, context: list[int], keep: int = 8) -> list[int]:
        """The last ids of ``context`` whose text decides how ids after them decode: at least
        ``keep`` of them, from a piece that is neither a byte piece (a character spelt in bytes
        is not cut) nor a control or unknown piece (the first piece that shows text is the one
        whose leading space a decode drops, in the tail as in the whole)."""
        start = max(0, len(context) - keep)
        while start > 0 and self._is_special(context[start]):
            start -= 1
        return context[start:]

    def _is_special(self, token_id: int) -> bool:
        sp = self._sp
        return (sp.IsByte(token_id) or sp.IsControl(token_id) or sp.IsUnknown(token_id)
                or sp.IsUnused(token_id))

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, pad={self.pad_id}, "
                f"unk={self.unk_id}, bos={self.bos_id}, eos={self.eos_id})")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a sentencepiece ``.model`` file; errors name the path and what is wrong."""
    path = str(path)
    try:
        blob = Path(path).read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer {path}: no such file (train one with "
                             f"`tape-tokenizer train`, see docs/data.md)") from None
    except OSError as exc:
        raise TokenizerError(f"tokenizer {path}: cannot read: {exc}") from None
    if not blob:
        raise TokenizerError(f"tokenizer {path}: file is empty")
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(blob)
    except Exception as exc:  # sentencepiece raises RuntimeError/OSError with C++ text
        raise TokenizerError(f"tokenizer {path}: not a valid sentencepiece model "
                             f"({type(exc).__name__}: {str(exc).strip()[:200]})") from None
    if processor.get_piece_size() <= 0:
        raise TokenizerError(f"tokenizer {path}: the model has an empty vocabulary")
    return Tokenizer(processor, path, hashlib.sha256(blob).hexdigest())


def load_model_tokenizer(path: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """``load_tokenizer`` for a model with ``vocab_size`` embeddings: a tokenizer with more
    pieces (ids the embedding cannot index) is a ``TokenizerError``."""
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerError(f"tokenizer {path} has {tokenizer.vocab_size} tokens but the "
                             f"model's vocabulary is {vocab_size}: wrong tokenizer?")
    return tokenizer


@dataclass
class TokenizerTrainSpec:
    """Options of ``train_tokenizer`` (also the keys of ``tokenizer/*.yaml`` specs)."""

    vocab_size: int = 8000
    model_type: str = "bpe"
    byte_fallback: bool = True
    character_coverage: float = 0.9995
    max_bytes: int | None = 200_000_000
    max_lines: int | None = None
    num_threads: int = 0  # 0: all cores
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size < len(SPECIAL_IDS) + 1:
            raise TokenizerError(f"tokenizer vocab_size must be an integer > "
                                 f"{len(SPECIAL_IDS)}, got {self.vocab_size!r}")
        if self.model_type not in MODEL_TYPES:
            raise TokenizerError(f"tokenizer model_type={self.model_type!r} is not one of "
                                 f"{', '.join(MODEL_TYPES)}")
        if not 0.0 < float(self.character_coverage) <= 1.0:
            raise TokenizerError(f"tokenizer character_coverage must be in (0, 1], "
                                 f"got {self.character_coverage!r}")
        for key in ("max_bytes", "max_lines"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise TokenizerError(f"tokenizer {key} must be a positive integer or null, "
                                     f"got {value!r}")
        if not isinstance(self.num_threads, int) or not 0 <= self.num_threads <= 1024:
            raise TokenizerError(f"tokenizer num_threads must be an integer from 0 (all cores) "
                                 f"to 1024 (sentencepiece's limit), got {self.num_threads!r}")
        problem = (seed_error("tokenizer seed", self.seed) if isinstance(self.seed, int)
                   else f"tokenizer seed must be an integer, got {self.seed!r}")
        if problem:
            raise TokenizerError(problem)


def training_sentences(documents: Iterable[str], spec: TokenizerTrainSpec,
                       stats: dict) -> Iterator[str]:
    """Cut documents into sentencepiece training "sentences" (paragraphs, ≤ MAX_SENTENCE_BYTES),
    stopping at ``spec.max_bytes`` / ``spec.max_lines``; fills ``stats`` as it goes and logs
    progress every 5 s."""
    stats.update(documents=0, sentences=0, bytes=0)
    last_log = time.monotonic()
    try:
        yield from _sentences(documents, spec, stats, last_log)
    finally:  # sentencepiece builds the vocabulary after reading: say so, it can take minutes
        log.info("tokenizer: read %d documents, %d sentences, %.1f MB; building the "
                 "vocabulary", stats["documents"], stats["sentences"], stats["bytes"] / 1e6)


def _sentences(documents: Iterable[str], spec: TokenizerTrainSpec, stats: dict,
               last_log: float) -> Iterator[str]:
    for doc in documents:
        stats["documents"] += 1
        for paragraph in doc.split("\n\n"):
            if not paragraph.strip():
                continue
            for piece in _utf8_cuts(paragraph.encode("utf-8", "replace"), MAX_SENTENCE_BYTES):
                yield piece
                stats["sentences"] += 1
                stats["bytes"] += len(piece.encode("utf-8"))
                if spec.max_lines is not None and stats["sentences"] >= spec.max_lines:
                    return
                if spec.max_bytes is not None and stats["bytes"] >= spec.max_bytes:
                    return
        if time.monotonic() - last_log > 5.0:
            last_log = time.monotonic()
            log.info("tokenizer: read %d documents, %d sentences, %.1f MB",
                     stats["documents"], stats["sentences"], stats["bytes"] / 1e6)


def _utf8_cuts(data: bytes, limit: int) -> Iterator[str]:
    """``data`` (valid UTF-8) as texts of at most ``limit`` bytes, cut between characters (a
    cut inside one would drop its bytes)."""
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte
            end -= 1
        yield data[start:end].decode("utf-8")
        start = end


def _vocabulary_problem(message: str, spec: TokenizerTrainSpec, read: str) -> str | None:
    """sentencepiece's refusals of the vocabulary size (C++ check text) as one line naming
    the option and the bound it reports; None for any other failure."""
    high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)",
                     message)
    if high:
        return (f"tokenizer vocab_size {spec.vocab_size} is more pieces than the text read "
                f"({read}) yields: at most {high.group(2)}; lower vocab_size (--vocab-size) "
                f"or give it more text (--max-bytes, more --input)")
    low = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if low:
        return (f"tokenizer vocab_size {spec.vocab_size} is smaller than the {low.group(2)} "
                f"pieces that the alphabet plus the special and byte pieces need (character_coverage "
                f"{spec.character_coverage}, text read: {read}); raise vocab_size "
                f"(--vocab-size) or lower character_coverage (--character-coverage)")
    return None


def train_tokenizer(documents: Iterable[str], out_prefix: str | os.PathLike,
                    spec: TokenizerTrainSpec) -> Tokenizer:
    """Train a sentencepiece model on ``documents``; writes ``<out_prefix>.model`` and
    ``<out_prefix>.vocab`` (one ``repr(piece)<TAB>score`` line per id) atomically (temp name,
    then rename) and returns the loaded tokenizer."""
    out_prefix = Path(out_prefix)
    stats: dict = {}
    spm.set_random_generator_seed(spec.seed)
    started = time.monotonic()
    # model_writer rather than model_prefix: the proto then records no output path, so the
    # same inputs and options give a byte-identical model wherever it is written.
    writer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_sentences(documents, spec, stats),
            model_writer=writer,
            vocab_size=spec.vocab_size,
            model_type=spec.model_type,
            byte_fallback=spec.byte_fallback,
            character_coverage=spec.character_coverage,
            pad_id=SPECIAL_IDS["pad"], unk_id=SPECIAL_IDS["unk"],
            bos_id=SPECIAL_IDS["bos"], eos_id=SPECIAL_IDS["eos"],
            pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
            # Identity normalisation and kept whitespace: decode(encode(x)) == x.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=MAX_SENTENCE_BYTES * 2,
            shuffle_input_sentence=False,  # our sampling is already deterministic
            num_threads=spec.num_threads or usable_cpus(),
            minloglevel=1,
        )
    except RuntimeError as exc:
        read = f"{stats.get('sentences', 0)} sentences, {stats.get('bytes', 0) / 1e6:.1f} MB"
        raise TokenizerError(_vocabulary_problem(str(exc), spec, read) or (
            f"tokenizer training failed after {read}: {str(exc).strip()[:300]}")) from None
    if not stats.get("sentences"):
        raise TokenizerError("tokenizer training got no text (all inputs empty?)")
    processor = spm.SentencePieceProcessor(model_proto=writer.getvalue())
    vocab = "".join(f"{processor.id_to_piece(i)!r}\t{processor.get_score(i):g}\n"
                    for i in range(processor.get_piece_size()))
    # Only now: a run that fails (a missing input, a vocabulary the text cannot fill) leaves
    # no new empty directory behind, which would also hide the missing input on a re-run.
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(f"{out_prefix}.vocab"), vocab.encode("utf-8"))
    write_atomic(Path(f"{out_prefix}.model"), writer.getvalue())
    log.info("tokenizer: trained %s vocab=%d on %d documents (%.1f MB) in %.1f s -> %s.model",
             spec.model_type, spec.vocab_size, stats["documents"], stats["bytes"] / 1e6,
             time.monotonic() - started, out_prefix)
    tok = load_tokenizer(f"{out_prefix}.model")
    tok.training_stats = dict(stats)
    return tok


