"""``tape-data``: prepare corpora as JSONL.zst shards + manifest.

    tape-data prepare --demo --out data/demo            # Debian demo corpus (needs apt)
    tape-data prepare --input docs/ more/*.jsonl --out data/mine
    tape-data prepare --input docs/ --out data/mine-tok --tokenize --tokenizer tok.model
    tape-data info data/demo                            # summary of a prepared directory

Re-running ``prepare`` with the same options on a complete directory does nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tape_train.data.config import DataError, SourceConfig
from tape_train.data.corpus import read_complete_manifest, write_corpus
from tape_train.data.formats import SkipLog, read_documents, resolve_local_shards

log = logging.getLogger("tape_train.data")


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tape-train" / "debian"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tape-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write JSONL.zst shards + manifest.json")
    what = prep.add_mutually_exclusive_group(required=True)
    what.add_argument("--demo", action="store_true",
                      help="build the demo corpus from Debian documentation packages")
    what.add_argument("--input", nargs="+", metavar="PATH",
                      help="local files, directories or globs (.jsonl[.gz|.zst], .parquet, "
                           ".txt/.md/.rst[.gz|.zst]; text files are one document each)")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--text-field", default="text", help="JSONL/Parquet field with the text")
    prep.add_argument("--num-shards", type=int, default=16,
                      help="training shards (a multiple of your data-parallel sizes; default 16)")
    prep.add_argument("--eval-fraction", type=float, default=0.01,
                      help="fraction of documents held out for evaluation (default 0.01)")
    prep.add_argument("--seed", type=int, default=0, help="seed of the shard shuffle")
    prep.add_argument("--cache-dir", type=Path, default=None,
                      help="where downloaded .deb files are kept "
                           "(default $XDG_CACHE_HOME/tape-train/debian)")
    prep.add_argument("--skip-bad-records", action="store_true",
                      help="skip (and count) malformed input records instead of failing")
    prep.add_argument("--tokenize", action="store_true",
                      help="also write token shards (uint16/uint32, np.memmap-able) for "
                           "data.format=tokens; needs --tokenizer")
    prep.add_argument("--tokenizer", default=None, metavar="MODEL",
                      help="sentencepiece .model used by --tokenize")
    prep.add_argument("--force", action="store_true", help="rebuild even if complete")
    info = sub.add_parser("info", help="summarise a prepared directory")
    info.add_argument("dir", type=Path)
    return parser


def _local_documents(inputs: list[str], text_field: str, skip_bad: bool) -> Iterator[dict]:
    source = SourceConfig(path=inputs, text_field=text_field, key="--input")
    skips = SkipLog()
    shards = resolve_local_shards(source)
    log.info("prepare: reading %d file(s)", len(shards))
    for i, shard in enumerate(shards):
        name = Path(shard.path).name
        for record, text in read_documents(shard, 0, text_field, skip_bad, skips):
            yield {"text": text, "source": name, "id": f"{name}:{record}"}
        if (i + 1) % 100 == 0:
            log.info("prepare: read %d/%d files", i + 1, len(shards))
    if skips.counts:
        log.warning("prepare: skipped records: %s", dict(skips.counts))


def _prepare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.demo:
        config = {"demo": True}
    else:
        config = {"inputs": list(args.input), "text_field": args.text_field}
    config.update(num_shards=args.num_shards, eval_fraction=args.eval_fraction, seed=args.seed)
    tokenizer = None
    if args.tokenize or args.tokenizer:
        if not (args.tokenize and args.tokenizer):
            raise DataError("--tokenize and --tokenizer MODEL go together")
        from tape_train.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        config.update(tokenizer_sha256=tokenizer.sha256)
    existing = read_complete_manifest(out)
    if existing is not None and existing.get("config") == config and not args.force:
        splits = existing["splits"]
        print(f"tape-data: {out} is already complete ({splits['train']['documents']} train / "
              f"{splits['eval']['documents']} eval documents); use --force to rebuild")
        return 0
    if args.demo:
        from tape_train.data import demo_corpus

        demo_corpus.require_apt()
        debs = demo_corpus.download_packages(demo_corpus.demo_packages(),
                                             args.cache_dir or _default_cache_dir())
        documents = demo_corpus.iter_demo_documents(debs)
        extra = {"packages": {name: version for name, (_, version) in debs.items()}}
    else:
        documents = _local_documents(args.input, args.text_field, args.skip_bad_records)
        extra = {}
    manifest = write_corpus(documents, out, num_shards=args.num_shards,
                            eval_fraction=args.eval_fraction, seed=args.seed, config=config,
                            extra=extra, tokenizer=tokenizer)
    _print_summary(out, manifest)
    return 0


def _print_summary(out: Path, manifest: dict) -> None:
    splits = manifest["splits"]
    print(f"tape-data: {out}: {splits['train']['documents']} train documents "
          f"({splits['train']['text_bytes'] / 1e6:.1f} MB) in {splits['train']['shards']} "
          f"shards, {splits['eval']['documents']} eval documents "
          f"({splits['eval']['text_bytes'] / 1e6:.1f} MB)")
    for name, stats in sorted(manifest["sources"].items()):
        print(f"  {name:32s} {stats['documents']:8d} docs {stats['text_bytes'] / 1e6:8.2f} MB")
    if manifest.get("tokens"):
        tokens = manifest["tokens"]
        print(f"  token shards: {tokens['total_tokens']} tokens ({tokens['dtype']}, tokenizer "
              f"{tokens['tokenizer']} sha256 {tokens['tokenizer_sha256'][:12]}…)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "prepare":
            return _prepare(args)
        manifest = read_complete_manifest(args.dir)
        if manifest is None:
            print(f"tape-data: {args.dir} is not a complete prepared directory "
                  f"(no valid manifest.json)", file=sys.stderr)
            return 1
        _print_summary(args.dir, manifest)
        print(json.dumps({k: manifest[k] for k in ("config", "held_out", "dropped")}, indent=1))
        return 0
    except DataError as exc:
        print(f"tape-data: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
