"""Preflight: everything a run needs, checked in seconds without DeepSpeed or a process group.

``tape-train --dry-run`` prints the whole plan; ``Trainer.setup`` runs the same input checks
before it starts DeepSpeed; ``tape-submit`` and the Slurm per-node start-up run it for the
target layout. ::

    report = run_preflight(cfg, world_size=16, gpus_per_node=8)
    report.problems      # one line each, naming the key, file or value at fault
    report.lines         # the plan: config, rank grid, data, held-out lengths, run dir,
                         # resume, memory per rank, FLOPs and estimated step time

Checks: train.seq_len <= model.max_seq_len; the rank grid (``RankGrid.from_sizes`` +
``check_model``); the tokenizer loads and fits model.vocab_size; every data source resolves,
each of its files (up to ``max_shards``) opens and its first documents read and tokenise;
with ``data.format: tokens`` the token shards match the tokenizer and the mixture weights are
valid (each source's blocks, share and samples per epoch are reported);
the block shuffle windows of the ranks on a node fit in its RAM;
held-out documents are long enough for every evaluation length (counted over the documents
the evaluation will score, ``eval.max_tokens``); the run directory is writable with room for
``checkpoint.keep`` + 1 checkpoints; ``profile.ranks`` within the world (and what profiling
will write); a resume's layout and batch (``relayout``), and whether the data-loader state
it would load fits the data as it is now (``data.loader.resume_differences``: file names and
sizes, manifests; also at the start of a real run); the memory estimate
(``tape_train.train.memory``) against the device; FLOPs per token (``tape_train.model.flops``)
and an estimated step time at an assumed MFU.
"""

from __future__ import annotations

import copy

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
DEFAULT_ASSUMED_MFU = 0.4


class PreflightError(RuntimeError):
    """The run cannot start; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # The checkpoint whose data-loader state the resume data check found to fit the data as
    # it is now (None: none checked, or it does not fit).
    resume_data_fits: Path | None = None

    def info(self, line: str) -> None:
        self.lines.append(line)

    def problem(self, line: str) -> None:
        self.problems.append(line)

    def warn(self, line: str) -> None:
        self.warnings.append(line)


@dataclass(frozen=True)
class Limits:
    """How much of the data a preflight reads: the dry run reads more than a run's start."""

    max_shards: int = 256          # files checked per source
    docs_per_shard: int = 4        # documents read and tokenised per file
    eval_seconds: float = 20.0     # time budget for counting held-out document lengths


RUN_START_LIMITS = Limits(max_shards=16, docs_per_shard=2, eval_seconds=5.0)


def run_preflight(cfg, *, world_size: int, gpus_per_node: int | None = None,
                  resume_from: str | Path | None = None, allow_config_change: bool = False,
                  check_data: bool = True, check_eval: bool = True, check_resume: bool = True,
                  check_resume_data: bool | None = None, plan: bool = True,
                  device_memory_gb: float | None = None,
                  gpu_name: str | None = None, assumed_mfu: float = DEFAULT_ASSUMED_MFU,
                  ranks_per_node: int | None = None, limits: Limits = Limits(),
                  check_memory_floor: bool = False) -> Report:
    """All checks; ``plan=False`` leaves out the memory estimate and the step-time plan.
    ``check_memory_floor`` (a run's start, where ``plan`` is off): the memory floor against
    this machine's available RAM or its GPU's memory (the plan checks it itself).

    ``gpus_per_node``: plan for CUDA nodes with that many GPUs (0: CPU nodes); ``None`` plans
    for this machine. ``ranks_per_node``: CPU ranks sharing one node's RAM (default: the GPUs
    per node, else the whole world on this machine). ``check_resume``: what a resume would
    load, its layout and config; ``check_resume_data`` (default: as ``check_resume``; needs
    ``check_data``): whether its data-loader state fits the data as it is now (a real run
    checks only this here: the trainer rules on the rest once it has chosen the tag)."""
    report = Report()
    grid = _check_grid(cfg, world_size, report)
    per_node = ranks_per_node or gpus_per_node
    if grid is not None and per_node and world_size > per_node:
        _check_node_span(grid, per_node, report)
    device_type = _target_device(cfg, gpus_per_node)
    _check_attention_backend(cfg, device_type, report)
    if cfg.train.compile:
        _check_compiler(device_type, report)
    lengths_ok = _check_lengths(cfg, report)
    synthetic = cfg.train.synthetic_data
    tokenizer = None
    if synthetic:
        report.info("data: synthetic tokens (train.synthetic_data): no corpus or tokenizer")
    elif check_data or check_eval:
        tokenizer = _check_tokenizer(cfg, report)
    if not synthetic and cfg.data.format == "text" and lengths_ok and (check_data or check_eval):
        _check_block_window(cfg, tokenizer, ranks_per_node or gpus_per_node or world_size,
                            report)
    sources_ok = True
    text_shards = None
    if check_data and not synthetic:
        before = len(report.problems)
        if cfg.data.format == "tokens":  # Hub sources refused before anything opens them
            _check_token_layout(cfg, report)
        if len(report.problems) == before:
            text_shards = _check_sources(cfg, tokenizer, report, limits,
                                         grid.dp if grid is not None else None)
        if cfg.data.format == "tokens" and tokenizer is not None \
                and len(report.problems) == before:
            _check_token_sources(cfg, tokenizer, grid, report)
        sources_ok = len(report.problems) == before
    # Held-out documents come from the sources too: a bad source is reported once, above.
    if check_eval and not synthetic and tokenizer is not None and sources_ok:
        _check_held_out(cfg, tokenizer, report, limits)
    # The plan (checkpoint size, memory, time) is for the dtype the run will resolve; the
    # resume check keeps `auto` (a resumed run keeps its checkpoint's dtype).
    planned = cfg
    if plan and cfg.train.dtype == "auto":
        planned = copy.deepcopy(cfg)
        planned.train.dtype = resolve_planning_dtype(cfg, device_type)
    _check_run_dir(planned, report, resume_from)
    if gpus_per_node is None:  # this machine's limit, where the run starts (not a plan for others)
        _check_file_size_limit(planned, world_size, report)
    if check_resume:  # the dry run and tape-submit; a real run takes the lock itself next
        _check_run_lock(cfg, report)
    if cfg.profile.enabled:
        _check_profile(cfg, world_size, device_type, report)
    if check_resume_data is None:
        check_resume_data = check_resume
    check_resume_data = (check_resume_data and check_data and not synthetic
                         and tokenizer is not None and sources_ok)
    if (check_resume and grid is not None) or check_resume_data:
        tag = _resume_tag(cfg, resume_from, report, quiet=not check_resume)
        if tag is not None and check_resume and grid is not None:
            _check_resume(cfg, grid, tag, allow_config_change, report)
        if tag is not None and check_resume_data:
            _check_resume_data(cfg, tag, tokenizer, text_shards, allow_config_change, report)
    if check_memory_floor and not plan and grid is not None and lengths_ok:
        _check_run_start_memory(cfg, world_size, device_type, ranks_per_node or world_size,
                                report)
    if plan and (grid is None or not lengths_ok):
        report.info("memory and time plan: skipped until the layout and train.seq_len are valid")
    elif plan:
        if planned is not cfg:
            report.info(f"precision: train.dtype=auto plans {planned.train.dtype} on "
                        f"{device_type}")
        if ranks_per_node is None:
            # no more than the run has ranks (--gpus-per-node 8 without --nodes plans one)
            ranks_per_node = min(gpus_per_node or (1 if device_type == "cuda" else world_size),
                                 world_size)
        _plan_memory(planned, world_size, device_type, ranks_per_node, device_memory_gb,
                     gpu_name, report)
        _plan_time(planned, grid, device_type, gpu_name, assumed_mfu, report, ranks_per_node)
    return report


# ------------------------------------------------------------------------------------------------
# Config-level checks
# ------------------------------------------------------------------------------------------------


def _check_attention_backend(cfg, device_type: str, report: Report) -> None:
    """An explicit ``model.attn_backend`` that cannot run for this encoding or on the target
    device (the model would raise at its first forward, after DeepSpeed start-up)."""
    from tape_train.model.config import CUDA_ONLY_BACKENDS

    backend, spec = cfg.model.attn_backend, cfg.model.encoding
    key = f"model.attn_backend={backend}"
    if backend == "flash" and not spec.flash_ok:
        report.problem(f"{key} does not support pe={cfg.model.pe} (a dense logit bias or a "
                       f"value wider than the head); use sdpa or auto")
    elif backend == "blocked" and spec.dense_bias:
        report.problem(f"{key} has no dense logit bias; pe={cfg.model.pe} needs sdpa, eager "
                       f"or auto")
    elif backend in CUDA_ONLY_BACKENDS and device_type != "cuda" \
            and not (backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"):
        report.problem(f"{key} needs a CUDA device, and this run trains on {device_type} "
                       f"(train.device={cfg.train.device}); use auto")
    elif backend == "flash" and cfg.train.dtype == "fp32":
        report.problem(f"{key} needs fp16/bf16 and train.dtype is fp32; use bf16, or "
                       f"attn_backend=auto")


def _check_compiler(device_type: str, report: Report) -> None:
    """``train.compile`` generates code at the first step: C++ on CPU (the compiler TorchInductor
    runs: ``$CXX``, else g++), Triton kernels on CUDA."""
    if device_type == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            report.problem("train.compile=true needs Triton on CUDA (TorchInductor generates "
                           "Triton kernels); pip install triton, or set train.compile=false")
        return
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        where = f"CXX={cxx}" if "CXX" in os.environ else "g++ (CXX is not set)"
        report.problem(f"train.compile=true on CPU needs a C++ compiler and {where} was not "
                       f"found on PATH: install g++ (apt install g++), point CXX at one, or set "
                       f"train.compile=false")


def _check_grid(cfg, world_size: int, report: Report):
    from tape_train.parallel import RankGrid

    p = cfg.parallel
    try:
        grid = RankGrid.from_sizes(world_size, dp=p.dp, sp=p.sp, tp=p.tp, rank=0)
        grid.check_model(cfg.model)
    except ValueError as exc:
        report.problem(f"parallel layout: {exc}")
        return None
    report.info(f"rank grid: world={world_size} dp={grid.dp} sp={grid.sp} tp={grid.tp}; "
                f"ZeRO-{p.zero_stage} partitions over dp×sp={grid.dp * grid.sp}; global batch "
                f"{global_batch(cfg, grid.dp)} sequences × {cfg.train.seq_len} tokens")
    if p.zero_stage > 1 and grid.dp * grid.sp == 1 and p.offload_params == "none":
        work = "per-block parameter gathers" if p.zero_stage == 3 else "gradient partitioning"
        report.info(f"hint: ZeRO-{p.zero_stage} over one rank partitions nothing; "
                    f"parallel.zero_stage=1 needs about the same memory per rank without "
                    f"ZeRO-{p.zero_stage}'s {work} (less work per step)")
    return grid


def _check_node_span(grid, per_node: int, report: Report) -> None:
    """Tensor- and sequence-parallel groups that cross nodes: legal, but their collectives
    (two all-reduces per layer forward and backward for tp, the attention all-to-alls for sp)
    then run over the network instead of NVLink. Ranks fill nodes in order (torchrun: node
    ``i`` holds ranks ``i·per_node …``) and groups are blocks of the rank array
    (``tape_train.parallel.grid``): a tp group stays on one node iff ``per_node % tp == 0``,
    a dp-row's sp×tp block iff ``per_node % (sp·tp) == 0``."""
    if grid.tp > 1 and per_node % grid.tp:
        report.warn(f"parallel.tp={grid.tp} with {per_node} ranks per node: tensor-parallel "
                    f"groups span nodes, so every layer's all-reduces cross the network (much "
                    f"slower than within a node); use a parallel.tp that divides {per_node}")
    elif grid.sp > 1 and per_node % (grid.sp * grid.tp):
        report.warn(f"parallel.sp={grid.sp} x tp={grid.tp} with {per_node} ranks per node: "
                    f"sequence-parallel groups span nodes, so every attention layer's "
                    f"all-to-alls cross the network; use sp x tp dividing {per_node}")


def global_batch(cfg, dp: int) -> int:
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps * dp


def _check_profile(cfg, world_size: int, device_type: str, report: Report) -> None:
    from tape_train.train.profiling import describe_plan

    lines, problems = describe_plan(cfg, world_size, device_type)
    report.lines.extend(lines)
    report.problems.extend(problems)


def _check_lengths(cfg, report: Report) -> bool:
    n, limit = cfg.train.seq_len, cfg.model.max_seq_len
    if n > limit:
        report.problem(f"train.seq_len={n} exceeds model.max_seq_len={limit}: train at most "
                       f"{limit} tokens per sequence, or raise model.max_seq_len (evaluation "
                       f"may go longer; training may not)")
        return False
    return True


# ------------------------------------------------------------------------------------------------
# Tokenizer and data
# ------------------------------------------------------------------------------------------------


def _check_tokenizer(cfg, report: Report):
    from tape_train.data import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(cfg.data.tokenizer)
    except TokenizerError as exc:
        report.problem(f"data.tokenizer: {exc}")
        return None
    vocab = cfg.model.vocab_size
    if tok.vocab_size > vocab:
        report.problem(f"data.tokenizer: {cfg.data.tokenizer} has {tok.vocab_size} tokens but "
                       f"model.vocab_size is {vocab}: token ids >= {vocab} would index past the "
                       f"embedding; use the model's tokenizer or set model.vocab_size="
                       f"{tok.vocab_size}")
    else:
        report.info(f"tokenizer: {cfg.data.tokenizer}: {tok.vocab_size} tokens "
                    f"(model.vocab_size {vocab})")
        if tok.vocab_size < vocab // 2:
            report.warn(f"data.tokenizer: {tok.vocab_size} tokens fill less than half of "
                        f"model.vocab_size={vocab}")
    return tok


def _check_block_window(cfg, tokenizer, ranks_here: int, report: Report) -> None:
    """Two block shuffle windows of ``W × (seq_len + 1)`` token ids per rank, held in host
    memory on every rank of a node, and one window tokenised before the first batch: a ``W``
    whose windows cannot fit in this machine's RAM is refused before anything is packed."""
    from tape_train.data.config import BLOCK_SHUFFLE_WINDOW
    from tape_train.data.tokens import token_dtype
    from tape_train.train.memory import device_memory

    window = cfg.data.block_window
    if window <= 1:
        return
    vocab = tokenizer.vocab_size if tokenizer is not None else cfg.model.vocab_size
    per_rank = 2 * window * (cfg.train.seq_len + 1) * token_dtype(vocab).itemsize
    have, source = device_memory("cpu")
    need = per_rank * ranks_here
    if need > have:
        report.problem(f"data.block_shuffle_window={window}: two windows of {window} blocks of "
                       f"{cfg.train.seq_len + 1} tokens hold {per_rank / GIB:.2f} GiB per rank, "
                       f"{need / GIB:.2f} GiB for {ranks_here} rank(s) here, more than the "
                       f"{have / GIB:.2f} GiB of {source}; lower it (default "
                       f"{BLOCK_SHUFFLE_WINDOW})")


def _check_sources(cfg, tokenizer, report: Report, limits: Limits, dp: int | None) -> list:
    """Each source resolves and its first documents read and tokenise; with ``dp`` ranks in
    text ``documents`` sharding, a source with fewer shards than ranks is a warning. Returns
    each local source's shards (``None`` for a Hub source, or one that did not resolve)."""
    from tape_train.data import DataError
    from tape_train.data.formats import SkipLog, hub_shards, read_documents, resolve_local_shards
    from tape_train.data.sources import shared_shard_warning

    resolved = []
    for source in cfg.data.sources:
        key = source.key
        skips = SkipLog()
        resolved.append(None)
        try:
            if source.hub is not None:
                dataset, shards = hub_shards(source)
            else:
                dataset, shards = None, resolve_local_shards(source, split="train")
                resolved[-1] = shards
        except DataError as exc:
            report.problem(str(exc) if str(exc).startswith(key) else f"{key}: {exc}")
            continue
        checked = shards[:limits.max_shards]
        docs = tokens = 0
        empty = []
        for shard in checked:
            found = 0
            try:
                for _, text in read_documents(shard, 0, source.text_field,
                                              cfg.data.skip_bad_records, skips, dataset):
                    if tokenizer is not None:
                        tokens += len(tokenizer.encode(text))
                    found += 1
                    if found >= limits.docs_per_shard:
                        break
            except DataError as exc:
                report.problem(f"{key}: {exc}")
                break
            except Exception as exc:  # noqa: BLE001 - a reader library's own error
                report.problem(f"{key}: {shard.path}: cannot read ({type(exc).__name__}: {exc})")
                break
            if not found:
                empty.append(shard.path)
            docs += found
        else:
            if not docs:
                what = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3
                                               else "")
                skipped = f"; skipped: {dict(skips.counts)}" if skips.counts else ""
                report.problem(f"{key}: no usable documents in {what} (empty file or only "
                               f"blank/skipped records){skipped}")
                continue
            unit = "file" if source.hub is None else "shard"
            more = f" (first {len(checked)} of {len(shards)} {unit}s checked)" \
                if len(shards) > len(checked) else ""
            report.info(f"{key}: {source.name}: {len(shards)} {unit}(s){more}, first {docs} "
                        f"document(s) read and tokenised ({tokens} tokens)")
            if dp is not None and cfg.data.format == "text" and cfg.data.sharding == "documents":
                shared = shared_shard_warning(source, len(shards), dp)
                if shared:
                    report.warn(shared)
            if empty:
                report.warn(f"{key}: {len(empty)} file(s) without usable documents, e.g. "
                            f"{empty[0]} (skipped during training)")
    return resolved


def _check_token_layout(cfg, report: Report) -> None:
    """``data.format: tokens`` reads prepared directories only: a Hub source is named at once,
    not streamed first (which without a network waits out the Hub's retries)."""
    from tape_train.data import DataError
    from tape_train.data.token_loader import token_directories

    try:
        token_directories(cfg.data)
    except DataError as exc:
        report.problem(str(exc))


def _check_token_sources(cfg, tokenizer, grid, report: Report) -> None:
    """``data.format: tokens``: the token shards match the tokenizer, the mixture is valid, and
    how often each source repeats."""
    from tape_train.data import DataError
    from tape_train.data.token_loader import open_token_sources, token_mixture

    try:
        sources = open_token_sources(cfg.data, tokenizer, cfg.train.seq_len)
        mixture = token_mixture(cfg.data, seed=0)
    except DataError as exc:
        report.problem(str(exc))
        return
    per_step = global_batch(cfg, grid.dp) if grid is not None else None
    for i, (source, blocks) in enumerate(zip(cfg.data.sources, sources)):
        share = 1.0 if mixture is None else mixture.weights[i] / mixture.total
        epoch = blocks.num_blocks / share  # global samples per epoch of this source
        when = f" ≈ {_count(epoch / per_step)} steps" if per_step else ""
        report.info(f"{source.key}: {_count(blocks.total_tokens)} tokens in "
                    f"{_count(blocks.num_blocks)} blocks of seq_len + 1, {share:.1%} of the "
                    f"samples: one epoch per {_count(epoch)} samples{when}")
        blocks.close()


def _check_held_out(cfg, tokenizer, report: Report, limits: Limits) -> None:
    """Held-out document lengths over the documents the evaluation will score."""
    from tape_train.data import DataError, iter_eval_documents

    if not cfg.eval.enabled:
        report.info("held-out documents: not checked (scheduled evaluation is off, "
                    "eval.interval=0)")
        return
    lengths = cfg.eval.resolve_lengths(cfg.train.seq_len)
    counts = dict.fromkeys(lengths, 0)
    budget = cfg.eval.max_tokens
    docs = predictions = longest = 0
    complete = True
    start = time.monotonic()
    try:
        for ids, _ in iter_eval_documents(cfg.data, tokenizer):
            docs += 1
            p = len(ids) - 1
            predictions += max(p, 0)
            longest = max(longest, p)
            for length in lengths:
                counts[length] += p >= length
            if budget is not None and predictions >= budget:
                break
            if time.monotonic() - start > limits.eval_seconds:
                complete = False
                break
    except DataError as exc:
        report.problem(f"eval: held-out documents: {exc}")
        return
    if docs == 0:
        report.problem("eval: no held-out document (data.eval_sources, data.eval_fraction, "
                       "data.eval_min_tokens leave none) although eval.interval > 0")
        return
    scope = (f"the {docs} documents eval.max_tokens={budget} scores" if complete and budget
             else f"{docs} documents ({'all' if complete else 'scanned in the time budget'})")
    report.info("held-out documents with at least L predictions, over " + scope + ": "
                + ", ".join(f"L={length}: {counts[length]}" for length in lengths))
    for length in lengths:
        if counts[length] == 0:
            line = (f"eval.lengths: no held-out document is longer than L={length} tokens "
                    f"(the longest has {longest} predictions); that length would only "
                    f"measure shorter contexts: drop it, or use "
                    f"longer held-out documents (data.eval_sources, data.eval_min_tokens)")
            (report.problem if complete else report.warn)(line)


# ------------------------------------------------------------------------------------------------
# Run directory and resume
# ------------------------------------------------------------------------------------------------


def checkpoint_bytes(cfg) -> int:
    """One checkpoint on disk: weights in the training dtype, fp32 master weights and AdamW
    moments (DeepSpeed keeps the fp32 copy also in fp32 runs, ZeRO-1/2/3), summed over ranks.
    ``auto`` counts as fp32, the larger (the dry run plans with the resolved dtype)."""
    from tape_train.model.flops import count_parameters

    n = count_parameters(cfg.model)["total"]
    weight_bytes = 2 if cfg.train.dtype == "bf16" else 4
    master = 4 if (cfg.train.dtype == "bf16" or cfg.parallel.zero_stage >= 1) else 0
    return n * (weight_bytes + master + 8)


def _check_run_dir(cfg, report: Report, resume_from=None) -> None:
    from tape_train.files import human_bytes, nearest_existing

    run_dir = Path(cfg.train.run_dir)
    existing = nearest_existing(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        report.problem(f"train.run_dir={run_dir}: exists and is not a directory")
        return
    from tape_train.checkpoint_layout import (checkpoint_root, find_latest_complete, list_tags,
                                              step_of_tag, stray_tag_file, stray_tag_files,
                                              why_incomplete)

    root = checkpoint_root(run_dir)
    # What the run writes into, of the wrong kind (a stray copy, a mistyped mkdir): the trainer
    # would meet it only after DeepSpeed's start-up, or at the first save.
    for path, is_dir in ((root, True), (run_dir / "metrics.jsonl", False),
                         (run_dir / "tensorboard", True)):
        if path.name == "tensorboard" and not cfg.logging.tensorboard:
            continue
        if path.exists() and path.is_dir() != is_dir:
            report.problem(f"train.run_dir={run_dir}: {path} is "
                           f"{'not a directory' if is_dir else 'a directory'}; the run writes "
                           f"{'into' if is_dir else 'to'} it: move it away")
            return
    # A file named like a tag this run may save (copied there by hand): the save of that step
    # would fail, a checkpoint interval's work (or a whole run) later. A resume from the newest
    # complete tag saves only the steps after it: one at or below it (an archived tag left as a
    # link, dangling where the archive is not mounted) is no problem; --resume-from an older
    # tag may save any.
    newest = find_latest_complete(run_dir, warn=False) if resume_from is None else None
    after = step_of_tag(newest.name) if newest is not None else 0
    stray = [p for p in stray_tag_files(root)
             if after < step_of_tag(p.name) <= cfg.train.max_steps]
    if stray:
        more = f" (and {len(stray) - 1} more like it)" if len(stray) > 1 else ""
        report.problem(f"train.run_dir={run_dir}: {stray[0]}: {stray_tag_file(stray[0])}{more}")
        return
    # Its checkpoints directory too, when there is one: a save there fails only after a
    # checkpoint interval's work.
    for probe in (existing, root) if root.is_dir() else (existing,):
        try:
            with tempfile.NamedTemporaryFile(dir=probe, prefix=".preflight-"):
                pass
        except OSError as exc:
            report.problem(f"train.run_dir={run_dir}: not writable ({probe}: "
                           f"{exc.strerror or exc})")
            return

    keep = cfg.checkpoint.keep
    one = checkpoint_bytes(cfg)
    # The next checkpoint is written before the oldest is deleted; complete checkpoints already
    # in the run dir (a resume) hold up to `keep` of those places.
    on_disk = min(keep, sum(why_incomplete(t) is None for t in list_tags(checkpoint_root(run_dir))))
    need = one * (keep + 1 - on_disk)
    free = shutil.disk_usage(existing).free
    what = (f"{human_bytes(free)} free, checkpoint.keep={keep} (+1 being written) checkpoints "
            f"of ~{human_bytes(one)}"
            + (f", {on_disk} of them already there," if on_disk else "")
            + f" need {human_bytes(need)}{' more' if on_disk else ''}")
    if free < need:
        report.problem(f"train.run_dir={run_dir}: {what}")
    else:
        report.info(f"run dir {run_dir}: writable; {what}")


def _check_file_size_limit(cfg, world_size: int, report: Report) -> None:
    """This process's file-size limit (``ulimit -f``) against the largest file of a checkpoint,
    counted low: the checkpoint's bytes spread evenly over two files per rank. A save would
    fail at the first checkpoint, a checkpoint interval's work after start-up."""
    import resource

    from tape_train.files import human_bytes

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    largest = checkpoint_bytes(cfg) // (2 * world_size)
    if limit != resource.RLIM_INFINITY and limit < largest:
        report.problem(f"this process's file-size limit (`ulimit -f`) is {human_bytes(limit)} "
                       f"({limit} bytes), and a checkpoint file of this run holds at least "
                       f"~{human_bytes(largest)}: raise or remove the limit")


def _check_run_lock(cfg, report: Report) -> None:
    """Whether another run holds the run directory's lock now (``run_lock.lock_refusal``, the
    trainer's own rule): a warning, since the job being planned may start after that run ended
    (a continuation queued behind it), but a run started now would be refused."""
    from tape_train.train.run_lock import lock_refusal

    refusal = lock_refusal(cfg.train.run_dir)
    if refusal is not None:
        report.warn(f"train.run_dir: {refusal} (a run started now would be refused; this plan "
                    f"holds for after it)")


def _resume_tag(cfg, resume_from, report: Report, quiet: bool = False) -> Path | None:
    """The checkpoint a resume would load: ``--resume-from``'s, else the newest complete one
    in the run dir (``None``: a new run). ``quiet``: say nothing (the trainer reports a bad
    ``--resume-from`` itself)."""
    from tape_train.train import checkpoint as ckpt

    try:  # quiet (a real run, every rank): sizes only; the trainer reads the checksums once,
        # each rank its share, when it chooses the tag
        tag = (ckpt.resolve_checkpoint(resume_from, verify=not quiet) if resume_from is not None
               else ckpt.find_latest_complete(cfg.train.run_dir, warn=False))
    except ckpt.CheckpointError as exc:
        if not quiet:
            report.problem(f"--resume-from: {exc}")
        return None
    if tag is not None and resume_from is not None:
        newest = ckpt.restart_resumes_newest(cfg.train.run_dir, tag)
        if newest is not None:  # what the trainer will do: the same rule
            if not quiet:
                report.info(f"resume: --resume-from {tag.name} is not applied again on this "
                            f"restart ({ckpt.restarts_described()}): the run has continued "
                            f"from it to {newest.name}")
            tag = newest
    if tag is None and not quiet:
        report.info("resume: no complete checkpoint in the run dir: a new run starts at step 0")
    return tag


def _check_resume(cfg, grid, tag: Path, allow_config_change: bool, report: Report) -> None:
    from tape_train.train import checkpoint as ckpt
    from tape_train.train import relayout

    try:
        marker = ckpt.read_marker(tag)
    except (OSError, ValueError) as exc:
        report.problem(f"resume: {tag}: unreadable marker ({exc})")
        return
    moved = relayout.plan(marker, cfg, grid)
    route = moved.describe() if moved else "same layout, direct load"
    report.info(f"resume: {tag} (step {marker.get('step')}, {marker.get('tokens_seen')} tokens; "
                f"{route})")
    newest = ckpt.find_latest_complete(cfg.train.run_dir, warn=False)
    step = ckpt.step_of_tag(tag.name)
    if newest is not None and step is not None and ckpt.step_of_tag(newest.name) > step:
        root = ckpt.checkpoint_root(cfg.train.run_dir)
        report.warn(f"resume: {tag.name} is older than this run dir's newest checkpoint "
                    f"{newest.name}: the run will move the checkpoints after step {step} to "
                    f"{root / ckpt.SUPERSEDED}/<time>/ (nothing is deleted) and continue from "
                    f"step {step}")
    found, changes = relayout.resume_config_problems(marker, cfg, grid)
    impossible = relayout.unloadable(marker, cfg)
    if impossible is not None:  # --allow-config-change cannot make it load
        report.problem(f"resume from {tag}: {impossible}")
    if changes.moved:  # whether it is the same data there: _check_resume_data
        report.info(f"resume: the data moved ({changes.describe('moved')}); the data check "
                    f"below compares what it is, not where it lies")
    from tape_train.train.optim import lr_change_at_resume

    lr_change = lr_change_at_resume((marker.get("config") or {}).get("train") or {}, cfg.train,
                                    int(marker.get("step") or 0))
    if lr_change is not None:
        report.warn(f"resume: {lr_change}")
    for line in found:
        if allow_config_change:
            report.warn(f"resume: {line} (allowed by --allow-config-change)")
        else:
            report.problem(f"resume from {tag}: {line}")


def _check_resume_data(cfg, tag: Path, tokenizer, text_shards: list | None,
                       allow_config_change: bool, report: Report) -> None:
    """The data-loader state a resume would load (saved rank 0's: every rank's fingerprint is
    the same, and rank 0 continues rank 0 on any layout) against the data as it is now: a
    source file added, removed, re-ordered, of another size or edited at the same size, a
    directory re-prepared, a weight, the tokenizer or a packing option changed. Reads file
    names, sizes, manifests and a content sample of each raw file (at most 1 MiB each).
    Hub sources are not compared (they are listed only online)."""
    from tape_train.data import DataError
    from tape_train.data.loader import resume_differences
    from tape_train.train import checkpoint as ckpt

    try:
        state = ckpt.read_rank_state(tag, 0).get("loader")
    except (ckpt.CheckpointError, AttributeError) as exc:
        report.warn(f"resume: the data-loader state of {tag} was not checked: {exc}")
        return
    if not isinstance(state, dict) or "fingerprint" not in state:
        return  # synthetic data, or a loader without a data fingerprint
    try:
        differences = resume_differences(state, cfg.data, tokenizer, cfg.train.seq_len,
                                         cfg.train.seed, text_shards)
    except DataError as exc:  # a source that does not resolve is reported with the sources
        report.warn(f"resume: the data-loader state of {tag} was not checked: {exc}")
        return
    hub = any(s.hub is not None for s in cfg.data.sources)
    unchecked = " (Hub sources not compared: listed only online)" if hub else ""
    if not differences:
        report.resume_data_fits = tag
        report.info(f"resume: the data-loader state of {tag.name} fits the data "
                    f"(fingerprint {state['fingerprint']}){unchecked}")
        return
    line = (f"its data-loader state does not fit the data this run would read: data "
            f"fingerprint differs in {', '.join(differences)}{unchecked}")
    if allow_config_change:
        report.warn(f"resume from {tag.name}: {line}; resuming from the saved position anyway "
                    f"(allowed by --allow-config-change)")
    else:
        report.problem(f"resume from {tag}: {line}. Restore the data as it was, start a new "
                       f"run in another train.run_dir, or pass --allow-config-change to "
                       f"resume from the saved position anyway")


# ------------------------------------------------------------------------------------------------
# Plan: memory and time
# ------------------------------------------------------------------------------------------------


def _target_device(cfg, gpus_per_node: int | None) -> str:
    if gpus_per_node is not None:
        return "cuda" if gpus_per_node > 0 else "cpu"
    if cfg.train.device != "auto":
        return cfg.train.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _plan_memory(cfg, world_size: int, device_type: str, ranks_per_node: int,
                 device_memory_gb: float | None, gpu_name: str | None, report: Report) -> None:
    from tape_train.train.memory import CPU_RUNTIME_BYTES, device_memory, estimate_memory

    if device_memory_gb is not None:
        have, source = int(device_memory_gb * 10**9), "--device-memory-gb"
    else:
        have, source = device_memory(device_type, gpu_name)
    per_node = ranks_per_node if device_type == "cpu" else 1
    who = (f"{ranks_per_node} rank(s) on this node need" if device_type == "cpu"
           else "one rank needs")
    if not _check_memory_floor([cfg], world_size, device_type, ranks_per_node, have, source,
                               report):
        return  # nothing traced: the trace of a size far too large takes hours, or overflows
    est = estimate_memory(cfg, world_size, device_type=device_type)
    offload = [f"{key}={getattr(cfg.parallel, key)}" for key in ("offload_optimizer",
               "offload_params") if getattr(cfg.parallel, key) != "none"]
    report.info(f"memory per rank (ZeRO-{cfg.parallel.zero_stage}"
                f"{', ' + ', '.join(offload) if offload else ''}, tp={cfg.parallel.tp}, "
                f"sp={cfg.parallel.sp}, micro-batch {cfg.train.micro_batch_size}, seq_len "
                f"{cfg.train.seq_len}, {cfg.train.dtype}, {device_type}):")
    report.lines.extend(est.lines())
    if est.host_bytes:
        report.info(f"host memory: {ranks_per_node} rank(s) per node hold ~"
                    f"{est.host_bytes * ranks_per_node / GIB:.2f} GiB of offloaded states, "
                    f"besides each process's own (~{CPU_RUNTIME_BYTES / GIB:.2f} GiB)")
    if have is None:
        report.info(f"device memory: unknown ({source})")
        return
    need = est.total_bytes * per_node
    line = (f"memory: {who} ~{need / GIB:.2f} GiB of {have / GIB:.2f} GiB ({source})")
    if need > have:
        hint = ("turn on train.activation_checkpointing, " if not
                cfg.train.activation_checkpointing else "")
        report.problem(f"{line}: does not fit; {hint}lower train.micro_batch_size, raise "
                       f"parallel.zero_stage or use more ranks")
    else:
        report.info(line)
        if need > 0.9 * have:
            report.warn(f"{line}: above 90 % of the device")
    if est.evaluation is not None:
        _plan_eval_memory(est.evaluation, per_node, who, have, source, report)


def _check_run_start_memory(cfg, world_size: int, device_type: str, ranks_per_node: int,
                            report: Report) -> None:
    """A run's start: the memory floor against the available RAM (CPU, all ranks of the node
    together) or the GPU's total memory (CUDA, per rank: ``torch.cuda.get_device_properties``),
    before the process group, the model and a loader that would pack a micro-batch of 1e20
    rows for ever. With ``train.dtype: auto`` (resolved later, or kept from a checkpoint)
    refused only when neither bf16 nor fp32 fits."""
    from tape_train.train.memory import device_memory

    candidates = [cfg]
    if cfg.train.dtype == "auto":
        candidates = []
        for dtype in ("bf16", "fp32"):
            candidates.append(copy.deepcopy(cfg))
            candidates[-1].train.dtype = dtype
    have, source = device_memory(device_type)
    _check_memory_floor(candidates, world_size, device_type, ranks_per_node, have, source,
                        report)


# A lower bound above this is refused even where the device's memory is unknown (planning
# for CUDA without --gpu-name): no device has a pebibyte, and the trace of such a size would
# take hours or overflow torch's 64-bit element counts.
_NO_DEVICE_HOLDS = 2**50


def _check_memory_floor(candidates: list, world_size: int, device_type: str,
                        ranks_per_node: int, have: int | None, source: str,
                        report: Report) -> bool:
    """Refuse, before anything is built or traced, a run whose memory floor
    (``memory.memory_floor``: the model states and the layer inputs of one micro-batch, one
    hidden state of the scheduled evaluation, from the config alone) exceeds the device. One
    config per precision the run may take (``train.dtype: auto`` at a run's start: bf16 and
    fp32); refused only when none fits, with the problems of the one needing least. True when
    it fits."""
    from tape_train.train.memory import memory_floor

    per_node = ranks_per_node if device_type == "cpu" else 1
    who = (f"{ranks_per_node} rank(s) on this node need" if device_type == "cpu"
           else "one rank needs")
    if have is None:
        have, source = _NO_DEVICE_HOLDS, f"1 PiB, more than any device has; {source}"
    found = []
    for cfg in candidates:
        floor = memory_floor(cfg, world_size, device_type=device_type)
        problems = _floor_problems(cfg, floor, per_node, who, have, source)
        if not problems:
            return True
        found.append((floor.step, problems))
    for problem in min(found, key=lambda f: f[0])[1]:
        report.problem(problem)
    return False


def _floor_problems(cfg, floor, per_node: int, who: str, have: int, source: str) -> list[str]:
    train, of = cfg.train, f"of {_gib(have)} GiB ({source})"
    if floor.model_states * per_node > have:
        return [f"memory: {who} more than {_gib(floor.model_states * per_node)} GiB {of} for "
                f"the weights, gradients and AdamW states alone: does not fit; use a smaller "
                f"model, raise parallel.zero_stage or use more ranks"]
    problems = []
    if floor.step * per_node > have:
        problems.append(
            f"memory: {who} more than {_gib(floor.step * per_node)} GiB {of} for the model "
            f"states and the layer inputs one micro-batch keeps for the backward "
            f"(train.micro_batch_size={train.micro_batch_size} sequences of train.seq_len="
            f"{train.seq_len} tokens) alone: does not fit; lower train.micro_batch_size "
            f"(raise train.grad_accum_steps to keep the global batch)")
    if floor.evaluation * per_node > have:
        length = max(cfg.eval.resolve_lengths(train.seq_len))
        problems.append(
            f"memory for the scheduled evaluation (eval.batch_size={cfg.eval.batch_size} "
            f"windows of {length} tokens, the longest of eval.lengths): {who} more than "
            f"{_gib(floor.evaluation * per_node)} GiB {of} for the model states and one hidden "
            f"state of the batch alone: does not fit; lower eval.batch_size or the longest of "
            f"eval.lengths")
    return problems


def _gib(n: int) -> str:
    """Bytes as GiB for a message: two decimals, or three digits and an exponent past a
    million GiB (a micro-batch of 1e20 sequences)."""
    gib = n / GIB
    return f"{gib:.2f}" if gib < 1e6 else f"{gib:.3g}"


def _plan_eval_memory(ev, per_node: int, who: str, have: int, source: str,
                      report: Report) -> None:
    """The scheduled evaluation beside the model states: refused like a step that does not
    fit, at start-up rather than at the first ``eval.interval`` hours later."""
    need = ev.total_bytes * per_node
    line = (f"memory for the scheduled evaluation (eval.batch_size={ev.batch} windows of "
            f"{ev.length} tokens, the longest of eval.lengths): {who} ~{need / GIB:.2f} GiB of "
            f"{have / GIB:.2f} GiB ({source})")
    if need > have:
        report.problem(f"{line}: does not fit; lower eval.batch_size or the longest of "
                       f"eval.lengths")
    elif need > 0.9 * have:
        report.warn(f"{line}: above 90 % of the device")
    else:
        report.info(line)


def planning_peak_tflops(cfg, device_type: str, gpu_name: str | None = None,
                         ranks_per_node: int = 1) -> tuple[float | None, str]:
    """Peak TFLOP/s per rank for the time plan: ``logging.peak_tflops``, else the GPU table,
    else a short GEMM measurement on this CPU (with the threads each of ``ranks_per_node``
    ranks would have). The one place the plan gets its peak."""
    import torch

    from tape_train.train.memory import dtype_of
    from tape_train.train.peak import cpu_rank_peak_tflops, gpu_table_peak, tf32_matmuls

    if cfg.logging.peak_tflops is not None:
        return cfg.logging.peak_tflops, "logging.peak_tflops"
    dtype = dtype_of(cfg)
    if device_type == "cuda":
        name = gpu_name or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
        if not name:
            return None, ("GPU model unknown here: pass --gpu-name (e.g. 'H100') or set "
                          "logging.peak_tflops")
        peak = gpu_table_peak(name, dtype, tf32=tf32_matmuls(dtype))
        if peak is None:
            return None, f"no table peak for GPU {name!r}: set logging.peak_tflops"
        return peak, f"published dense peak of {name}"
    return cpu_rank_peak_tflops(dtype, ranks_per_node)


def resolve_planning_dtype(cfg, device_type: str) -> str:
    """``train.dtype`` as the planned run will resolve it: ``auto`` on CUDA plans bf16 (every
    GPU in the peak table has native bf16; the run itself checks its device); on CPU this
    machine's choice (``tape_train.precision``)."""
    if cfg.train.dtype != "auto":
        return cfg.train.dtype
    if device_type == "cuda":
        return "bf16"
    from tape_train.precision import resolve_dtype

    return resolve_dtype("auto", "cpu").dtype


def _plan_time(cfg, grid, device_type: str, gpu_name: str | None, mfu: float,
               report: Report, ranks_per_node: int = 1) -> None:
    from tape_train.model.flops import count_parameters, training_flops_per_token

    n = cfg.train.seq_len
    per_token = training_flops_per_token(cfg.model, n, micro_batch=cfg.train.micro_batch_size)
    params = count_parameters(cfg.model)["total"]
    tokens = global_batch(cfg, grid.dp) * n
    report.info(f"model: {params / 1e6:.2f}M parameters; {per_token / 1e9:.3f} GFLOP per token "
                f"(training, N={n}); {tokens} tokens per step")
    peak, source = planning_peak_tflops(cfg, device_type, gpu_name, ranks_per_node)
    if not peak:
        report.info(f"time: no device peak ({source})")
        return
    step = tokens * per_token / (peak * 1e12 * grid.world_size * mfu)
    total = step * cfg.train.max_steps
    report.info(f"time: peak {peak:.3g} TFLOP/s per rank ({source}); at an assumed MFU of "
                f"{mfu:.0%}: ~{step:.3g} s per step, ~{_duration(total)} for train.max_steps="
                f"{cfg.train.max_steps} ({_count(cfg.train.max_steps * tokens)} tokens)")


def _count(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days" if seconds < 1e6 * 86400 else f"{seconds / 86400:.3g} days"


def format_report(report: Report, prefix: str = "tape-train") -> tuple[str, str]:
    """(stdout text: the plan, stderr text: warnings and problems, one line each)."""
    out = "\n".join(report.lines) + "\n"
    err = "".join(f"{prefix}: preflight: warning: {w}\n" for w in report.warnings)
    err += "".join(f"{prefix}: preflight: error: {p}\n" for p in report.problems)
    return out, err

