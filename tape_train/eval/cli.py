"""``tape-eval``: perplexity of one or more checkpoints at growing context lengths.

    tape-eval --checkpoint runs/tape runs/rope --label TAPE RoPE --lengths 256 512 1024 2048 \\
              --out results/extrapolation

Each checkpoint is a run directory (→ its latest complete checkpoint) or a tag directory.
Weights are consolidated from the sharded checkpoint without optimizer state, so any world size
works: under ``torchrun --nproc_per_node N`` every process holds the whole model and scores
every N-th batch of windows, and the sums are all-reduced. Rank 0 prints the table and writes
``eval.md``, ``ppl_vs_length.png`` and, last, ``eval.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tape_train.devices import LaunchError, check_launch_environment, launch_int
from tape_train.files import FileWriteError
from tape_train.hints import example_on_missing
from tape_train.progress import MODES, exit_without_finalizing, setup_cli_logging, show_progress

log = logging.getLogger("tape_train.eval")

DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp64": "float64"}


def build_parser() -> argparse.ArgumentParser:
    from tape_train.eval.config import PROTOCOLS, EvalConfig

    default = EvalConfig()
    p = argparse.ArgumentParser(
        prog="tape-eval", description="Token-weighted perplexity at growing context lengths "
        "(spec §7) for one or more checkpoints; writes a table, JSON and a plot.")
    p.add_argument("--checkpoint", nargs="+", required=True, metavar="PATH",
                   help="run directories (latest complete checkpoint) or checkpoint tag dirs")
    p.add_argument("--label", nargs="+", metavar="NAME",
                   help="one display name per checkpoint (default: run name and encoding)")
    # Each setting's default is the checkpoints' runs' eval: section (tape_train.eval.settings).
    p.add_argument("--lengths", nargs="+", type=_auto_or_int, metavar="L|auto",
                   help="context lengths in tokens; 'auto': L, 2L, 4L, 8L of each "
                        "checkpoint's training length L (default: the runs' eval.lengths; "
                        "when null, auto)")
    p.add_argument("--protocols", nargs="+", choices=PROTOCOLS,
                   help=f"default: the runs' eval.protocols, else {' '.join(default.protocols)}")
    p.add_argument("--stride", type=_auto_or_int, metavar="S|auto",
                   help="sliding-window stride S < every length; 'auto': L // 2 of each "
                        "length L (default: the runs' eval.sliding_stride; when null, auto)")
    p.add_argument("--max-tokens", metavar="N|all",
                   help="scored tokens per (length, protocol); 'all' scores the whole held-out "
                        f"set (default: the runs' eval.max_tokens, else {default.max_tokens})")
    p.add_argument("--batch-size", type=int,
                   help="windows per forward call (default: the runs' eval.batch_size, else "
                        f"{default.batch_size})")
    p.add_argument("--data", default=None, metavar="YAML|NAME|DIR",
                   help="data config (YAML path or name in configs/data) or a prepared data "
                        "directory (default: the data section of the first checkpoint's config)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="sentencepiece model (default: the data config's tokenizer); one "
                        "that is not the tokenizer a checkpoint's run trained with (its "
                        "sha256, recorded in the checkpoint) is refused")
    p.add_argument("--allow-other-tokenizer", action="store_true",
                   help="evaluate with a tokenizer other than the one a checkpoint's run "
                        "trained with (a warning, and the report says so)")
    p.add_argument("--out", default="eval_results", metavar="DIR",
                   help="output directory (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto, cpu or cuda (default: auto)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                   help="evaluation dtype of the weights (default: auto: fp32 when a checkpoint "
                        "trained in fp32, else bf16 where the device "
                        "has fast native bf16, else fp32; tape_train.precision)")
    p.add_argument("--progress", choices=MODES, default="auto",
                   help="progress bars: auto (only on a terminal, never in a redirected log), "
                        "on or off (default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_const", const="off",
                   help="same as --progress off")
    return example_on_missing(p, "tape-eval --checkpoint runs/demo --lengths 128 256 512 1024")


# ``--lengths auto`` / ``--stride auto``: the run config's ``null`` for that setting, typed.
AUTO = "auto"


def _auto_or_int(text: str) -> int | str:
    if text.lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: an integer or 'auto'") from None


def _parse_max_tokens(text: str) -> int | None:
    if text.lower() in ("all", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--max-tokens must be a positive integer or 'all', got {text!r}")
    return value


def _given_settings(args: argparse.Namespace) -> dict:
    """The settings a command line gives, by ``EvalConfig`` key (the others come from the
    checkpoints' runs), checked with the run config's checks: everything that reads no file
    (labels, lengths, stride, batch size, max tokens)."""
    from tape_train.eval.config import EvalConfig
    from tape_train.eval.settings import OPTION_OF_KEY, option_name, unused_stride

    if args.label is not None and len(args.label) != len(args.checkpoint):
        raise ValueError(f"--label got {len(args.label)} name(s) for {len(args.checkpoint)} "
                         f"checkpoint(s): give one per checkpoint, in the same order")
    for label in args.label or ():
        if not label.strip() or "\n" in label or "|" in label:
            raise ValueError(f"--label {label!r}: a name must be one line, not blank (an unset "
                             f"shell variable?), without '|' (it names a row of the Markdown "
                             f"table and a line of the plot's legend)")
    given = {key: getattr(args, option[2:].replace("-", "_"))
             for key, option in OPTION_OF_KEY.items()}
    given = {key: value for key, value in given.items() if value is not None}
    if "max_tokens" in given:
        given["max_tokens"] = _parse_max_tokens(given["max_tokens"])
    if AUTO in given.get("lengths", ()):
        if len(given["lengths"]) > 1:
            raise ValueError(f"--lengths {' '.join(map(str, given['lengths']))}: 'auto' (L, 2L, "
                             f"4L, 8L of each checkpoint's train.seq_len) stands alone")
        given["lengths"] = None
    if given.get("sliding_stride") == AUTO:
        given["sliding_stride"] = None
    if "sliding_stride" in given and "protocols" in given:
        problem = unused_stride(given["protocols"], "--protocols")
        if problem:
            raise ValueError(problem)
    EvalConfig(**given, name=option_name)
    return given


def check_arguments(argv: list[str], run=None) -> None:
    """Raise ``ValueError`` with what tape-eval would refuse in ``argv`` without reading a
    file (an unknown option, a bad value): ``tape-submit --eval-after`` checks the evaluation
    job's command line before the training job is queued, not when it starts hours later.
    ``run``, the ``RunConfig`` the checkpoint will be trained with, adds what tape-eval checks
    against its ``eval:`` section and ``train.seq_len`` (a ``--stride`` its protocols leave
    unused, its stride not below a ``--lengths``)."""
    from tape_train.eval.settings import merge_settings

    parser = build_parser()

    def refuse(message: str):
        raise ValueError(message)

    parser.error = refuse
    given = _given_settings(parser.parse_args(argv))
    if run is not None:
        where = "the run's config"
        merge_settings(given, {where: run.eval}).lengths_for(run.train.seq_len, where)


# Collectives of a multi-rank evaluation wait at most this long: rank 0 reads a large checkpoint
# back against its checksums while the others wait (NCCL's own default is 10 minutes).
COLLECTIVE_TIMEOUT = timedelta(hours=1)
# What a rank reports as an input error (CheckpointError, DataError and TokenizerError derive
# from these); anything else is a bug and keeps its traceback.
INPUT_ERRORS = (ValueError, FileNotFoundError, RuntimeError, FileWriteError)


class StoppedByRankZero(Exception):
    """Rank 0 found an input error and printed it; the other ranks end quietly (exit 1)."""


def _init_distributed(device_arg: str):
    """(rank, world size, device, reduce): a process group only when launched by torchrun
    (``WORLD_SIZE`` > 1), NCCL on CUDA and gloo on CPU as in training; each process computes on
    the device its ``LOCAL_RANK`` names (``tape_train.devices.pick_device``)."""
    import torch.distributed as dist

    from tape_train.devices import pick_device, process_group_backend

    world = launch_int("WORLD_SIZE")
    device = pick_device(device_arg, launch_int("LOCAL_RANK"), "--device")
    if world == 1:
        return 0, 1, device, None
    if not dist.is_initialized():
        dist.init_process_group(process_group_backend(device), timeout=COLLECTIVE_TIMEOUT)

    def reduce(sums):
        # The sums live on this process's device, where its backend sums them (CUDA: NCCL).
        try:
            dist.all_reduce(sums)
            return sums
        except RuntimeError as err:
            raise _peer_lost("summing the results with the other ranks", err) from err
    return dist.get_rank(), world, device, reduce


def _peer_lost(what: str, err: RuntimeError) -> RuntimeError:
    """A collective that failed because another rank ended, said as such: the backend's own
    message is its first sentence, without gloo's source location (``[.../pair.cc:553]
    Connection closed by peer [127.0.0.1]:18859. This is typically caused by ... GLHF!``)."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip().split("\n")[0])
    return RuntimeError(f"{what} failed, most likely because another rank stopped (its own "
                        f"error is in this log): {first.split('. ')[0]}")


def _rank_zero_decides(compute: Callable[[], Any], rank: int, world: int):
    """``compute()`` on rank 0 alone, its result sent to every rank: what must be the same
    everywhere (which checkpoints, the held-out documents, the dtype) and what is costly or
    unkind to do N times (reading checkpoints back against their checksums, streaming a Hub
    dataset). Rank 0 raises its input error; the others raise ``StoppedByRankZero``."""
    value, error = None, None
    if rank == 0:
        try:
            value = compute()
        except INPUT_ERRORS as err:
            error = err
    if world > 1:
        import torch.distributed as dist

        box = [(value, error is not None)]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as err:  # rank 0 ended with a bug of its own (a traceback)
            raise _peer_lost("receiving the inputs from rank 0" if rank else
                             "sending the inputs to the other ranks", err) from err
        value, failed = box[0]
        if failed and rank != 0:
            raise StoppedByRankZero()
    if error is not None:
        raise error
    return value


def _data_config(arg: str | None, meta_config: dict, tokenizer_arg: str | None):
    """(DataConfig, description) from ``--data`` or the checkpoint's data section."""
    from tape_train.data import DataConfig, load_data_config

    base = dict(meta_config.get("data") or {})
    if arg is None:
        cfg = DataConfig.from_dict(base, source="checkpoint config [data]")
        desc = "checkpoint data config"
    elif Path(arg).is_dir():
        # A prepared directory: its held-out split; tokenizer and wrapping from the checkpoint.
        base.update(sources=[{"path": arg}], eval_sources=[])
        cfg = DataConfig.from_dict(base, source=f"--data {arg}")
        desc = f"prepared data dir {arg}"
    else:
        cfg = load_data_config(arg)
        desc = f"data config {arg}"
    if tokenizer_arg is not None:
        cfg.tokenizer = tokenizer_arg
    return cfg, f"{desc} ({held_out_words(cfg)})"


def held_out_words(cfg) -> str:
    """Which documents a ``DataConfig`` holds out, in words, for the report (in
    ``iter_eval_documents``' order): "checkpoint data config" alone did not say what text was
    scored."""
    from tape_train.data.formats import is_prepared_dir

    parts = []
    if cfg.eval_sources:
        parts.append("data.eval_sources " + ", ".join(str(s.name) for s in cfg.eval_sources))
    prepared = [str(s.name) for s in cfg.sources
                if any(Path(p).is_dir() and is_prepared_dir(Path(p)) for p in s.paths)]
    if prepared:
        parts.append("the eval split of " + ", ".join(prepared))
    if cfg.eval_fraction > 0:
        parts.append(f"{cfg.eval_fraction:g} of the documents of "
                     + ", ".join(str(s.name) for s in cfg.sources) + " (by text hash)")
    words = "; then ".join(parts) or "no held-out source"
    if cfg.eval_min_tokens is not None:
        words += f"; documents of >= {cfg.eval_min_tokens} tokens"
    if cfg.eval_max_documents is not None:
        words += f"; the first {cfg.eval_max_documents} documents"
    return words


def _documents(args, first: _Checkpoint, longest: int):
    """Held-out documents for the first checkpoint's data (shared by every checkpoint)."""
    config = first.meta.get("config") or {}
    train = config.get("train") or {}
    if args.data is None and train.get("synthetic_data"):
        # A run trained on synthetic tokens has no corpus: evaluate on the deterministic random
        # documents of its scheduled evaluation (sized by its eval lengths), longer only when
        # a length asked here needs it.
        from tape_train.data.synthetic import synthetic_held_out

        try:  # the longest length of the run's own scheduled evaluation
            run_longest = max(first.run_eval.resolve_lengths(first.train_seq_len))
        except ValueError:  # no train.seq_len (or a stride its own lengths refuse)
            run_longest = None
        description = "synthetic random tokens (the run trained on synthetic data)"
        if run_longest is None or longest > run_longest:
            log.info("held-out data: synthetic documents sized for L=%d, %s: the numbers are "
                     "not comparable with the ones in the run's log", longest,
                     "the run's config does not say its eval lengths" if run_longest is None
                     else f"longer than its scheduled evaluation's (up to L={run_longest})")
            description += f", sized for L={longest}, not the run's own held-out documents"
        else:
            longest = run_longest
        docs = synthetic_held_out(first.model_cfg.vocab_size, longest,
                                  int(train.get("seed", 0)))
        return docs, description, None
    from tape_train.data import iter_eval_documents, load_model_tokenizer

    data_cfg, desc = _data_config(args.data, config, args.tokenizer)
    tokenizer = load_model_tokenizer(data_cfg.tokenizer, first.model_cfg.vocab_size)
    return iter_eval_documents(data_cfg, tokenizer, byte_ends=True), desc, tokenizer


def _check_trained_tokenizer(checkpoints: list[_Checkpoint], tokenizer, allow: bool) -> str:
    """Refuse a tokenizer that is not the one a checkpoint's run trained with (the sha256
    recorded in the checkpoint: ``loading.other_tokenizer``), or with ``allow`` warn and
    return the words the report's description gets."""
    from tape_train.loading import other_tokenizer

    for c in checkpoints:
        why = other_tokenizer(c.tag_dir, c.meta, tokenizer)
        if why is None:
            continue
        if not allow:
            fix = ("pass the run's tokenizer with --tokenizer" if len(checkpoints) == 1 else
                   "checkpoints evaluated together must share a tokenizer: evaluate the ones "
                   "of other tokenizers separately")
            raise ValueError(f"{why}; {fix}, or --allow-other-tokenizer to evaluate anyway")
        log.warning("%s; --allow-other-tokenizer: evaluating anyway", why)
        return (f"; tokenised with {tokenizer.path}, not the tokenizer the run trained with "
                f"(--allow-other-tokenizer)")
    return ""


def _check_same_tokenizer(checkpoints: list[_Checkpoint], used: str) -> None:
    """Refuse a checkpoint whose run recorded a tokenizer file other than ``used`` (the one
    that tokenised the held-out data): with the same vocabulary size its scores would be
    silently meaningless. A recorded file that no longer exists is not checked."""
    import filecmp

    for c in checkpoints:
        own = ((c.meta.get("config") or {}).get("data") or {}).get("tokenizer")
        if not isinstance(own, str) or not own:
            continue
        own_path = os.path.expanduser(own)
        if not os.path.isfile(own_path) or os.path.samefile(own_path, used):
            continue
        if not filecmp.cmp(own_path, used, shallow=False):
            raise ValueError(
                f"{c.tag_dir}: its run was trained with tokenizer {own}, but the held-out data "
                f"is tokenised with {used} (a different file): checkpoints evaluated together "
                f"must share a tokenizer (evaluate them separately, or pass --tokenizer to "
                f"choose one for all)")


# What decides which documents a run trained on (and so which ones it never saw): its sources
# (weights aside: they mix the same documents) and what it held out of them.
_TRAINING_DATA_KEYS = ("sources", "eval_sources", "eval_fraction", "format")


def _training_data(meta: dict) -> dict | None:
    """The part of a run's data config that decides which documents it trained on; None for a
    run trained on synthetic tokens (or with no data section)."""
    from tape_train.data import DataConfig

    config = meta.get("config") or {}
    if (config.get("train") or {}).get("synthetic_data") or not config.get("data"):
        return None
    data = dict(config["data"])
    try:  # the stored form of every source, so equal settings compare equal however written
        data = DataConfig.from_dict(data).to_dict()
    except (TypeError, ValueError):
        pass
    picked = {key: data.get(key) for key in _TRAINING_DATA_KEYS}
    picked["sources"] = [{k: v for k, v in source.items() if k not in ("weight", "name")}
                         if isinstance(source, dict) else source
                         for source in picked.get("sources") or []]
    return picked


def _other_training_data(checkpoints: list[_Checkpoint], data_arg: str | None) -> str | None:
    """A warning when the checkpoints trained on different data (other sources, or other
    documents held out of them), else None. Without ``--data`` every one is scored on the
    first one's held-out documents, which another may have trained on (one that held out
    nothing, or other sources): its perplexity would be flattered."""
    first = _training_data(checkpoints[0].meta)
    differ = [c for c in checkpoints[1:] if _training_data(c.meta) != first]
    if not differ:
        return None
    names = ", ".join(str(c.tag_dir) for c in differ)
    keys = ", ".join(f"data.{k}" for k in _TRAINING_DATA_KEYS)
    where = ("the held-out documents of --data" if data_arg is not None else
             f"the held-out documents of the first checkpoint's data ({checkpoints[0].tag_dir})")
    return (f"{names}: trained on other data than {checkpoints[0].tag_dir} ({keys} differ); "
            f"every checkpoint is scored on {where}, which a checkpoint trained on other data "
            f"may have seen in training: compare with care")


def _trained_in_fp32(checkpoints: list[_Checkpoint]) -> list[str]:
    """The checkpoints whose run trained in fp32 (its stored ``train.dtype``: a run's ``auto``
    is stored resolved). ``--dtype auto`` then evaluates every checkpoint in fp32, as that
    run's own scheduled evaluation did: in bf16 its numbers would move in the 4th digit, as
    much as the effect a length sweep of a small model measures."""
    return [str(c.tag_dir) for c in checkpoints
            if ((c.meta.get("config") or {}).get("train") or {}).get("dtype") == "fp32"]


def _default_label(tag_dir: Path, meta: dict, model_cfg) -> str:
    parent = tag_dir.parent
    run = parent.parent.name if parent.name == "checkpoints" else parent.name
    step = meta.get("step")
    return f"{run} ({model_cfg.pe}, step {step})" if step is not None else f"{run} ({model_cfg.pe})"


@dataclass
class _Checkpoint:
    """One checkpoint to evaluate, read from its marker (no weights yet)."""
    tag_dir: Path
    meta: dict
    model_cfg: Any
    train_seq_len: int | None
    run_eval: Any  # EvalConfig: its run's eval: section, defaults where it has no key
    lengths: list[int] = field(default_factory=list)  # set once the settings are chosen
    lengths_from: str = ""  # where they came from, for an error about them



def _check_out(out: str) -> None:
    """``--out`` can be made and written (found now, not after evaluating every checkpoint)."""
    from tape_train.hints import empty_out_error

    problem = empty_out_error(out, "name the report directory, e.g. --out eval_results "
                                   "(--out . for this one)")
    if problem:
        raise ValueError(problem)
    from tape_train.checkpoint_layout import CHECKPOINT_DIR, MARKER, step_of_tag
    from tape_train.files import unwritable_reason

    reason = unwritable_reason(out)
    if reason is not None:
        raise ValueError(f"--out {out}: {reason}")
    # A checkpoint's tag directory is the trainer's: its rotation (checkpoint.keep) deletes
    # the tag with everything in it, a report written there too.
    path = Path(out).absolute()
    for inside in (path, *path.parents):
        if (inside / MARKER).is_file() or (step_of_tag(inside.name) is not None
                                           and inside.parent.name == CHECKPOINT_DIR):
            raise ValueError(
                f"--out {out} is inside the checkpoint {inside}, which training deletes with "
                f"everything in it as it saves newer checkpoints (checkpoint.keep): write the "
                f"report elsewhere, e.g. --out {inside.parent.parent / 'eval'}")


def _read_checkpoints(given: dict, tag_dirs: list[Path]):
    """(settings, checkpoints): each checkpoint's model config and run config from its
    marker, the settings from the options ``given`` over the runs' eval: sections
    (tape_train.eval.settings), and each checkpoint's lengths."""
    from tape_train.eval.settings import merge_settings, run_eval_config
    from tape_train.loading import checkpoint_model_config, read_marker, with_run_paths

    checkpoints = []
    for tag_dir in tag_dirs:
        meta = with_run_paths(read_marker(tag_dir), tag_dir)
        model_cfg = checkpoint_model_config(tag_dir, meta)
        train_seq_len = int(((meta.get("config") or {}).get("train") or {}).get("seq_len", 0)) \
            or None
        checkpoints.append(_Checkpoint(tag_dir, meta, model_cfg, train_seq_len,
                                       run_eval_config(meta, str(tag_dir))))
    settings = merge_settings(given, {str(c.tag_dir): c.run_eval for c in checkpoints})
    for c in checkpoints:
        c.lengths = settings.lengths_for(c.train_seq_len, str(c.tag_dir))
        c.lengths_from = settings.where("lengths")
    return settings.config, checkpoints


def _held_out(args, checkpoints: list[_Checkpoint], max_tokens: int | None):
    """(documents, description): the held-out set of the first checkpoint's data, scored by
    every checkpoint, each of whose vocabularies must hold its token ids."""
    from tape_train.eval.perplexity import check_reachable, materialize_documents

    first = checkpoints[0]
    longest = max(max(c.lengths) for c in checkpoints)
    source, description, tokenizer = _documents(args, first, longest)
    if tokenizer is not None and args.tokenizer is None:  # runs of different tokenizers first
        _check_same_tokenizer(checkpoints[1:], tokenizer.path)
    if tokenizer is not None:
        description += _check_trained_tokenizer(checkpoints, tokenizer,
                                                args.allow_other_tokenizer)
    other_data = _other_training_data(checkpoints, args.data)
    if other_data is not None:
        log.warning("%s", other_data)
        description += ("; the checkpoints were trained on different data, so these documents "
                        "may be training text for some of them (the log's warning names them)")
    docs = materialize_documents(source, max_tokens)
    if not docs:
        raise ValueError(f"no held-out document of {description} has two or more tokens: "
                         f"nothing to score")
    for c in checkpoints:  # before any weights are read
        try:
            check_reachable(c.lengths, docs)
        except ValueError as exc:  # lengths from the run's eval: section, when none were typed
            raise ValueError(f"{c.tag_dir}: {exc} ({c.lengths_from})") from None
    top = max((int(tokens.max()) for tokens, *_ in docs), default=-1)
    for c in checkpoints[1:]:
        if top >= c.model_cfg.vocab_size:
            raise ValueError(
                f"{c.tag_dir}: its model has a vocabulary of {c.model_cfg.vocab_size} but the "
                f"held-out data ({description}, tokenised for {first.tag_dir}) has token id "
                f"{top}: checkpoints evaluated together must share a tokenizer")
    return docs, description


def run(args) -> int:
    """Evaluate. Under torchrun rank 0 alone checks the inputs, resolves and verifies the
    checkpoints, reads their configs and the held-out data and picks the dtype, and sends the
    result to the others: an input error stops every rank and is printed once, before any
    weights are read."""
    import torch

    from tape_train.devices import pick_device
    from tape_train.eval.perplexity import evaluate_perplexity
    from tape_train.eval.report import format_table, write_reports
    from tape_train.checkpoint_layout import CheckpointError, deleted_while_read
    from tape_train.loading import (held_checkpoint, load_model_from_checkpoint,
                                    resolve_checkpoint)
    from tape_train.model import TransformerLM

    def read_inputs():
        given = _given_settings(args)
        _check_out(args.out)
        if args.data is not None and not Path(args.data).is_dir():
            # A missing or malformed --data before the checkpoints' checksums (minutes for a
            # large one); it is read again, with the checkpoint's settings, for the documents.
            from tape_train.data import load_data_config

            load_data_config(args.data)
        if alone:  # the device before the checkpoints (a large one's checksums take minutes)
            pick_device(args.device, launch_int("LOCAL_RANK"), "--device")
        # Which checkpoints (a missing, incomplete or damaged one fails here).
        tag_dirs = [resolve_checkpoint(p) for p in args.checkpoint]
        settings, checkpoints = _read_checkpoints(given, tag_dirs)
        docs, description = _held_out(args, checkpoints, settings.max_tokens)
        log.info("held-out data: %s, %d documents, %d predictions", description, len(docs),
                 sum(t.numel() - 1 for t, *_ in docs))
        return settings, checkpoints, docs, description

    alone = launch_int("WORLD_SIZE") == 1
    if alone:  # all of it before any start-up work
        inputs = read_inputs()
    rank, world, device, reduce = _init_distributed(args.device)
    if not alone:
        inputs = _rank_zero_decides(read_inputs, rank, world)
    settings, checkpoints, docs, data_desc = inputs
    if device.type == "cpu":
        from tape_train.cpu_threads import adopt_torch_threads
        from tape_train.host_memory import keep_freed_memory

        keep_freed_memory()
        # a thread per core is the slowest choice beside other work; said by rank 0
        adopt_torch_threads(launch_int("LOCAL_WORLD_SIZE"),
                            lambda level, text: rank == 0 and log.log(level, "%s", text))

    def pick_dtype():
        if args.dtype not in ("auto", "bf16"):
            return args.dtype
        from tape_train.precision import resolve_dtype

        trained = _trained_in_fp32(checkpoints) if args.dtype == "auto" else []
        if trained:
            log.info("precision: fp32 (requested auto: %s trained in fp32, so its scheduled "
                     "evaluation ran in fp32 too; --dtype bf16 evaluates in bf16)",
                     ", ".join(trained))
            return "fp32"
        precision = resolve_dtype(args.dtype, device.type)
        log.info("%s", precision.log_line(args.dtype))
        if precision.warning:
            log.warning("%s", precision.warning)
        return precision.dtype

    dtype_name = _rank_zero_decides(pick_dtype, rank, world)  # measured once, used by all
    dtype = getattr(torch, DTYPES[dtype_name])

    runs = []
    # Every checkpoint's files held open from here: a run still training may delete a tag
    # (checkpoint.keep) before its turn comes.
    with contextlib.ExitStack() as held:
        tag_dirs = [held.enter_context(held_checkpoint(c.tag_dir)) for c in checkpoints]
        for i, c in enumerate(checkpoints):
            try:
                _, state, _ = load_model_from_checkpoint(tag_dirs[i], map_dtype=None, verify=False)
            except CheckpointError as exc:  # its run, still training, rotated it away meanwhile
                done = ", ".join(r["label"] for r in runs)
                vanished = deleted_while_read(
                    c.tag_dir, exc, when="after tape-eval checked it at the start" + (
                        f" (evaluated since, and not reported: {done})" if runs else ""))
                if vanished is None:  # named by its own path, not by the mirror's
                    raise CheckpointError(str(exc).replace(str(tag_dirs[i]), str(c.tag_dir))
                                          ) from None
                raise vanished from None
            model = TransformerLM(c.model_cfg)
            missing, unexpected = model.load_state_dict(state, strict=False)
            if missing or unexpected:
                raise ValueError(f"{c.tag_dir}: weights do not match the model config "
                                 f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
            model.to(device=device, dtype=dtype)
            label = args.label[i] if args.label else _default_label(c.tag_dir, c.meta, c.model_cfg)
            if rank == 0:
                log.info("evaluating %s: %s, %s, step %s, lengths %s", label, c.tag_dir,
                         c.model_cfg.pe, c.meta.get("step"), c.lengths)
            results = []
            for protocol in settings.protocols:
                results += evaluate_perplexity(
                    model, docs, lengths=c.lengths, protocol=protocol,
                    stride=settings.sliding_stride, max_tokens=settings.max_tokens,
                    batch_size=settings.batch_size, device=device,
                    progress=rank == 0 and show_progress(args.progress), reduce=reduce,
                    dp_rank=rank, dp_size=world)
            runs.append({"label": label, "checkpoint": str(c.tag_dir), "step": c.meta.get("step"),
                         "pe": c.model_cfg.pe, "model": c.model_cfg.name,
                         "train_seq_len": c.train_seq_len, "results": results})
            del model, state

    labels = [r["label"] for r in runs]
    if len(set(labels)) != len(labels):
        for j, r in enumerate(runs):
            r["label"] = f"{r['label']} #{j + 1}"
    if rank == 0:
        print(format_table(runs), end="", flush=True)
        paths = write_reports(args.out, runs, settings={
            "protocols": settings.protocols, "sliding_stride": settings.sliding_stride,
            "max_tokens": settings.max_tokens, "batch_size": settings.batch_size,
            "data": data_desc,
            "world_size": world, "dtype": dtype_name, "device": str(device)})
        print(f"wrote {paths['markdown']}, {paths['plot']}, {paths['json']}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # torchrun's variables, before anything is read or started
        check_launch_environment()
    except LaunchError as err:
        print(f"tape-eval: error: {err}", file=sys.stderr)
        return 1
    rank = launch_int("RANK")
    # Under torchrun: rank 0 logs progress; the others only warnings and errors, tagged.
    setup_cli_logging(logging.INFO if rank == 0 else logging.WARNING,
                      tag="" if rank == 0 else f"rank{rank}")
    try:
        code = run(args)
    except StoppedByRankZero:
        code = 1
    except INPUT_ERRORS as err:
        # CheckpointError, DataError and TokenizerError derive from these. Every rank that
        # fails says so (a failure of one rank alone must be visible), naming itself.
        where = f" (rank {rank} of {os.environ.get('WORLD_SIZE')})" if rank else ""
        print(f"tape-eval: error{where}: {err}", file=sys.stderr)
        code = 1
    finally:
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        if grouped:
            dist.destroy_process_group()
    if grouped:
        exit_without_finalizing(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
