"""``tape-data``: prepare corpora as JSONL.zst shards + manifest.

    tape-data prepare --demo --out data/demo            # demo corpus: Debian's docs via apt,
                                                        # else this Python's stdlib
    tape-data prepare --input docs/ more/*.jsonl --out data/mine
    tape-data prepare --input docs/ --out data/mine-tok --tokenize --tokenizer tok.model
    tape-data prepare --hub HuggingFaceFW/fineweb-edu --hub-config sample-10BT --out data/fw \\
        --num-shards 256 --tokenize --tokenizer tok.model   # stream a Hub dataset once
    tape-data info data/demo                            # summary of a prepared directory
    tape-data info data/demo --verify                   # every shard's size and sha256

Re-running ``prepare`` with the same options on a complete directory does nothing; on an
interrupted one it resumes from its last checkpoint (``--fresh`` starts over). Ctrl-C and
SIGTERM stop it alike: the log names the checkpoint to resume from, exit 130.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tape_train.data import demo_sources
from tape_train.data.config import DataError, SourceConfig
from tape_train.data.corpus import (SHUFFLE_BYTES, DocumentSource, read_complete_manifest,
                                    write_corpus)
from tape_train.data.formats import (MANIFEST_NAME, SkipLog, hub_shards, open_hub_dataset,
                                     read_documents, resolve_local_shards)
from tape_train.data.demo_sources import DEMO_SOURCES
from tape_train.data.prepare_scratch import interrupted_scratch, remove_finished_scratch
from tape_train.hints import empty_out_error, example_on_missing, seed_error
from tape_train.machine_cache import cache_dir, usable_cpus
from tape_train.progress import MODES, progress_bar, setup_cli_logging

log = logging.getLogger("tape_train.data")
EVAL_FRACTION = 0.01  # --eval-fraction's default (demo_sources.EVAL_FRACTION: the stdlib's)


def _default_cache_dir() -> Path:
    """Where ``prepare --demo`` keeps its .deb files: ``debian/`` in the project's cache."""
    return cache_dir() / "debian"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tape-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write JSONL.zst shards + manifest.json")
    what = prep.add_mutually_exclusive_group(required=True)
    what.add_argument("--demo", action="store_true",
                      help="build the demo corpus (--demo-source: Debian's documentation "
                           "packages, or this Python's standard library)")
    what.add_argument("--input", nargs="+", metavar="PATH",
                      help="local files, directories or globs (.jsonl[.gz|.zst], .parquet, "
                           ".txt/.md/.rst[.gz|.zst]; text files are one document each)")
    what.add_argument("--hub", metavar="NAME",
                      help="a Hugging Face Hub dataset (or a local dataset directory, or a "
                           "datasets builder such as json/parquet with --data-files), streamed "
                           "once with datasets")
    prep.add_argument("--demo-source", choices=DEMO_SOURCES, default=None,
                      help="--demo: debian (documentation packages fetched with apt-get; an "
                           "error without apt), python (docstrings and pydoc topics of the "
                           "running Python's standard library: no apt, no network), or auto "
                           "(the default: debian where apt is there and works, else python, "
                           "with a warning). Their perplexities are not comparable")
    prep.add_argument("--hub-config", default=None, metavar="C",
                      help="dataset configuration of --hub (e.g. en for allenai/c4)")
    prep.add_argument("--split", default=None, help="split of --hub (default train)")
    prep.add_argument("--data-files", nargs="+", default=None, metavar="GLOB",
                      help="data files of --hub (e.g. --hub json --data-files 'x/*.jsonl.gz', "
                           "or a subset of a Hub repository's files)")
    prep.add_argument("--progress", choices=MODES, default="auto",
                      help="--hub: a progress bar over the dataset's files on a terminal "
                           "(auto; a redirected log gets one line per file), on or off")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--text-field", default="text",
                      help="JSONL/Parquet/Hub field with the text (default: text)")
    prep.add_argument("--num-shards", type=int, default=16,
                      help="training shards (a multiple of your data-parallel sizes; default 16)")
    prep.add_argument("--eval-fraction", type=float, default=None,
                      help=f"fraction of documents held out for evaluation (default "
                           f"{EVAL_FRACTION}; {demo_sources.EVAL_FRACTION['python']} for "
                           f"--demo from the Python "
                           f"standard library, whose few documents 1 %% would hardly sample)")
    prep.add_argument("--seed", type=int, default=0, help="seed of the shard shuffle (default: 0)")
    prep.add_argument("--cache-dir", type=Path, default=None,
                      help="where downloaded .deb files are kept "
                           "(default: debian/ in $TAPE_TRAIN_CACHE_DIR, else in "
                           "$XDG_CACHE_HOME/tape-train, else in ~/.cache/tape-train)")
    prep.add_argument("--skip-bad-records", action="store_true",
                      help="skip (and count) malformed input records instead of failing")
    prep.add_argument("--tokenize", action="store_true",
                      help="also write token shards (uint16/uint32, np.memmap-able) for "
                           "data.format=tokens; needs --tokenizer")
    prep.add_argument("--tokenizer", default=None, metavar="MODEL",
                      help="sentencepiece .model used by --tokenize")
    prep.add_argument("--workers", type=int, default=None, metavar="N",
                      help="threads that tokenise (--tokenize; the output does not depend on "
                           "it; default: the CPUs this process may use)")
    prep.add_argument("--force", action="store_true", help="rebuild even if complete")
    prep.add_argument("--fresh", action="store_true",
                      help="start over, discarding an interrupted prepare in --out (one with "
                           "the same options would be resumed; one with other options is "
                           "otherwise refused)")
    # Text per shuffle buffer; a checkpoint follows each (tests use tiny ones). It shapes the
    # output, so a value other than the default is recorded in the manifest's config.
    prep.add_argument("--shuffle-bytes", type=int, default=SHUFFLE_BYTES,
                      help=argparse.SUPPRESS)
    info = sub.add_parser("info", help="summarise a prepared directory, or --verify it")
    info.add_argument("dir", type=Path, help="a directory written by tape-data prepare")
    info.add_argument("--verify", action="store_true",
                      help="instead of the summary, read every file the manifest lists (text "
                           "shards of both splits, token shards) and compare its size and "
                           "sha256 with the manifest; also name listed files that are missing "
                           "and shard-named files it does not list. Exit 0 when all match, "
                           "else 1 with a line per bad file (e.g. after copying a corpus)")
    info.add_argument("--workers", type=int, default=None, metavar="N",
                      help="--verify: threads that hash, one file each at a time (default: "
                           "the CPUs this process may use)")
    info.add_argument("--progress", choices=MODES, default=None,
                      help="--verify: a progress bar on a terminal (auto, the default), "
                           "else a log line every 5 s (bytes done, rate, time left); on or off")
    example_on_missing(parser, "tape-data prepare --demo --out data/demo")
    example_on_missing(prep, "tape-data prepare --input my_corpus/ --out data/mine")
    example_on_missing(info, "tape-data info data/demo")
    return parser


def _local_documents(inputs: list[str], text_field: str,
                     skip_bad: bool) -> tuple[DocumentSource, dict]:
    """The documents of local files as a source positioned by [file, record], and what
    identifies the files (path, size, mtime: a change means an interrupted prepare of them
    cannot resume)."""
    source = SourceConfig(path=inputs, text_field=text_field, key="--input")
    shards = resolve_local_shards(source)
    identity = {"files": [[shard.path, shard.size, os.stat(shard.path).st_mtime_ns]
                          for shard in shards]}

    def documents(position: list | None) -> Iterator[tuple[dict, list]]:
        first, start = position or (0, 0)
        skips = SkipLog(flags=True)
        log.info("prepare: reading %d file(s)%s", len(shards),
                 f", from record {start} of {shards[first].path}" if position else "")
        for i in range(first, len(shards)):
            name = Path(shards[i].path).name
            for record, text in read_documents(shards[i], start if i == first else 0,
                                               text_field, skip_bad, skips):
                yield {"text": text, "source": name, "id": f"{name}:{record}"}, [i, record + 1]
            if (i + 1) % 100 == 0:
                log.info("prepare: read %d/%d files", i + 1, len(shards))
        if skips.counts:
            log.warning("prepare: skipped records: %s", dict(skips.counts))
    return documents, identity


def _check_out_outside_inputs(inputs: list[str], out: Path) -> None:
    """``--out`` may not be, or lie inside, an ``--input`` directory: a later run (``--force``,
    other options) would read what this one writes there as its input — the held-out split
    as training text, or the manifest's training shards in place of the raw files."""
    target = out.resolve()
    for pattern in inputs:
        directory = Path(pattern)
        if not directory.is_dir():
            continue
        if target == directory.resolve() or directory.resolve() in target.parents:
            where = "is" if target == directory.resolve() else "lies inside"
            raise DataError(f"--out {out} {where} the --input directory {pattern!r}: a later "
                            f"prepare of that input (--force, other options) would read what "
                            f"this one writes there, held-out split included, in place of or "
                            f"beside the raw files; write --out outside {pattern!r}")


def _hub_source(args: argparse.Namespace) -> SourceConfig | None:
    """The source of ``--hub`` and its flags (None without ``--hub``)."""
    if args.hub is None:
        for flag, value in (("--hub-config", args.hub_config), ("--split", args.split),
                            ("--data-files", args.data_files)):
            if value is not None:
                raise DataError(f"{flag} needs --hub (it selects what to stream from the Hub)")
        return None
    return SourceConfig(hub=args.hub, config=args.hub_config, split=args.split or "train",
                        data_files=args.data_files, text_field=args.text_field, key="--hub")


def _hub_documents(source: SourceConfig, dataset, skip_bad: bool, bar) -> DocumentSource:
    """Every record of the dataset, file by file (its own shards, in order), positioned by
    [file, record], with a progress line per file (or the bar's update on a terminal).
    Resuming skips the files before the position unread and streams the file holding it up
    to there (a stream cannot seek)."""
    dataset, shards = hub_shards(source, row_groups=False, dataset=dataset)
    return lambda position: _hub_records(source, dataset, shards, skip_bad, bar, position)


def _hub_records(source: SourceConfig, dataset, shards, skip_bad: bool, bar,
                 position: list | None) -> Iterator[tuple[dict, list]]:
    first, start = position or (0, 0)
    skips = SkipLog(flags=True)
    started = time.monotonic()
    documents = text_bytes = 0
    log.info("prepare: streaming %s: %d file(s)%s", source.hub, len(shards),
             f", from record {start} of file {first + 1}" if position else "")
    if bar is not None and first:
        bar.update(first)
    for i in range(first, len(shards)):
        shard = shards[i]
        try:
            for record, text in read_documents(shard, start if i == first else 0,
                                               source.text_field, skip_bad, skips, dataset):
                documents += 1
                text_bytes += len(text.encode("utf-8"))
                yield ({"text": text, "source": source.name, "id": f"{i}:{record}"},
                       [i, record + 1])
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - network or reader errors of datasets
            # A parse error (pyarrow's ArrowInvalid, json's, UnicodeDecodeError: ValueErrors)
            # is in the data and comes back on every re-run; anything else (the network) may not.
            then = ("the data itself could not be parsed, so a re-run stops here again: fix "
                    "or leave out that file" if isinstance(exc, ValueError) else
                    "re-running the same command resumes from the last checkpoint, if any")
            raise DataError(f"{source.field_key('hub')}: reading {shard.path} failed "
                            f"({type(exc).__name__}: {str(exc)[:300]}); {then}") from None
        seconds = time.monotonic() - started
        line = (f"{documents} records, {text_bytes / 1e6:.1f} MB of text, "
                f"{text_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s")
        if bar is not None:
            bar.set_postfix_str(line, refresh=False)
            bar.update(1)
        else:
            log.info("prepare: file %d/%d of %s done: %s so far", i + 1, len(shards),
                     source.hub, line)
    if skips.counts:
        log.warning("prepare: skipped records: %s", dict(skips.counts))


def _prepare(args: argparse.Namespace) -> int:
    problem = (empty_out_error(args.out, "name the output directory, e.g. --out data/mine "
                                         "(--out . for this one)")
               or seed_error("--seed", args.seed))
    if problem:  # Path("") is the current directory
        raise DataError(problem)
    out = Path(args.out)
    hub = _hub_source(args)
    if args.input:
        _check_out_outside_inputs(args.input, out)
    if args.demo_source is not None and not args.demo:
        raise DataError("--demo-source goes with --demo (it chooses the demo corpus's text)")
    # The config each possible outcome records: --demo-source auto may end as either source.
    if args.demo:
        configs = {source: demo_sources.demo_config(source)
                   for source in demo_sources.candidates(args.demo_source or "auto")}
    elif hub is not None:
        configs = {None: {"hub": hub.hub, "hub_config": hub.config, "split": hub.split,
                          "data_files": hub.data_files, "text_field": hub.text_field}}
    else:
        configs = {None: {"inputs": list(args.input), "text_field": args.text_field}}
    for source, config in configs.items():
        eval_fraction = (args.eval_fraction if args.eval_fraction is not None
                         else demo_sources.EVAL_FRACTION.get(source, EVAL_FRACTION))
        config.update(num_shards=args.num_shards, eval_fraction=eval_fraction, seed=args.seed)
        if args.shuffle_bytes != SHUFFLE_BYTES:
            config.update(shuffle_bytes=args.shuffle_bytes)
    tokenizer = None
    workers = usable_cpus() if args.workers is None else args.workers
    if workers <= 0:
        raise DataError(f"--workers must be positive, got {args.workers}")
    if args.workers is not None and not args.tokenize:
        log.warning("prepare: --workers sets the threads that tokenise with --tokenize; without "
                    "it nothing is tokenised and the pass runs on one thread")
    if args.tokenize or args.tokenizer:
        if not (args.tokenize and args.tokenizer):
            raise DataError("--tokenize and --tokenizer MODEL go together")
        from tape_train.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        for config in configs.values():
            config.update(tokenizer_sha256=tokenizer.sha256)
    existing = read_complete_manifest(out)
    if existing is not None:  # its scratch is not needed; --force then rebuilds, not re-moves
        remove_finished_scratch(out)
    if (existing is not None and existing.get("config") in configs.values()
            and not args.force):
        splits = existing["splits"]
        print(f"tape-data: {out} is already complete ({splits['train']['documents']} train / "
              f"{splits['eval']['documents']} eval documents); use --force to rebuild")
        for directory, state in interrupted_scratch(out):
            log.warning("prepare: %s holds an interrupted rebuild of it (checkpoint %s, "
                        "%s): --force resumes it, --force --fresh starts it over, or delete "
                        "the directory", out, state.get("checkpoint"), directory.name)
        return 0
    bar = None
    if args.demo:
        demo = demo_sources.open_demo_corpus(args.demo_source or "auto",
                                             args.cache_dir or _default_cache_dir())
        config = configs[demo.source]
        documents, extra, inputs = demo.documents, demo.extra, demo.inputs
    elif hub is not None:
        dataset, facts = open_hub_dataset(hub)
        extra = {"hub": {"name": hub.hub, "config": hub.config, "split": hub.split,
                         "data_files": hub.data_files, "text_field": hub.text_field, **facts}}
        bar = progress_bar(facts["files"], desc=f"prepare {hub.hub}", unit="file",
                           mode=args.progress)
        documents = _hub_documents(hub, dataset, args.skip_bad_records, bar)
        inputs = {name: facts[name] for name in ("revision", "fingerprint", "files")}
    else:
        documents, inputs = _local_documents(args.input, args.text_field, args.skip_bad_records)
        extra = {}
    if not args.demo:
        (config,) = configs.values()
    try:
        with _logging_around(bar):
            manifest = write_corpus(documents, out, num_shards=args.num_shards,
                                    eval_fraction=config["eval_fraction"], seed=args.seed,
                                    shuffle_bytes=args.shuffle_bytes, config=config,
                                    extra=extra, tokenizer=tokenizer, workers=workers,
                                    inputs=inputs, fresh=args.fresh)
    finally:
        if bar is not None:
            bar.close()
    _print_summary(out, manifest)
    _warn_thin_splits(out, manifest, config["eval_fraction"])
    return 0


def _warn_thin_splits(out: Path, manifest: dict, eval_fraction: float) -> None:
    """A small corpus written as it was asked, with what that means for training."""
    splits = manifest["splits"]
    train, held_out = splits["train"]["documents"], splits["eval"]["documents"]
    if held_out == 0 and eval_fraction > 0:
        print(f"tape-data: warning: {out}: no document was held out ({train} documents x "
              f"--eval-fraction {eval_fraction}): training's evaluation needs held-out "
              f"documents (eval.interval > 0): re-run with a larger --eval-fraction, or give the "
              f"run data.eval_sources", file=sys.stderr)
    if 0 < train < splits["train"]["shards"]:
        print(f"tape-data: warning: {out}: {train} training documents in "
              f"{splits['train']['shards']} shards, so some shards are empty; --num-shards "
              f"{train} or fewer avoids that", file=sys.stderr)


def _logging_around(bar):
    """Log lines go through the bar's ``write`` while a bar is drawn (no torn bar lines)."""
    if bar is None:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def _print_summary(out: Path, manifest: dict) -> None:
    splits = manifest["splits"]
    print(f"tape-data: {out}: {splits['train']['documents']} train documents "
          f"({splits['train']['text_bytes'] / 1e6:.1f} MB) in {splits['train']['shards']} "
          f"shards, {splits['eval']['documents']} eval documents "
          f"({splits['eval']['text_bytes'] / 1e6:.1f} MB)")
    for name, stats in sorted(manifest["sources"].items()):
        print(f"  {name:32s} {stats['documents']:8d} docs {stats['text_bytes'] / 1e6:8.2f} MB")
    if manifest.get("hub"):
        hub = manifest["hub"]
        print(f"  hub: {hub['name']} (config {hub['config']}, split {hub['split']}"
              f"{', data_files ' + str(hub['data_files']) if hub['data_files'] else ''}), "
              f"revision {hub['revision'] or 'n/a (not a Hub repository)'}, "
              f"datasets fingerprint {hub['fingerprint']}, {hub['files']} file(s)")
    if manifest.get("tokens"):
        tokens = manifest["tokens"]
        print(f"  token shards: {tokens['total_tokens']} tokens ({tokens['dtype']}, tokenizer "
              f"{tokens['tokenizer']} sha256 {tokens['tokenizer_sha256'][:12]}…)")


def _verify(args: argparse.Namespace) -> int:
    """``info --verify``: one line per bad file and a final line on stderr (exit 1), or one
    summary line on stdout (exit 0)."""
    from tape_train.data.verify import verify_corpus
    from tape_train.files import human_bytes

    workers = usable_cpus() if args.workers is None else args.workers
    if workers <= 0:
        raise DataError(f"--workers must be positive, got {args.workers}")
    report = verify_corpus(args.dir, workers=workers, progress=args.progress or "auto")
    rate = human_bytes(report.hashed_bytes / max(report.seconds, 1e-9))
    if report.ok:
        tokens = sum(item.kind == "tokens" for item in report.listed)
        print(f"tape-data: {args.dir}: verified {len(report.listed)} files "
              f"({len(report.listed) - tokens} text shards"
              f"{f', {tokens} token shards' if tokens else ''}), "
              f"{report.hashed_bytes:,} bytes ({human_bytes(report.hashed_bytes)}) in "
              f"{report.seconds:.1f} s ({rate}/s): every size and sha256 matches "
              f"{MANIFEST_NAME}")
        return 0
    for problem in report.problems:
        print(f"tape-data: error: {args.dir / problem.name}: {problem.kind}"
              + (f": {problem.detail}" if problem.detail else ""), file=sys.stderr)
    kinds = collections.Counter(problem.kind for problem in report.problems)
    unlisted = kinds.pop("unlisted", 0)
    found, fixes = [], []
    if kinds:
        found.append(f"{sum(kinds.values())} of {len(report.listed)} listed files bad ("
                     + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + ")")
        fixes.append("copy the named files again from where the corpus was prepared (or "
                     "re-run `tape-data prepare --force`)")
    if unlisted:
        found.append(f"{unlisted} shard-named file(s) not listed")
        fixes.append("delete the unlisted files (a glob such as train-*.jsonl.zst would read "
                     "them)")
    print(f"tape-data: error: {args.dir}: verify failed: {'; '.join(found)}: "
          f"{'; '.join(fixes)}", file=sys.stderr)
    return 1


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Within the block SIGTERM stops the prepare as Ctrl-C does (KeyboardInterrupt: the log
    names the checkpoint, exit 130) instead of killing it mid-write. Slurm's time limit,
    preemption and scancel send it, and launch/slurm/prepare.sbatch sends one more to this
    process: a later SIGTERM is ignored (also after the block), so it cannot cut the stop short."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    stopped = False

    def on_sigterm(signum, frame):
        nonlocal stopped
        stopped = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.info("prepare: got SIGTERM; stopping as on Ctrl-C")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if not stopped:
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_cli_logging()
    try:
        if args.command == "prepare":
            with _sigterm_as_interrupt():
                return _prepare(args)
        if args.verify:
            return _verify(args)
        for flag, value in (("--workers", args.workers), ("--progress", args.progress)):
            if value is not None:
                raise DataError(f"{flag} goes with --verify (the hashing of the files); "
                                f"the summary without it reads only the manifest")
        manifest = read_complete_manifest(args.dir)
        if manifest is None:
            if (args.dir / MANIFEST_NAME).is_file():  # a listed file missing or resized
                hint = f"; `tape-data info {args.dir} --verify` names what is wrong"
            else:
                hint = ""
            print(f"tape-data: error: {args.dir} is not a complete prepared directory "
                  f"(no valid {MANIFEST_NAME}, or a file it lists is missing or not of its "
                  f"listed size; `tape-data prepare --out {args.dir}` writes one){hint}",
                  file=sys.stderr)
            return 1
        _print_summary(args.dir, manifest)
        print(json.dumps({k: manifest[k] for k in ("config", "held_out", "dropped", "hub")
                          if k in manifest}, indent=1))
        return 0
    except DataError as exc:
        print(f"tape-data: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the log above says whether a re-run resumes
        print("tape-data: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # e.g. --out names an existing file, a full disk, no permission
        from tape_train.files import describe_os_error

        print(f"tape-data: error: {describe_os_error(exc, exc.filename or getattr(args, 'out', ''))}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
