"""Checkpoint layout, atomic saving and resuming. Discovery, validation and model loading (the
read side, shared with eval and inference) live in ``tape_train.loading`` and are re-exported
here.

Layout of a run directory::

    <run_dir>/checkpoints/
        latest                         text: tag of the newest complete checkpoint (a hint;
                                       discovery scans the tags and trusts markers only)
        step_00000100/                 one tag per saved optimizer step
            zero_pp_rank_*_mp_rank_00_{model,optim}_states.pt   DeepSpeed's shards
            trainer_state_rank00000.pt one per rank: RNG states, data-loader state
            COMPLETE.json              written last, by rank 0, after every rank finished:
                                       step, tokens, layout (dp, sp, tp), resolved config,
                                       code version, and the size of every file of the tag
            universal/                 only after a resume on another layout: DeepSpeed's
                                       universal form of the shards, converted once and
                                       renamed into place when complete (its presence means
                                       complete); deleted with its tag

A tag counts only if ``COMPLETE.json`` exists, parses, and every file it lists exists with the
recorded size. Anything else (killed mid-write, disk full, truncated file) is skipped with a
warning, and the next older complete tag is used. Old tags are deleted only after a newer one
is complete, keeping ``checkpoint.keep`` ≥ 2.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tape_train.loading import (CHECKPOINT_DIR, LATEST, MARKER, UNIVERSAL,  # noqa: F401
                                CheckpointError, checkpoint_root, ensure_universal,
                                find_latest_complete, list_tags, load_model_from_checkpoint,
                                read_marker, read_universal_weights, resolve_checkpoint,
                                saved_layout, step_of_tag, tag_for_step, why_incomplete)
from tape_train.train import distributed as tdist

log = logging.getLogger("tape_train.train")

def rank_state_name(rank: int) -> str:
    return f"trainer_state_rank{rank:05d}.pt"


# ----------------------------------------------------------------------------------------------
# RNG and code version
# ----------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def code_version() -> dict:
    """Package version and ``git describe`` of the source tree (when it is a git checkout)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        package = dist_version("tape-train")
    except PackageNotFoundError:
        package = None
    version = {"package": package, "git": None}
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"],
                             cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            version["git"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return version


# ----------------------------------------------------------------------------------------------
# Saving (collective)
# ----------------------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(engine, run_dir: Path, step: int, *, rank: int, meta: dict,
                    rank_state: dict, keep: int) -> Path:
    """Write tag ``step_<step>`` on all ranks, then mark it complete and rotate. Collective.

    Args:
        engine: the DeepSpeed engine.
        meta: JSON-able run-level state (step, tokens_seen, config, ...); stored as DeepSpeed
            client state and in the marker.
        rank_state: this rank's own state (RNG, data loader); stored in its own file.
        keep: complete checkpoints to keep (older ones are deleted after this one is complete).

    Raises ``CheckpointError`` on every rank if any rank failed to write; the partial tag is
    removed and the previous complete checkpoint is untouched.
    """
    root = checkpoint_root(run_dir)
    tag = tag_for_step(step)
    tag_dir = root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    existing = why_incomplete(tag_dir) if tag_dir.exists() else "absent"
    if existing is None:  # already complete (e.g. stopped right after resuming from it)
        log.info("checkpoint %s already complete; not rewriting it", tag_dir)
        return tag_dir
    if rank == 0 and tag_dir.exists():
        shutil.rmtree(tag_dir, ignore_errors=True)  # leftover of an interrupted save
    tdist.barrier()

    start = time.perf_counter()
    error: BaseException | None = None
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=meta, save_latest=False)
    except Exception as exc:  # noqa: BLE001 - reported collectively below
        error = exc
        # Mirror the barrier that ends DeepSpeed's save on the ranks that succeeded.
        tdist.barrier()
    if error is None:
        try:
            buffer = _serialize(rank_state)
            _write_atomic(tag_dir / rank_state_name(rank), buffer)
            # DeepSpeed's torch.save does not fsync its shards: flush this node's dirty pages
            # so that the marker, written after every rank returns here, never vouches for
            # shards that a crash could still lose.
            os.sync()
        except Exception as exc:  # noqa: BLE001
            error = exc
    failed_ranks = tdist.all_reduce_max_int(1 if error is not None else 0)
    if failed_ranks:
        if rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
        tdist.barrier()
        previous = find_latest_complete(root, warn=False)
        detail = f"{type(error).__name__}: {error}" if error else "another rank failed"
        raise CheckpointError(
            f"writing checkpoint {tag_dir} failed ({detail}); the partial checkpoint was "
            f"removed. Previous complete checkpoint: "
            f"{previous if previous else 'none'} (a re-run resumes from it)") from error

    if rank == 0:
        files = {str(p.relative_to(tag_dir)): p.stat().st_size
                 for p in sorted(tag_dir.rglob("*")) if p.is_file()}
        marker = dict(meta, tag=tag, files=files, saved_at=time.time())
        try:
            _write_atomic(tag_dir / MARKER, json.dumps(marker, indent=1).encode())
            _write_atomic(root / LATEST, tag.encode())
        except OSError as exc:
            error = exc
    if tdist.all_reduce_max_int(1 if error is not None else 0):
        raise CheckpointError(f"could not mark checkpoint {tag_dir} complete ({error}); the "
                              f"previous complete checkpoint is untouched")
    if rank == 0:
        rotate_checkpoints(root, keep)
        log.info("saved checkpoint %s in %.1f s", tag_dir, time.perf_counter() - start)
    tdist.barrier()
    return tag_dir


def _serialize(obj: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rotate_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete tags, and incomplete tags older than the
    newest complete one. Returns what was deleted."""
    tags = list_tags(root)
    complete = [t for t in tags if why_incomplete(t) is None]
    if not complete:
        return []
    newest = step_of_tag(complete[-1].name)
    doomed = complete[:-keep] + [t for t in tags if t not in complete
                                 and step_of_tag(t.name) < newest]
    for tag_dir in doomed:
        # Remove the marker first: a half-deleted tag must never look complete.
        (tag_dir / MARKER).unlink(missing_ok=True)
        shutil.rmtree(tag_dir, ignore_errors=True)
        log.info("deleted old checkpoint %s", tag_dir)
    return doomed


# ----------------------------------------------------------------------------------------------
# Resuming (collective)
# ----------------------------------------------------------------------------------------------


def load_training_state(engine, tag_dir: Path, rank: int, *, universal: bool = False,
                        state_rank: int | None = None) -> tuple[dict, dict]:
    """Load engine (weights, optimizer, scheduler) and one rank's state from a complete tag.

    Args:
        universal: load ``<tag_dir>/universal`` (see ``ensure_universal``; the engine was built
            with ``checkpoint.load_universal``): the checkpoint's layout differs from this run's.
        state_rank: whose ``trainer_state_rank*.pt`` to read (default: ``rank``); on another
            layout the caller maps this rank to one of the saved ranks.

    Returns ``(meta, rank_state)``. Collective (DeepSpeed loads on all ranks).
    """
    tag_dir = Path(tag_dir)
    marker = read_marker(tag_dir)
    if not universal and marker.get("world_size") != tdist.world_size():
        raise CheckpointError(
            f"checkpoint {tag_dir} was written by {marker.get('world_size')} ranks, this run "
            f"has {tdist.world_size()} but was not set up for a resume on another layout")
    load_dir, tag = (tag_dir, UNIVERSAL) if universal else (tag_dir.parent, tag_dir.name)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    try:
        load_path, client_state = engine.load_checkpoint(
            str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    except Exception as exc:  # noqa: BLE001 - shape mismatches surface as many types
        raise CheckpointError(f"could not load checkpoint {tag_dir}"
                              f"{' (universal form)' if universal else ''}: "
                              f"{type(exc).__name__}: {exc}") from exc
    if universal:
        _repair_universal_optimizer_state(engine, hyper, tag_dir)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint at {tag_dir}")
    state_path = tag_dir / rank_state_name(rank if state_rank is None else state_rank)
    try:
        rank_state = torch.load(state_path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"could not read {state_path}: {exc}") from exc
    return client_state or marker, rank_state


def _repair_universal_optimizer_state(engine, hyper: list[dict], tag_dir: Path) -> None:
    """Undo two silent errors of DeepSpeed 0.19.8's ZeRO-3 universal load (both would make a
    resumed run drift away from the saved one without any error):

    - it puts ONE ``step`` tensor into the state of every parameter sub-group, and torch's
      AdamW increments ``step`` in place once per sub-group, so the bias correction ran
      ``#groups`` times too fast after the resume: every state gets its own copy;
    - it copies parameter group 0's hyperparameters onto every group (e.g. weight decay onto
      the no-decay group): the hyperparameters of the run config, read before the load, are
      put back.
    """
    groups = engine.optimizer.param_groups
    if len(groups) != len(hyper):
        raise CheckpointError(f"loading {tag_dir} (universal form) changed the number of "
                              f"optimizer parameter groups ({len(hyper)} -> {len(groups)})")
    for group, values in zip(groups, hyper):
        group.update(values)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


