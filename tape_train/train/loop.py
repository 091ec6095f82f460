"""The training loop: set-up, resume, token-weighted steps, metrics, evaluation, checkpoints.

``Trainer(cfg).run()`` returns the process exit code (0 finished, 75 stopped on SIGUSR1/SIGTERM
after a checkpoint, 130 on SIGINT after a checkpoint, 1 error). Every rank runs the same code;
all decisions that must agree (stop, skip a non-finite update) go through one all-reduce.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tape_train.config import RunConfig
from tape_train.data.config import DataError
from tape_train.devices import (DeviceError, LaunchError, check_device, launch_int,
                                speaks_for_node)
from tape_train.eval.perplexity import UnmeasuredLengthError
from tape_train.files import FileWriteError, write_atomic
from tape_train.train import checkpoint as ckpt
from tape_train.train import distributed as tdist
from tape_train.train import relayout
from tape_train.train import restarts
from tape_train.train.engine import build_engine, count_target_tokens, forward_backward
from tape_train.host_memory import keep_freed_memory
from tape_train.train.cuda_allocator import RetryWatch
from tape_train.train.metrics import (MetricsWriter, format_summary, memory_metrics,
                                      quiet_library_deprecations, read_metrics, setup_logging)
from tape_train.train.optim import LRSchedule, lr_change_at_resume
from tape_train.train.peak import checked_mfu, device_peak_tflops
from tape_train.precision import PrecisionChoice, deterministic_algorithms, resolve_dtype
from tape_train.train.preflight import PreflightError
from tape_train.train.profiling import RunProfiler
from tape_train.train.run_lock import RunLock, RunLockError
from tape_train.train.signals import StopRequest
from tape_train.train.watchdog import STARTUP_KEY, STEP_KEY, Watchdog, describe_collective_error

log = logging.getLogger("tape_train.train")

EXIT_OK, EXIT_ERROR = 0, 1
EXIT_FILE_ENV = "TAPE_TRAIN_EXIT_FILE"
EXIT_FILE_READER_ENV = "TAPE_TRAIN_EXIT_FILE_READER"  # the pid of the launcher that reads it

LoaderFactory = Callable[[int, int], object]  # (dp_rank, dp_size) -> resumable loader


@dataclass
class TrainState:
    """Run-level counters saved in every checkpoint."""

    step: int = 0                # optimizer steps done
    tokens_seen: int = 0         # input tokens consumed, all ranks
    skipped_steps: int = 0       # non-finite updates skipped in the whole run
    bad_steps_in_row: int = 0


class RestartRefused(Exception):
    """torchrun restarted the workers, and ``tape_train.train.restarts`` refuses the restart
    (no progress, a stop, the limit): every rank ends with exit 0 so that torchrun stops
    restarting; the launcher reads the recorded verdict and fails or requeues the job."""


class StoppedDuringSetup(Exception):
    """A stop signal arrived before the first step; ``code`` is the exit code it asks for,
    ``where`` the point of start-up that honoured it ("after the process-group start")."""

    def __init__(self, code: int, where: str, signal_name: str | None) -> None:
        super().__init__(f"stopped during start-up ({where})")
        self.code, self.where, self.signal_name = code, where, signal_name


class ResumeRefused(ckpt.CheckpointError):
    """A resume refused for what the checkpoint's marker and this run's config say: every rank
    decides it alike, so it is said once per node, not once per rank."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """One training run. ``setup()`` then ``train()``; or ``run()`` for both plus clean-up.

    Args:
        cfg: the resolved run config.
        resume_from: a run dir, checkpoint root or tag dir to resume from; ``None`` resumes
            from the latest complete checkpoint of ``cfg.train.run_dir`` if there is one.
        allow_config_change: resume even if protected config keys differ from the checkpoint.
        loader_factory: ``(dp_rank, dp_size) -> loader`` (tests inject synthetic data);
            default ``tape_train.data.build_train_loader`` on ``cfg.data``.
        eval_documents: ``() -> iterable of (token_ids, n_bytes)``; default
            ``tape_train.data.iter_eval_documents``.
        stop: the stop-signal flag, when the caller installed it already (the CLI does, before
            the heavy imports); else one is created and installed by ``setup``.
    """

    def __init__(self, cfg: RunConfig, *, resume_from: str | Path | None = None,
                 allow_config_change: bool = False, loader_factory: LoaderFactory | None = None,
                 eval_documents: Callable[[], Iterable] | None = None,
                 stop: StopRequest | None = None, choose_cpu_threads: bool = False) -> None:
        """``choose_cpu_threads``: on CPU without ``OMP_NUM_THREADS``, set torch's threads from
        the cores idle at start-up (``tape_train.cpu_threads``; the command line asks for it,
        as ``launch/local.sh`` does for what it starts)."""
        self.cfg = cfg
        self.choose_cpu_threads = choose_cpu_threads
        self.resume_from = resume_from
        self.allow_config_change = allow_config_change
        self.loader_factory = loader_factory
        self.eval_documents_fn = eval_documents
        self.run_dir = Path(cfg.train.run_dir)
        self.state = TrainState()
        self.stop = stop or StopRequest()
        self.writer: MetricsWriter | None = None
        self._eval_docs = None
        self._last_saved_step = -1
        # Tags skipped at resume because a file failed its checksum: rotation keeps
        # checkpoint.keep intact ones besides them (they are rewritten when the replay gets there).
        self._damaged_tags: set[str] = set()
        # The checkpoint whose data-loader state the start-up checks found to fit the data.
        self._resume_data_fits: Path | None = None
        self.lock: RunLock | None = None
        self.watchdog: Watchdog | None = None
        self._restore_algorithms = None
        self._timeout_in_force: float | None = None
        self._stepped = False      # a step ran in this process (the first compiles, autotunes)
        self._batches_read = False  # the first step's batches were read (a stop is heard then)
        self._read_grad_norm = True  # for the next train_step(); train() sets it per step
        self._in_train = False     # inside train(): a phase lasts until the next one starts
        self._attempt: int | None = None  # in-job restart attempt (restarts.guarded() only)
        self.profiler = RunProfiler()  # off until set-up knows the rank and the device
        self._retries = RetryWatch(None, 0, None)  # watches from the start of train()

    # ------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------

    def setup(self) -> None:
        self.stop.install()  # early: a stop signal during set-up ends it at the next phase
        self.watchdog = Watchdog(launch_int("RANK"), before_exit=self._hung_exit)
        try:
            self._setup()
        finally:  # start-up is over (or failed): whatever the caller does next is not in it
            self.watchdog.disarm()

    def _setup(self) -> None:
        cfg = self.cfg
        # Before any CUDA work: cuBLAS reads its workspace setting when it starts.
        self._restore_algorithms = deterministic_algorithms(cfg.train.deterministic)
        self._phase("start-up (preflight checks and process-group start)", long=True)
        self._preflight()
        from tape_train.parallel import RankGrid

        # The rank grid is validated before any process group exists (bad layouts fail here);
        # the model's fit to sp/tp was checked once, when RunConfig was built.
        world = launch_int("WORLD_SIZE")
        self.grid = RankGrid.from_sizes(world, dp=cfg.parallel.dp, sp=cfg.parallel.sp,
                                        tp=cfg.parallel.tp, rank=launch_int("RANK"))
        # The CUDA allocator's setting is made in there, as soon as the device is chosen.
        self.dist = tdist.init_distributed(cfg.train.device, cfg.train.startup_timeout_s,
                                           cfg.train.cuda_expandable_segments)
        self.rank = self.dist.rank
        setup_logging(self.rank, cfg.logging.all_ranks)
        quiet_library_deprecations()
        self.profiler = RunProfiler(cfg.profile, self.run_dir, self.rank, self.dist.device,
                                    cfg.train.max_steps)
        self.profiler.record_memory()
        self._stop_point("process-group start")
        if self.dist.device.type == "cpu" and cfg.train.keep_freed_memory:
            keep_freed_memory()
        if self.choose_cpu_threads and self.dist.device.type == "cpu":
            self._choose_cpu_threads()  # started by hand (launch/local.sh chooses the same)
        self.grid.build()
        # Data is sharded over dp only: every rank of an SP/TP group gets the same batch.
        self.dp_size, self.dp_rank = self.grid.dp_size, self.grid.dp_rank
        requeues = os.environ.get("SLURM_RESTART_COUNT", "0")
        log.info("%s", self._preflight_summary)
        allocator = self.dist.cuda_allocator
        if allocator is not None:
            (log.warning if allocator.reserved_before_gib else log.info)(
                "%s", allocator.describe())
        if cfg.train.deterministic:
            log.info("deterministic algorithms on (train.deterministic): CUBLAS_WORKSPACE_CONFIG=%s, "
                     "cuDNN without autotuning, atomic-free attention backward",
                     os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        log.info("tape-train: world size %d (%s), device %s, run dir %s, "
                 "SLURM_RESTART_COUNT=%s TORCHELASTIC_RESTART_COUNT=%s", self.dist.world_size,
                 self.grid.describe(), self.dist.device, self.run_dir, requeues,
                 os.environ.get("TORCHELASTIC_RESTART_COUNT", "-"))

        self._take_run_lock()
        self._check_restart()
        # Find the checkpoint and compare configs before building anything expensive.
        self._resume_tag = self._find_resume_checkpoint()
        self._relayout = None
        marker = ckpt.read_marker(self._resume_tag) if self._resume_tag is not None else None
        self._resolve_dtype(marker)
        if marker is not None:
            self._relayout = relayout.plan(marker, cfg, self.grid)
            self._check_config(marker, self._resume_tag)
            step = int(marker.get("step") or 0)
            if step >= cfg.train.max_steps and self._finished(step):
                # Nothing to train or evaluate: no DeepSpeed start-up and checkpoint load (minutes
                # on a large model) just for train() to say so, no event or config.yaml written.
                self.state.step = step
                return
            if self._relayout is not None and self._relayout.universal:
                self._convert_to_universal(self._resume_tag)

        # Same seed on every rank for the weights (ZeRO partitions each rank's copy), then a
        # per-rank stream for anything stochastic during training.
        seed_everything(cfg.train.seed)
        from tape_train.model import TransformerLM
        from tape_train.parallel import parallelize

        self.model = parallelize(TransformerLM(cfg.model), self.grid)
        self.engine, self.optimizer = build_engine(
            cfg, self.model, self.grid,
            load_universal=self._relayout is not None and self._relayout.universal)
        self._stop_point("DeepSpeed engine start")
        seed_everything(cfg.train.seed + 1_000_003 * self.rank)
        self.schedule = LRSchedule.from_config(cfg.train)

        # Measure the CPU GEMM peak before the loader's prefetch thread exists: tokenising in
        # the background during the measurement would lower the peak and inflate every MFU.
        self._setup_mfu()
        self.loader = self._build_loader()
        resumed_from = self._maybe_resume()
        self.data_iter = iter(self.loader)
        self._stop_point("data loader and resume")
        superseded = self._set_aside_newer_checkpoints() if resumed_from else None

        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.run_dir / "config.yaml", cfg.to_yaml())
        self.writer = MetricsWriter(self.run_dir, enabled=self.rank == 0,
                                    tensorboard=cfg.logging.tensorboard,
                                    resume_step=self.state.step,
                                    wandb=cfg.logging.wandb, run_config=cfg.to_dict())
        self.writer.write("event", self.state.step, {
            "event": "resume" if resumed_from else "start", "checkpoint": resumed_from,
            "world_size": self.dist.world_size, "slurm_restart_count": int(requeues or 0),
            "layout": relayout.current_layout(self.grid),
            "relayout_from": self._relayout.saved if resumed_from and self._relayout else None,
            "superseded_checkpoints": superseded,
            "code_version": ckpt.code_version(), "mfu_basis": self._mfu_basis})

    def _set_aside_newer_checkpoints(self) -> str | None:
        """After a resume from an older tag than the run dir's newest (``--resume-from``), move
        the newer complete tags out of the way (``ckpt.set_aside_newer``), so that the new
        trajectory's saves, rotation and a later re-run never take them for its own. Rank 0
        moves, under the lock; every rank learns whether it failed. Returns where they went."""
        moved, dest, error = [], None, None
        if self.rank == 0:
            try:
                moved, dest = ckpt.set_aside_newer(ckpt.checkpoint_root(self.run_dir),
                                                   self.state.step, owner=self.lock,
                                                   damaged=self._damaged_tags)
            except ckpt.CheckpointError as exc:
                error = exc
        if tdist.all_reduce_max_int(1 if error is not None else 0):
            raise error or ckpt.CheckpointError("rank 0 could not move the newer checkpoints "
                                                "aside (see its log)")
        if not moved:
            return None
        log.warning("resumed from step %d, but this run dir had newer checkpoints of the run "
                    "as it went on from there (%s): moved to %s, so that this run, which "
                    "continues from step %d, never takes them for its own; nothing was deleted "
                    "(tape-eval and tape-export read them there; they are not rotated: delete "
                    "that directory when you no longer need them)", self.state.step,
                    ", ".join(t.name for t in moved), dest, self.state.step)
        return str(dest)

    def _preflight(self) -> None:
        """The dry run's input checks (tokenizer, data, held-out lengths, layout, lengths, run
        dir, and whether the data-loader state a resume would load fits the data) on every
        rank before any process group or DeepSpeed exists: a bad input costs seconds and one
        line per problem, not a DeepSpeed start-up and a traceback."""
        from tape_train.train.preflight import RUN_START_LIMITS, PreflightError, run_preflight

        start = time.perf_counter()
        world = launch_int("WORLD_SIZE")
        report = run_preflight(
            self.cfg, world_size=world,
            ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)),  # torchrun's
            check_data=self.loader_factory is None,
            check_eval=self.eval_documents_fn is None and self.cfg.eval.enabled,
            check_resume=False, check_resume_data=True, resume_from=self.resume_from,
            allow_config_change=self.allow_config_change, plan=False, limits=RUN_START_LIMITS,
            check_memory_floor=True)
        try:  # the dry run plans for the cluster's devices; this run needs them here
            check_device(self.cfg.train.device, launch_int("LOCAL_RANK"))
        except DeviceError as exc:
            report.problem(str(exc))
        if report.problems:
            raise PreflightError(report.problems)
        self._resume_data_fits = report.resume_data_fits
        self._preflight_summary = (f"preflight: inputs checked in "
                                   f"{time.perf_counter() - start:.1f} s"
                                   + "".join(f"; warning: {w}" for w in report.warnings))

    def _stop_point(self, phase: str) -> None:
        """Honour a stop signal that arrived during start-up (collective: every rank calls it
        at the same phases). Nothing was trained, so there is nothing to save: exit at once
        with the signal's code (75 requeues the job), leaving the run directory as it was."""
        code = self.stop.agreed(tdist.all_reduce_max_int)
        if code:
            raise StoppedDuringSetup(code, f"after the {phase}", self.stop.signal_name)
        self._phase(f"start-up (after the {phase})", long=True)

    def _phase(self, name: str, *, long: bool) -> None:
        """Start a phase of the run on this rank (``tape_train.train.watchdog``): the collective
        timeout in force, and the watchdog's budget (half of it). ``long``: start-up, the first
        step of the process, an evaluation or a save (``train.startup_timeout_s``); else a
        training step (``train.collective_timeout_s``). Collective when it shortens the
        timeout: a barrier, still under the longer one, first waits for every rank to end the
        longer phase (a slow rank might otherwise still be in it when the others time out)."""
        if self.watchdog is None:  # not set up (tests call methods directly)
            return
        train = self.cfg.train
        timeout, key = ((train.startup_timeout_s, STARTUP_KEY) if long
                        else (train.collective_timeout_s, STEP_KEY))
        if self._timeout_in_force is not None and timeout < self._timeout_in_force:
            tdist.barrier()
        tdist.set_collective_timeout(timeout)
        self._timeout_in_force = timeout
        self.watchdog.arm(name, timeout, key)

    @contextlib.contextmanager
    def _watched(self, name: str, *, long: bool):
        """A step, an evaluation or a save as a phase. Inside ``train()`` the phase lasts until
        the next one starts (it also covers the loop's metrics writes and stop check); called
        on its own (benchmarks, tests) it ends with the call, so the caller's time between
        calls is not charged to it."""
        self._phase(name, long=long)
        try:
            yield
        finally:
            if not self._in_train and self.watchdog is not None:
                self.watchdog.disarm()

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def _hung_exit(self) -> None:
        """The watchdog ends this rank: say so to the next attempt, release the lock."""
        self._record_end(1, "stuck (its watchdog ended it; its log has the stacks)")
        self._release_lock()

    def _check_restart(self) -> None:
        """Under torchrun with restarts (``restarts.guarded()``): rank 0 numbers this attempt
        and, on a restart, logs why the last attempt ended or refuses the restart; every rank
        records where it runs. Collective."""
        if not restarts.guarded():
            return
        attempt, verdict = 0, None
        if self.rank == 0:
            attempt, verdict, line = restarts.begin_attempt(
                self.run_dir, self.dist.world_size,
                int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))
            if line:
                log.warning("%s", line)
        self._attempt = tdist.all_reduce_max_int(attempt)
        restarts.record_rank(self.run_dir, self._attempt, self.rank)
        if tdist.all_reduce_max_int(1 if verdict else 0):
            raise RestartRefused(verdict[1] if verdict else "restart refused (rank 0 says why)")

    def _record_end(self, code: int, reason: str) -> None:
        if self._attempt is not None and code != 0:
            restarts.record_rank(self.run_dir, self._attempt, getattr(self, "rank", 0),
                                 code=code, reason=reason)

    def _build_loader(self):
        if self.loader_factory is not None:
            return self.loader_factory(self.dp_rank, self.dp_size)
        train = self.cfg.train
        if train.synthetic_data:
            from tape_train.data.synthetic import SyntheticLoader

            return SyntheticLoader(self.cfg.model.vocab_size, train.seq_len,
                                   train.micro_batch_size, train.grad_accum_steps, self.dp_rank,
                                   self.dp_size, train.seed, train.synthetic_mask_fraction)
        from tape_train.data import build_train_loader, load_tokenizer

        self.tokenizer = load_tokenizer(self.cfg.data.tokenizer)
        if self.tokenizer.vocab_size > self.cfg.model.vocab_size:
            raise ValueError(f"tokenizer {self.cfg.data.tokenizer} has {self.tokenizer.vocab_size}"
                             f" tokens but model.vocab_size is {self.cfg.model.vocab_size}")
        return build_train_loader(self.cfg.data, self.tokenizer, seq_len=self.cfg.train.seq_len,
                                  micro_batch_size=self.cfg.train.micro_batch_size,
                                  dp_rank=self.dp_rank, dp_size=self.dp_size,
                                  seed=self.cfg.train.seed)

    def _take_run_lock(self) -> None:
        """Rank 0 takes ``<run_dir>/RUN.lock``; every rank stops if it could not."""
        error = None
        if self.rank == 0:
            try:
                self.lock = RunLock(self.run_dir).acquire()
            except RunLockError as exc:
                error = exc
        if tdist.all_reduce_max_int(1 if error is not None else 0):
            raise error or RunLockError(f"rank 0 could not take the lock of run directory "
                                        f"{self.run_dir} (see its log)")

    def _find_resume_checkpoint(self) -> Path | None:
        """The checkpoint to resume from, its checksums verified collectively (each rank
        reads its share of the files). A damaged explicit choice is refused; in the run dir,
        damaged tags are skipped with a warning naming the file."""
        if self.resume_from is not None:
            tag_dir = ckpt.resolve_checkpoint(self.resume_from, verify=False)
            if self._continued_since(tag_dir):
                return ckpt.find_latest_intact(self.run_dir, warn=self.rank == 0,
                                               damaged=self._damaged_tags)
            reason = ckpt.verify_checkpoint(tag_dir)
            if reason is not None:
                raise ckpt.CheckpointError(f"checkpoint {tag_dir}: {reason}; "
                                           f"refusing to resume from it")
            return tag_dir
        return ckpt.find_latest_intact(self.run_dir, warn=self.rank == 0,
                                       damaged=self._damaged_tags)

    def _continued_since(self, tag_dir: Path) -> bool:
        """Whether ``--resume-from tag_dir`` is not to be applied again
        (``ckpt.restart_resumes_newest``: a restart of the job, and the run dir has a newer
        complete checkpoint, written since that rewind or fork, which moved the abandoned newer
        tags aside): resuming from ``tag_dir`` again would throw that progress away on every
        requeue. Rank 0 decides; collective."""
        newest = ckpt.restart_resumes_newest(self.run_dir, tag_dir) if self.rank == 0 else None
        if not tdist.all_reduce_max_int(1 if newest is not None else 0):
            return False
        if self.rank == 0:
            log.warning("--resume-from %s is not applied again on this restart (%s): the run "
                        "has continued from it to %s since; resuming from the newest intact "
                        "checkpoint, as any restart does", tag_dir, ckpt.restarts_described(),
                        newest.name)
        return True

    def _maybe_resume(self) -> str | None:
        tag_dir = self._resume_tag
        if tag_dir is None:
            return None
        moved = self._relayout
        meta, rank_state = ckpt.load_training_state(
            self.engine, tag_dir, self.rank, universal=moved is not None and moved.universal,
            other_layout=moved is not None,
            state_rank=relayout.source_rank(moved.saved, self.grid) if moved else self.rank)
        self.state = TrainState(**meta["train_state"])
        ckpt.restore_rng_state(rank_state["rng"])
        if rank_state.get("loader") is not None:
            try:
                self.loader.load_state_dict(rank_state["loader"],
                                            allow_mismatch=self.allow_config_change)
            except DataError as exc:  # e.g. the corpus changed since the checkpoint
                raise DataError(f"resuming from {tag_dir}: {exc}") from None
        self._last_saved_step = self.state.step
        log.info("resumed from %s at step %d (%d tokens seen)", tag_dir, self.state.step,
                 self.state.tokens_seen)
        if moved is not None:
            log.info("resumed on another layout: %s; the global token stream, step, token "
                     "counters and learning-rate schedule continue (per-rank random streams "
                     "are re-assigned: see tape_train.train.relayout)", moved.describe())
        return str(tag_dir)

    @staticmethod
    def _choose_cpu_threads() -> None:
        """torch's default, a thread per core, is the slowest choice on a machine whose other
        work keeps cores busy: threads as ``tape_train.cpu_threads`` chooses them, unless
        ``OMP_NUM_THREADS`` chose."""
        from tape_train.cpu_threads import adopt_torch_threads

        adopt_torch_threads(launch_int("LOCAL_WORLD_SIZE"),
                            lambda level, text: log.log(level, "%s", text))

    def _convert_to_universal(self, tag_dir: Path) -> None:
        """Rank 0 converts the checkpoint (once, cached in the tag) while the others wait; a
        failure is raised on every rank.

        The conversion may take longer than ``train.startup_timeout_s`` (minutes on a large
        model): the ranks do not wait for it in one collective but in a beat, a small
        all-reduce every few seconds through which rank 0 says whether the conversion moved
        (wrote, printed or computed anything) since the last one. Each rank's watchdog is told
        of that progress, so only a conversion that stops moving counts as a hang: rank 0's watchdog
        ends it after half the timeout without progress, and the waiting ranks' beat then fails
        in one line.

        Each beat is followed by the stop agreement (``StopRequest.agreed``), so a stop signal
        ends the conversion within one beat on every rank: rank 0's converter (which ignores
        the stop signals itself) is killed and its partial output removed, the checkpoint is
        untouched, and every rank raises ``StoppedDuringSetup``. Collectives pair up: every
        beat is an all-reduce then the agreement on every rank, and rank 0's final word
        (done or failed) is one all-reduce that the others take in place of a beat's."""
        still, moved, done, failed = 0, 1, 2, 3  # rank 0's beat; the others send 0
        self._phase(f"start-up (converting {tag_dir.name} to the universal format)", long=True)
        beat_s = min(5.0, self.cfg.train.startup_timeout_s / 8)

        def beat(moving: bool) -> int:
            state = tdist.all_reduce_max_int(moved if moving else still)
            if state >= done:  # rank 0 has finished (only the waiting ranks see this)
                return state
            if state == moved and self.watchdog is not None:
                self.watchdog.progress()
            code = self.stop.agreed(tdist.all_reduce_max_int)
            if code:
                raise StoppedDuringSetup(
                    code, f"in the universal conversion of {tag_dir.name}, whose partial "
                    f"output was removed; the next run converts it again",
                    self.stop.signal_name)
            return state

        error = None
        if self.rank == 0:
            try:
                ckpt.ensure_universal(tag_dir, tick=beat, tick_s=beat_s,
                                      tensor_parallel=self.grid.tp > 1,
                                      zero_stage=self.cfg.parallel.zero_stage)
            except StoppedDuringSetup:
                raise  # every rank raised it in the same beat: no final word to pair up
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                if describe_collective_error(exc, self.watchdog, self.rank) is not None:
                    raise  # a beat failed: the ranks are not in step any more
                error = exc
            state = tdist.all_reduce_max_int(failed if error is not None else done)
        else:
            while (state := beat(False)) < done:
                pass
        if state == failed:
            if error is not None:
                raise error if isinstance(error, ckpt.CheckpointError) else ckpt.CheckpointError(
                    f"converting {tag_dir} to the universal format failed: {error}") from error
            raise ckpt.CheckpointError(f"converting {tag_dir} to the universal format failed "
                                       f"on rank 0 (see its log)")

    def _resolve_dtype(self, marker: dict | None) -> None:
        """Resolve ``train.dtype`` in place (``auto`` -> ``bf16``/``fp32``) before anything is
        built or saved, so config.yaml and checkpoints record the precision really used. A
        resumed ``auto`` run keeps its checkpoint's dtype (another machine may resolve ``auto``
        differently); rank 0 decides and every rank follows."""
        train = self.cfg.train
        requested = train.dtype
        saved = ((marker or {}).get("config") or {}).get("train", {}).get("dtype")
        if requested == "auto" and saved in ("bf16", "fp32"):
            choice = PrecisionChoice(saved, "kept from the checkpoint being resumed")
        else:
            choice = resolve_dtype(requested, self.dist.device.type) if self.rank == 0 else None
            bf16 = tdist.all_reduce_max_int(int(choice is not None and choice.dtype == "bf16"))
            if choice is None:
                choice = PrecisionChoice("bf16" if bf16 else "fp32", "chosen on rank 0")
        if self.rank == 0:
            log.info("%s", choice.log_line(requested))
            if choice.warning:
                log.warning("%s", choice.warning)
        train.dtype = choice.dtype
        self.dtype = choice.torch_dtype

    def _check_config(self, marker: dict, tag_dir: Path) -> None:
        """The preflight's rule (``relayout.resume_config_problems``) on the checkpoint this
        run chose: a refusal names only what would corrupt the run, one ``key: old -> new``
        each; a moved corpus or tokenizer is one line, the other changes are listed and
        applied."""
        impossible = relayout.unloadable(marker, self.cfg)
        if impossible is not None:  # not even with --allow-config-change
            raise ResumeRefused(f"cannot resume from {tag_dir}: {impossible}")
        found, changes = relayout.resume_config_problems(marker, self.cfg, self.grid)
        where = f" ({self._relayout.describe()})" if self._relayout is not None else ""
        if found and not self.allow_config_change:
            raise ResumeRefused(
                f"refusing to resume from {tag_dir}{where}: " + "; ".join(found)
                + ". Use another train.run_dir for a new run, or pass --allow-config-change "
                  "to resume anyway (the run then differs from the one that was saved)")
        for line in found:
            log.warning("resuming from %s%s although %s (allowed by --allow-config-change)",
                        tag_dir, where, line)
        if changes.moved and not self.cfg.train.synthetic_data:
            checked = self._resume_data_fits is not None \
                and self._resume_data_fits.resolve() == Path(tag_dir).resolve()
            log.info("resuming from %s: the data moved (%s); %s", tag_dir,
                     changes.describe("moved"),
                     "the resume data check found the same data there (file names, sizes, "
                     "content samples, token manifests, the tokenizer's sha256)" if checked else
                     "the data loader compares what it is with the checkpoint's when it loads "
                     "its state")
        listed = sorted(changes.layout + changes.applied + changes.protected)
        if listed:
            lines = "\n".join(f"  {k}: {old!r} -> {new!r}" for k, old, new in listed)
            log.warning("config differs from checkpoint %s:\n%s", tag_dir, lines)
        lr_change = lr_change_at_resume((marker.get("config") or {}).get("train") or {},
                                        self.cfg.train, int(marker.get("step") or 0))
        if lr_change is not None:
            log.warning("resuming from %s: %s", tag_dir, lr_change)

    def _setup_mfu(self) -> None:
        from tape_train.model.flops import training_flops_per_token

        self.flops_per_token = training_flops_per_token(
            self.cfg.model, self.cfg.train.seq_len, micro_batch=self.cfg.train.micro_batch_size)
        self.peak_tflops = None
        self._peak_may_be_low = False
        self._mfu_warned = False
        self._mfu_basis: dict | None = None
        if self.rank == 0:
            self.peak_tflops, source, low = device_peak_tflops(self.dist.device, self.dtype,
                                                               self.cfg.logging.peak_tflops)
            self._peak_may_be_low = low
            # What every `mfu` of this process divides by, recorded in the start/resume event.
            self._mfu_basis = {"flops_per_token": self.flops_per_token,
                               "peak_tflops_per_rank": self.peak_tflops,
                               "peak_source": source, "peak_may_be_low": low}
            (log.warning if low else log.info)(
                "MFU: %.3g GFLOP/token (train, N=%d); peak %s TFLOP/s per rank (%s)%s",
                self.flops_per_token / 1e9, self.cfg.train.seq_len,
                f"{self.peak_tflops:.3g}" if self.peak_tflops else "unknown", source,
                ": every MFU of this run may be too high by as much; set "
                "logging.peak_tflops, or start on an idle machine, which measures the peak "
                "again and caches it" if low else "")
        # Rank 0's peak on every rank (`logging.all_ranks` lines show MFU too), sent once here,
        # not per step. It is the job's per-rank peak (MFU divides by it times the world size),
        # and measuring on every rank at once would have CPU ranks compete for the cores. The
        # broadcast also holds the other ranks until rank 0 has measured, for the same reason.
        peak, low = tdist.broadcast_floats([self.peak_tflops or 0.0,
                                            float(self._peak_may_be_low)])
        self.peak_tflops, self._peak_may_be_low = peak or None, bool(low)

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------

    def _next_micro_batches(self) -> tuple[list[dict], float]:
        start = time.perf_counter()
        if self._batches_read:
            batches = [next(self.data_iter) for _ in range(self.cfg.train.grad_accum_steps)]
        else:
            batches = self._first_micro_batches()
            self._batches_read = True
        return batches, time.perf_counter() - start

    def _first_micro_batches(self) -> list[dict]:
        """The process's first step's micro-batches, read while the ranks agree on a stop
        signal every second. The first batch may take long (a loader filling its first
        shuffle window, a slow file system, a network source), and a SIGTERM then was acted on
        only after it, a step and a checkpoint later. Stopped here, nothing new was trained:
        ``StoppedDuringSetup``, nothing saved, the signal's exit code. Collective: every rank
        beats until all have their batches; a rank whose read fails raises at once, as its
        plain read did."""
        import threading

        got: dict = {}
        device = self.dist.device

        def read() -> None:
            try:
                # The current CUDA device is per thread, and a new one starts on cuda:0: a
                # loader that pins or moves its batches would put them on another rank's GPU.
                if device.type == "cuda" and device.index is not None:
                    torch.cuda.set_device(device)
                got["batches"] = [next(self.data_iter)
                                  for _ in range(self.cfg.train.grad_accum_steps)]
            except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
                got["error"] = exc

        reader = threading.Thread(target=read, name="tape-first-batch", daemon=True)
        reader.start()
        while True:
            reader.join(timeout=1.0)
            alive = reader.is_alive()  # not alive: it has left batches or an error
            if not alive and "error" in got:
                raise got["error"]
            code = self.stop.agreed(tdist.all_reduce_max_int)
            if code:  # the reader, a daemon, ends with the process
                raise StoppedDuringSetup(code, "while waiting for the first batch",
                                         self.stop.signal_name)
            if not tdist.all_reduce_max_int(int(alive)):
                return got["batches"]

    def train_step(self) -> dict:
        """One optimizer step on every rank; returns its metrics (same on all ranks).

        ``grad_norm`` is None on the steps ``train()`` does not log: it is not read back from
        the device there (on a GPU reading it waits for the optimizer step to finish before
        the host may queue the next step). A call from elsewhere reads it. (No argument for
        this: code that wraps ``train_step`` keeps working.)"""
        read_grad_norm, self._read_grad_norm = self._read_grad_norm, True
        first = not self._stepped  # of this process: compilation, autotuning, cold caches
        self._stepped = True
        with self._watched(f"step {self.state.step + 1}"
                           + (" (the first of this process)" if first else ""), long=first):
            return self._train_step(read_grad_norm)

    def _logs_step(self, step: int) -> bool:
        """Whether ``train()`` writes or prints the metrics of ``step``."""
        logging_cfg, last = self.cfg.logging, step == self.cfg.train.max_steps
        return last or step % logging_cfg.interval == 0 or step % logging_cfg.console_interval == 0

    def _train_step(self, read_grad_norm: bool = True) -> dict:
        cfg = self.cfg
        label = self.profiler.label
        step_start = time.perf_counter()
        with label("data"):
            micro_batches, data_wait = self._next_micro_batches()
        with label("sync"):
            local_tokens = count_target_tokens(micro_batches)
            # The sp·tp ranks of a data-parallel rank hold the same (unsharded) micro-batches.
            model_parallel = self.grid.sp * self.grid.tp
            global_tokens = int(tdist.all_reduce_sum(
                torch.tensor([local_tokens]))[0]) // model_parallel
        lr = cfg.train.lr * self.schedule(self.state.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        agreed: dict = {}

        def agree_before_update(local_loss_sum: torch.Tensor) -> None:
            # One all-reduce: a NaN/inf anywhere makes the global sum non-finite on all ranks.
            # Each sequence chunk's loss is held by the tp ranks of its group: count it once.
            with label("sync"):
                total = float(tdist.all_reduce_sum(
                    local_loss_sum.reshape(1).clone())[0]) / self.grid.tp
            agreed["loss_sum"] = total
            agreed["skip"] = not math.isfinite(total) or global_tokens == 0
            self.optimizer.skip_next_step = agreed["skip"]

        try:
            forward_backward(self.engine, micro_batches, grid=self.grid,
                             global_tokens=global_tokens, before_last_step=agree_before_update,
                             label=label)
        finally:
            self.optimizer.skip_next_step = False
        step_time = time.perf_counter() - step_start

        input_tokens = sum(mb["input_ids"].numel() for mb in micro_batches) * self.dp_size
        self.state.step += 1
        self.state.tokens_seen += input_tokens
        if agreed["skip"]:
            self.state.skipped_steps += 1
            self.state.bad_steps_in_row += 1
            log.warning("step %d: loss is %s (or no target tokens); update skipped (%d in a "
                        "row)", self.state.step, agreed["loss_sum"], self.state.bad_steps_in_row)
        else:
            self.state.bad_steps_in_row = 0
        grad_norm = self.engine.get_global_grad_norm() if read_grad_norm else None
        grad_norm = float(grad_norm) if grad_norm is not None else None
        tokens_per_s = input_tokens / step_time
        metrics = {
            "loss": agreed["loss_sum"] / max(global_tokens, 1),
            "lr": lr,
            "grad_norm": None if agreed["skip"] else grad_norm,
            "tokens_per_s": tokens_per_s,
            "tokens_seen": self.state.tokens_seen,
            "target_tokens": global_tokens,
            "step_time_s": step_time,
            "data_wait_frac": data_wait / step_time,
            "skipped_steps": self.state.skipped_steps,
        }
        if self.peak_tflops:
            achieved = tokens_per_s * self.flops_per_token / self.dist.world_size  # per rank
            metrics["mfu"] = checked_mfu(achieved, self.peak_tflops)
            if (metrics["mfu"] is None and not self._mfu_warned
                    and (self.rank == 0 or self.cfg.logging.all_ranks)):
                self._mfu_warned = True
                log.warning("MFU would be %.0f%% (%.3f achieved vs %.3f peak TFLOP/s per rank): "
                            "the peak is wrong, MFU is not reported; set logging.peak_tflops",
                            100 * achieved / (self.peak_tflops * 1e12), achieved / 1e12,
                            self.peak_tflops)
        return metrics

    def train(self) -> int:
        cfg = self.cfg
        max_steps = cfg.train.max_steps
        if self.state.step >= max_steps:
            if self._finished():
                log.info("run already complete: step %d of train.max_steps=%d (raise "
                         "train.max_steps to continue it)", self.state.step, max_steps)
                return EXIT_OK
            if self.state.step > max_steps:  # lowered below the checkpoint: end the run here
                log.warning("train.max_steps=%d is below the step of the checkpoint resumed "
                            "(%d): nothing to train; ending the run at step %d with its final "
                            "evaluation (the weights of an earlier step are in an older "
                            "checkpoint, if one is kept: tape-export or --resume-from its tag "
                            "directory)", max_steps, self.state.step, self.state.step)
            else:  # killed after its last checkpoint, during the final evaluation: finish that
                log.warning("step %d is checkpointed but the run stopped before its final "
                            "evaluation was recorded; running it now", self.state.step)
            self._finish()
            return EXIT_OK
        bar = self._progress_bar()
        exit_code = EXIT_OK
        self._watch_retries()
        self._in_train = True
        self.profiler.start(self.state.step + 1)
        try:
            while self.state.step < max_steps:
                self._profile_before_step()
                self._read_grad_norm = self._logs_step(self.state.step + 1)
                metrics = self.train_step()
                step = self.state.step
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
                if step % cfg.logging.interval == 0 or step == max_steps:
                    self._log_step(step, metrics)
                if step % cfg.logging.console_interval == 0 or step == max_steps:
                    self._console(format_summary(step, max_steps, metrics,
                                                 self._peak_may_be_low), bar)
                if cfg.eval.enabled and step % cfg.eval.interval == 0 and step < max_steps:
                    self.evaluate()
                if self.state.bad_steps_in_row >= cfg.train.max_bad_steps:
                    self.save()
                    log.error("stopping: %d consecutive steps with a non-finite loss "
                              "(train.max_bad_steps); checkpoint %s written",
                              self.state.bad_steps_in_row, ckpt.tag_for_step(step))
                    return EXIT_ERROR
                stop_code = self.stop.agreed(tdist.all_reduce_max_int)
                if stop_code:
                    self.save()
                    log.warning("stopping on %s at step %d after writing a checkpoint; exit %d",
                                self.stop.signal_name or "a signal on another rank", step,
                                stop_code)
                    self.writer.write("event", step, {"event": "stop", "exit_code": stop_code})
                    return stop_code
                if step % cfg.checkpoint.interval == 0:
                    self.save()
            if self._last_saved_step != self.state.step:
                self.save()
            self._finish()
            return exit_code
        finally:
            # Every way out of the loop saved a checkpoint last, under the long timeout: a
            # window whose steps all ran is written in that phase, one cut short is not.
            self.profiler.finish(self.state.step)
            self._in_train = False
            if self.watchdog is not None:  # its last phase (the final evaluation) is over
                self.watchdog.disarm()
            if bar is not None:
                bar.close()

    def _watch_retries(self) -> None:
        """From now on, warn when the CUDA allocator retries (``_log_step``); the retries of
        set-up so far are not counted. Nothing to watch off CUDA."""
        retries = memory_metrics(self.dist.device).get("mem/cuda_alloc_retries")
        self._retries = RetryWatch(retries, self.state.step, self.dist.cuda_allocator,
                                   self.cfg.train.activation_checkpointing)

    def _log_step(self, step: int, metrics: dict) -> None:
        """A logged step's metrics with this rank's memory figures (written on rank 0), and on
        every rank the warning when its CUDA allocator's retry count has grown
        (``tape_train.train.cuda_allocator.RetryWatch``)."""
        memory = memory_metrics(self.dist.device)
        self.writer.write("train", step, {**metrics, **memory})
        warning = self._retries.check(step, memory.get("mem/cuda_alloc_retries"))
        if warning is not None:
            log.warning("%s", warning)

    def _profile_before_step(self) -> None:
        """Profiling before the next step (``tape_train.train.profiling``): writing a window's
        files (seconds to minutes for a large trace) is a phase of every rank, under the long
        timeout, whether or not the rank profiles."""
        step = self.state.step + 1
        if not self.profiler.ends_window_before(step):
            self.profiler.before_step(step)
            return
        with self._watched(f"writing the profile of the steps before step {step}", long=True):
            self.profiler.before_step(step)

    def _finish(self) -> None:
        """The final evaluation and the ``done`` event, after the last checkpoint."""
        if self.cfg.eval.enabled:
            self.evaluate()
        self.writer.write("event", self.state.step, {"event": "done"})
        self.writer.flush()

    def _finished(self, step: int | None = None) -> bool:
        """Whether ``metrics.jsonl`` records a ``done`` event at ``step`` (default: the current
        one; rank 0 reads it; every rank gets the verdict). A run killed during its final
        evaluation has its last checkpoint but no such event, and must not be taken for
        complete."""
        step = self.state.step if step is None else step
        missing = 0
        if self.rank == 0:
            missing = int(not any(e.get("event") == "done" and e.get("step") == step
                                  for e in read_metrics(self.run_dir, "event")))
        return not tdist.all_reduce_max_int(missing)

    def _progress_bar(self):
        if self.rank != 0:
            return None
        from tape_train.progress import progress_bar

        return progress_bar(self.cfg.train.max_steps, initial=self.state.step, unit="step",
                            mode=self.cfg.logging.progress_bar)

    def _console(self, line: str, bar) -> None:
        if self.rank != 0 and not self.cfg.logging.all_ranks:
            return
        prefix = f"[rank{self.rank}] " if self.cfg.logging.all_ranks else ""
        if bar is not None:
            bar.write(prefix + line, file=sys.stdout)
        else:
            print(prefix + line, flush=True)

    # ------------------------------------------------------------------------------------------
    # Evaluation and checkpoints
    # ------------------------------------------------------------------------------------------

    def evaluate(self) -> list[dict]:
        """Perplexity at every (length, protocol) of ``cfg.eval`` on the held-out stream.

        Every rank holds the same documents and scores its share of the windows (ZeRO-3 gathers
        parameters collectively in each forward, so all ranks run the same number of
        forwards); the (nll, tokens, bytes) sums are all-reduced, so every rank gets the same
        results. RNG states are saved and restored around it so evaluation never changes the
        training trajectory.
        """
        with self._watched(f"the evaluation at step {self.state.step}", long=True), \
                self.profiler.label("evaluation"):
            return self._evaluate()

    def _evaluate(self) -> list[dict]:
        from tape_train.eval.perplexity import evaluate_schedule, scalar_metrics

        if self._eval_docs is None:
            source = self._eval_document_source()
            self._eval_docs = source if isinstance(source, list) else list(source)
        rng = ckpt.capture_rng_state()
        start = time.perf_counter()
        model = self.engine
        if self.grid.sp > 1:  # windows longer than one rank holds: cut over the SP group
            from tape_train.parallel import SequenceParallelEvalModel

            model = SequenceParallelEvalModel(self.engine, self.grid)
        # Windows are shared out over dp only; the sp·tp ranks of a dp rank report the same
        # sums, so the world all-reduce counts each of them sp·tp times.
        replicas = self.grid.sp * self.grid.tp
        results = evaluate_schedule(model, self._eval_docs, self.cfg.eval,
                                    train_seq_len=self.cfg.train.seq_len,
                                    reduce=lambda t: tdist.all_reduce_sum(t) / replicas,
                                    dp_rank=self.dp_rank, dp_size=self.dp_size,
                                    heartbeat=self.watchdog.progress if self.watchdog else None)
        ckpt.restore_rng_state(rng)
        scalars = scalar_metrics(results)
        self.writer.write("eval", self.state.step, {**scalars, "results": results,
                                                    "eval_time_s": time.perf_counter() - start})
        for r in results:
            if not r.get("measured", True):
                why = ("eval.max_tokens ended the scoring before a full window"
                       if r.get("cut_by_max_tokens")
                       else "no held-out document reaches this length")
                self._console(f"eval step {self.state.step} | {r['protocol']} L={r['length']} | "
                              f"n/a: {why}", None)
                continue
            self._console(f"eval step {self.state.step} | {r['protocol']} L={r['length']} | "
                          f"ppl {r['perplexity']:.3f} | bpb {r['bits_per_byte']:.4f} | "
                          f"tokens {r['tokens']}"
                          f"{' (capped: eval.max_tokens)' if r.get('capped') else ''} | "
                          f"at L: {r['documents_at_length']} docs "
                          f"{r['windows_at_length']} windows"
                          f"{' (few tokens)' if r['few_tokens'] else ''}", None)
        return results

    def _eval_document_source(self) -> Iterable:
        if self.eval_documents_fn is not None:
            return self.eval_documents_fn()
        if self.cfg.train.synthetic_data:
            from tape_train.data.synthetic import synthetic_held_out

            longest = max(self.cfg.eval.resolve_lengths(self.cfg.train.seq_len))
            return synthetic_held_out(self.cfg.model.vocab_size, longest, self.cfg.train.seed)
        from tape_train.data import iter_eval_documents, load_tokenizer

        if getattr(self, "tokenizer", None) is None:
            self.tokenizer = load_tokenizer(self.cfg.data.tokenizer)
        docs = iter_eval_documents(self.cfg.data, self.tokenizer, byte_ends=True)
        if self.cfg.eval.max_tokens is None:
            return docs
        from tape_train.eval.perplexity import HeldOutDocuments, materialize_documents

        kept = materialize_documents(docs, self.cfg.eval.max_tokens)
        plain = HeldOutDocuments((t.tolist(), n, ends) for t, n, ends in kept)
        plain.capped = kept.capped    # each result says whether the cap cut the held-out set
        return plain

    def save(self) -> Path:
        with self._watched(f"the checkpoint save at step {self.state.step}", long=True), \
                self.profiler.label("checkpoint"):
            return self._save()

    def _save(self) -> Path:
        meta = {
            "train_state": vars(self.state).copy(),
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "world_size": self.dist.world_size,
            "dp_size": self.dp_size,
            "layout": relayout.current_layout(self.grid),
            "zero_stage": self.cfg.parallel.zero_stage,
            "dtype": self.cfg.train.dtype,
            "config": self.cfg.to_dict(),
            "code_version": ckpt.code_version(),
            # What the config's relative paths (data, tokenizer) are relative to, for the
            # readers of this checkpoint that run elsewhere (checkpoint_layout.launch_dirs).
            "launch_dir": os.getcwd(),
        }
        rank_state = {"rng": ckpt.capture_rng_state(),
                      "loader": self.loader.state_dict() if hasattr(self.loader, "state_dict")
                      else None}
        path = ckpt.save_checkpoint(self.engine, self.run_dir, self.state.step, rank=self.rank,
                                    meta=meta, rank_state=rank_state,
                                    keep=self.cfg.checkpoint.keep, owner=self.lock,
                                    damaged=self._damaged_tags)
        self._damaged_tags.discard(path.name)  # rewritten, if it was one
        self._last_saved_step = self.state.step
        self.writer.write("event", self.state.step, {"event": "checkpoint", "path": str(path)})
        return path

    # ------------------------------------------------------------------------------------------

    def close(self) -> None:
        self.profiler.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self._restore_algorithms is not None:
            self._restore_algorithms()
            self._restore_algorithms = None
        self.stop.close()
        if self.writer is not None:
            self.writer.close()
        closer = getattr(self.loader, "close", None) if hasattr(self, "loader") else None
        if callable(closer):
            closer()
        if self.lock is not None:
            self.lock.release()

    def run(self) -> int:
        """set-up + train + clean-up; errors are logged and mapped to exit code 1."""
        code = EXIT_ERROR
        reason = "an unexpected exception (its traceback is in this rank's log)"
        try:
            self.setup()
            code = self.train()
            reason = "stopped on a signal" if code else ""
        except RestartRefused as refused:
            if self.rank == 0:
                log.error("%s", refused)
            code, reason = EXIT_OK, ""
        except (ckpt.CheckpointError, RunLockError, UnmeasuredLengthError, FileWriteError,
                DataError, DeviceError, LaunchError) as exc:  # they name the file, key or value
            if not isinstance(exc, ResumeRefused) or speaks_for_node():
                log.error("%s", exc)
            code, reason = EXIT_ERROR, str(exc)
        except PreflightError as exc:
            if speaks_for_node():  # once per node
                for line in exc.problems:
                    print(f"tape-train: preflight: error: {line}", file=sys.stderr, flush=True)
            code = EXIT_ERROR
        except StoppedDuringSetup as stop:
            log.warning("stopping on %s during start-up (%s), before the first step: "
                        "nothing to save; exit %d", stop.signal_name or "a signal on another "
                        "rank", stop.where, stop.code)
            code = stop.code
        except torch.OutOfMemoryError as exc:  # with its traceback, and a snapshot if recorded
            self._out_of_memory()
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        except RuntimeError as exc:  # a collective timed out, or a peer went away: one line
            line = describe_collective_error(exc, self.watchdog, getattr(self, "rank", 0))
            if line is None:
                reason = f"RuntimeError: {exc}".splitlines()[0]
                raise
            log.error("%s", line)
            code, reason = EXIT_ERROR, line
        except Exception as exc:  # with its traceback; the next attempt names it
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        finally:
            self._record_end(code if code is not None else EXIT_ERROR, reason)
            self.close()
            _write_exit_file(code if code is not None else EXIT_ERROR)
        return code

    def _out_of_memory(self) -> None:
        """Out of memory ends the run: one line naming the phase, and the CUDA allocator's
        snapshot if ``profile.memory_snapshot`` recorded one (``after_out_of_memory``)."""
        phase = self.watchdog.phase if self.watchdog is not None else None
        where = phase[0] if phase else "start-up"
        device = self.dist.device if hasattr(self, "dist") else None
        path = self.profiler.after_out_of_memory(self.state.step, where)
        profile = self.cfg.profile
        hint = ""
        if path is not None:
            hint = f"; its memory snapshot is {path} (open it at pytorch.org/memory_viz)"
        elif device is not None and device.type == "cuda" and not (profile.enabled
                                                                    and profile.memory_snapshot):
            hint = (" (profile.enabled=true profile.memory_snapshot=true records a memory "
                    "snapshot of the next one: docs/training.md, \"Profiling a run\")")
        if "evaluation" in where:
            hint += (f"; an evaluation forward holds eval.batch_size={self.cfg.eval.batch_size} "
                     f"windows of the longest of eval.lengths: lower eval.batch_size (the "
                     f"dry run's memory plan has a line for the scheduled evaluation)")
        log.error("out of memory on %s in %s%s", device or "the device", where, hint)


def _write_exit_file(code: int) -> None:
    """Under torchrun a worker's exit code is lost (torchrun exits 1 for any failure): the
    launcher passes ``TAPE_TRAIN_EXIT_FILE`` and reads the intended code back (75 → requeue).
    A launcher that names itself in ``TAPE_TRAIN_EXIT_FILE_READER`` (its pid) and is gone
    (SIGKILLed: its own clean-up never ran) reads nothing: the file is removed instead."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    if not _process_alive(os.environ.get(EXIT_FILE_READER_ENV)):
        Path(path).unlink(missing_ok=True)
        return
    try:
        write_atomic(path, f"{code}\n")
    except OSError as exc:
        log.warning("could not write exit code to %s: %s", path, exc)


def _process_alive(pid: str | None) -> bool:
    """Whether the process ``pid`` (decimal text) exists; ``True`` when none is named."""
    if not pid or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, but not ours to signal
        return True
    return True

