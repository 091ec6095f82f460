"""``tape-tokenizer``: train a sentencepiece tokenizer, or describe one.

    tape-tokenizer train --input data/demo --spec tokenizer/demo.yaml --out data/demo/tokenizer
    tape-tokenizer train --input 'corpus/*.jsonl.zst' --vocab-size 32000 --model-type unigram \\
        --max-bytes 2000000000 --out tokenizer/my32k
    tape-tokenizer info data/demo/tokenizer.model [--text "some text"]

Training reads one seeded pass over the inputs (the training split of a prepared directory),
cut into paragraphs, up to --max-bytes / --max-lines, and writes PREFIX.model, PREFIX.vocab and
PREFIX.training.json (the options and what was read). Special ids: pad=0 unk=1 bos=2 eos=3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tape_train.data.config import DataError, SourceConfig
from tape_train.data.formats import SkipLog
from tape_train.data.sources import SourceCursor
from tape_train.files import write_atomic
from tape_train.hints import empty_out_error, example_on_missing, read_yaml, utf8_error
from tape_train.progress import setup_cli_logging
from tape_train.data.tokenizer import (MODEL_TYPES, TokenizerError, TokenizerTrainSpec,
                                       load_tokenizer, train_tokenizer)
from tape_train.resources import named_file

log = logging.getLogger("tape_train.data")


def build_parser() -> argparse.ArgumentParser:
    spec = TokenizerTrainSpec()  # the defaults a flag and the --spec file leave unset
    parser = argparse.ArgumentParser(prog="tape-tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a sentencepiece model")
    train.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help="files, directories, globs or a prepared directory")
    train.add_argument("--out", required=True, help="output prefix (writes PREFIX.model)")
    train.add_argument("--spec", type=_spec_path,
                       help="YAML file of options, or a shipped spec's name (demo: "
                            "tokenizer/demo.yaml); flags given on the command line win")
    train.add_argument("--vocab-size", type=int,
                       help="pieces, special and byte pieces included (default: "
                            f"{spec.vocab_size})")
    train.add_argument("--model-type", choices=MODEL_TYPES, help=f"(default: {spec.model_type})")
    train.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=None,
                       help="encode unknown characters as UTF-8 bytes (default: "
                            f"{'on' if spec.byte_fallback else 'off'})")
    train.add_argument("--character-coverage", type=float,
                       help="fraction of characters the alphabet covers (default: "
                            f"{spec.character_coverage})")
    train.add_argument("--max-bytes", type=int,
                       help=f"stop reading after this many bytes (default: {spec.max_bytes})")
    train.add_argument("--max-lines", type=int,
                       help="stop after this many sentences (default: "
                            f"{spec.max_lines or 'no limit'})")
    train.add_argument("--text-field", default="text",
                       help="JSONL/Parquet field with the text (default: text)")
    train.add_argument("--seed", type=int,
                       help=f"seed of the input order and of training (default: {spec.seed})")
    train.add_argument("--num-threads", type=int,
                       help=f"training threads, 0 = all cores (default: {spec.num_threads})")
    train.add_argument("--skip-bad-records", action="store_true",
                       help="skip (and count) malformed input records instead of failing")
    info = sub.add_parser("info", help="vocabulary size and special ids of a .model file")
    info.add_argument("model", help="a sentencepiece .model file")
    info.add_argument("--text", help="also show how this text is tokenised")
    example_on_missing(parser, "tape-tokenizer train --input data/demo --spec demo "
                               "--out data/demo/tokenizer")
    example_on_missing(train, "tape-tokenizer train --input data/demo --spec demo "
                              "--out data/demo/tokenizer")
    example_on_missing(info, "tape-tokenizer info data/demo/tokenizer.model")
    return parser


def _spec_path(value: str) -> Path:
    return named_file(value, "tokenizer")


def _spec_from_args(args: argparse.Namespace) -> TokenizerTrainSpec:
    values: dict = {}
    if args.spec is not None:
        loaded = read_yaml(args.spec, DataError)[1] or {}
        if not isinstance(loaded, dict):
            raise DataError(f"--spec {args.spec}: must be a mapping of keys to values")
        known = {f.name for f in dataclasses.fields(TokenizerTrainSpec)}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise DataError(f"--spec {args.spec}: unknown key(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
        values.update(loaded)
    flags = {}
    for key in ("vocab_size", "model_type", "byte_fallback", "character_coverage", "max_bytes",
                "max_lines", "seed", "num_threads"):
        if getattr(args, key) is not None:
            flags[key] = getattr(args, key)
    try:
        return TokenizerTrainSpec(**{**values, **flags})
    except TokenizerError as exc:  # a bad value the spec file gave: name the file
        from_spec = [k for k in values
                     if k not in flags and re.search(rf"^tokenizer {k}\b", str(exc))]
        if from_spec:
            raise TokenizerError(f"--spec {args.spec}: {exc}") from None
        raise


def one_pass_documents(inputs: list[str], text_field: str, seed: int,
                       skip_bad: bool) -> Iterator[str]:
    """One seeded pass (shard order shuffled, 1024-document windows shuffled) over inputs.
    The inputs are resolved here, before training starts: a missing or empty input is a
    ``DataError`` naming ``--input`` now, not from inside sentencepiece's first read."""
    cursor = SourceCursor(SourceConfig(path=inputs, text_field=text_field, key="--input"),
                          index=0, seed=seed, shuffle=True, window_size=1024,
                          eval_fraction=0.0, skip_bad=skip_bad, skips=SkipLog(flags=True))
    return _one_pass(cursor)


def _one_pass(cursor: SourceCursor) -> Iterator[str]:
    while True:
        text = cursor.next_document()
        if cursor.epoch > 0:
            return
        yield text


def _train(args: argparse.Namespace) -> int:
    problem = empty_out_error(args.out, "name the output prefix, e.g. --out data/mine/tokenizer "
                                        "(writes data/mine/tokenizer.model)")
    if problem:  # it would write .model, .vocab and .training.json here
        raise DataError(problem)
    spec = _spec_from_args(args)
    documents = one_pass_documents(args.input, args.text_field, spec.seed,
                                   args.skip_bad_records)
    log.info("tokenizer: training %s vocab=%d on %s", spec.model_type, spec.vocab_size,
             " ".join(args.input))
    tok = train_tokenizer(documents, args.out, spec)
    record = {"spec": dataclasses.asdict(spec), "inputs": list(args.input),
              "text_field": args.text_field, "read": tok.training_stats,
              "special_ids": {"pad": tok.pad_id, "unk": tok.unk_id, "bos": tok.bos_id,
                              "eos": tok.eos_id},
              "vocab_size": tok.vocab_size, "sha256": tok.sha256}
    write_atomic(f"{args.out}.training.json", json.dumps(record, indent=1) + "\n")
    print(f"tape-tokenizer: wrote {args.out}.model (vocab {tok.vocab_size}, "
          f"pad={tok.pad_id} unk={tok.unk_id} bos={tok.bos_id} eos={tok.eos_id}; "
          f"read {tok.training_stats['documents']} documents, "
          f"{tok.training_stats['bytes'] / 1e6:.1f} MB)")
    return 0


def _info(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.model)
    print(f"model:      {tok.path}")
    print(f"sha256:     {tok.sha256}")
    print(f"vocab_size: {tok.vocab_size}")
    for name in ("pad", "unk", "bos", "eos"):
        token_id = getattr(tok, f"{name}_id")
        print(f"{name + '_id:':11s} {token_id:<6d} {tok.id_to_piece(token_id)!r}")
    if args.text is not None:
        problem = utf8_error("--text", args.text)
        if problem:  # bytes of another encoding in argv
            raise DataError(problem)
        ids = tok.encode(args.text)
        print(f"text:       {args.text!r}")
        print(f"ids:        {ids}")
        print(f"pieces:     {[tok.id_to_piece(i) for i in ids]}")
        print(f"round trip: {tok.decode(ids) == args.text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_cli_logging()
    try:
        return _train(args) if args.command == "train" else _info(args)
    except DataError as exc:
        print(f"tape-tokenizer: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. --out names an existing file, a full disk, no permission
        from tape_train.files import describe_os_error

        print(f"tape-tokenizer: error: {describe_os_error(exc, exc.filename or getattr(args, 'out', ''))}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
