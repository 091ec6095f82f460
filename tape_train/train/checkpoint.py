"""Checkpoint layout, atomic saving, discovery and loading. The single source of truth.

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
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tape_train.train import distributed as tdist

log = logging.getLogger("tape_train.train")

CHECKPOINT_DIR = "checkpoints"
MARKER = "COMPLETE.json"
UNIVERSAL = "universal"
LATEST = "latest"
_TAG_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what survives."""


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def step_of_tag(tag: str) -> int | None:
    match = _TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def rank_state_name(rank: int) -> str:
    return f"trainer_state_rank{rank:05d}.pt"


def checkpoint_root(path: str | Path) -> Path:
    """``<run_dir>/checkpoints`` for a run dir; the path itself if it already is a root."""
    path = Path(path)
    if path.name == CHECKPOINT_DIR or list_tags(path):
        return path
    return path / CHECKPOINT_DIR


# ----------------------------------------------------------------------------------------------
# Discovery and validation (no process group needed)
# ----------------------------------------------------------------------------------------------


def read_marker(tag_dir: Path) -> dict:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def why_incomplete(tag_dir: Path) -> str | None:
    """``None`` if ``tag_dir`` is a complete checkpoint, else the reason it is not."""
    tag_dir = Path(tag_dir)
    marker_path = tag_dir / MARKER
    if not marker_path.is_file():
        return f"no {MARKER} (the save was interrupted or failed)"
    try:
        marker = read_marker(tag_dir)
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MARKER} ({exc})"
    for name, size in files.items():
        path = tag_dir / name
        if not path.is_file():
            return f"missing file {name}"
        actual = path.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written"
    return None


def list_tags(root: Path) -> list[Path]:
    """Tag directories under a checkpoint root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    tags = [p for p in root.iterdir() if p.is_dir() and step_of_tag(p.name) is not None]
    return sorted(tags, key=lambda p: step_of_tag(p.name))


def find_latest_complete(path: str | Path, warn: bool = True) -> Path | None:
    """Newest complete tag directory under a run dir or checkpoint root (``None``: none yet).

    Newer incomplete tags are skipped with a warning naming the reason.
    """
    root = checkpoint_root(path)
    for tag_dir in reversed(list_tags(root)):
        reason = why_incomplete(tag_dir)
        if reason is None:
            return tag_dir
        if warn:
            log.warning("skipping checkpoint %s: %s", tag_dir, reason)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete tag directory from a run dir, a checkpoint root or a tag dir; raises else."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if step_of_tag(path.name) is not None or (path / MARKER).exists():
        reason = why_incomplete(path)
        if reason is not None:
            raise CheckpointError(f"checkpoint {path} is not complete: {reason}; refusing to "
                                  f"use it (pick a complete one, or the run dir for the latest)")
        return path
    found = find_latest_complete(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint under {checkpoint_root(path)}")
    return found


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
# Layout and DeepSpeed's universal form (resuming or exporting on another layout)
# ----------------------------------------------------------------------------------------------


def saved_layout(marker: dict) -> dict[str, int]:
    """``{"dp", "sp", "tp"}`` a checkpoint was written with (older markers: from its config)."""
    if "layout" in marker:
        return {k: int(marker["layout"][k]) for k in ("dp", "sp", "tp")}
    parallel = (marker.get("config") or {}).get("parallel") or {}
    sp, tp = int(parallel.get("sp", 1)), int(parallel.get("tp", 1))
    world = int(marker.get("world_size", sp * tp))
    return {"dp": int(marker.get("dp_size", world // (sp * tp))), "sp": sp, "tp": tp}


def ensure_universal(tag_dir: Path, out_dir: Path | None = None) -> Path:
    """DeepSpeed's universal form of a complete ZeRO checkpoint, converted once.

    Converts ``tag_dir`` with ``deepspeed.checkpoint.ds_to_universal`` into a temporary sibling
    and renames it to ``<tag_dir>/universal`` (or ``out_dir``) only when the conversion
    finished, so an interrupted conversion is never mistaken for a complete one and is simply
    redone. Runs on one process (no process group); returns the universal directory.
    """
    import sys

    tag_dir = Path(tag_dir)
    target = Path(out_dir) if out_dir is not None else tag_dir / UNIVERSAL
    if target.is_dir():
        return target
    reason = why_incomplete(tag_dir)
    if reason is not None:
        raise CheckpointError(f"checkpoint {tag_dir} is not complete ({reason}); refusing to "
                              f"convert it")
    if read_marker(tag_dir).get("zero_stage", 3) < 1:
        raise CheckpointError(f"checkpoint {tag_dir} was written with ZeRO stage 0; DeepSpeed's "
                              f"universal conversion needs ZeRO-1/2/3 optimizer shards")
    for stale in target.parent.glob(f".{target.name}.tmp*"):  # left by a killed conversion
        shutil.rmtree(stale, ignore_errors=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    start = time.perf_counter()
    log.info("converting %s to DeepSpeed's universal format (once; cached in %s)", tag_dir,
             target)
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(tag_dir), "--output_folder", str(tmp), "--num_extract_workers", workers,
           "--num_merge_workers", "1", "--inject_missing_state"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise CheckpointError(f"converting {tag_dir} to the universal format failed (exit "
                              f"{result.returncode}); the checkpoint itself is untouched. "
                              f"Last output:\n{tail}")
    (tmp / "CONVERTED.json").write_text(json.dumps(
        {"source": tag_dir.name, "seconds": round(time.perf_counter() - start, 2)}))
    os.replace(tmp, target)
    log.info("universal checkpoint ready in %.1f s: %s", time.perf_counter() - start, target)
    return target


def read_universal_weights(universal_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 parameters of a universal checkpoint (every TP shard merged)."""
    zero = Path(universal_dir) / "zero"
    state = {}
    for param_dir in sorted(p for p in zero.iterdir() if (p / "fp32.pt").is_file()):
        state[param_dir.name] = torch.load(param_dir / "fp32.pt", map_location="cpu",
                                           weights_only=False)["param"]
    if not state:
        raise CheckpointError(f"{universal_dir}: no parameters under zero/*/fp32.pt")
    return state


# ----------------------------------------------------------------------------------------------
# Loading
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


def load_model_from_checkpoint(path: str | Path, map_dtype: torch.dtype | None = torch.float32
                               ) -> tuple[Any, dict[str, torch.Tensor], dict]:
    """Consolidated model weights of any checkpoint, without a process group.

    Args:
        path: a run dir (→ its latest complete checkpoint), a checkpoint root, or a tag dir.
            Incomplete checkpoints are refused.
        map_dtype: cast floating tensors to this dtype (``None``: keep as stored; ZeRO-1/2/3
            consolidation yields the fp32 master weights, ZeRO-0 the module's own dtype).

    Returns:
        ``(model_cfg, state_dict, meta)``: the ``ModelConfig`` the run trained, a state dict
        loadable into ``TransformerLM(model_cfg)``, and the marker (step, tokens_seen, config,
        code_version, ...).
    """
    from tape_train.model.config import ModelConfig

    tag_dir = resolve_checkpoint(path)
    meta = read_marker(tag_dir)
    model_cfg = ModelConfig.from_dict(dict(meta["config"]["model"]),
                                      source=f"{tag_dir / MARKER} [model]")
    if meta.get("zero_stage", 3) >= 1 and saved_layout(meta)["tp"] > 1:
        # zero_to_fp32 cannot merge tensor-parallel shards: go through the universal form.
        state = read_universal_weights(_universal_for_reading(tag_dir))
    elif meta.get("zero_stage", 3) >= 1:  # ZeRO-1/2/3: fp32 master weights in the shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    elif saved_layout(meta)["tp"] > 1:
        raise CheckpointError(f"{tag_dir}: a ZeRO-0 checkpoint with tensor parallelism holds "
                              f"only weight shards per file and cannot be consolidated; train "
                              f"with parallel.zero_stage >= 1 to export tensor-parallel runs")
    else:
        states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
        if not states:
            raise CheckpointError(f"{tag_dir}: no mp_rank_*_model_states.pt")
        state = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    state = {k: (v.to(map_dtype) if map_dtype is not None and v.is_floating_point() else v)
             for k, v in state.items()}
    return model_cfg, state, meta


def _universal_for_reading(tag_dir: Path) -> Path:
    """The cached universal form, converted next to the checkpoint if that directory is
    writable, else into a temporary directory that lives until the process exits."""
    if (tag_dir / UNIVERSAL).is_dir() or os.access(tag_dir, os.W_OK):
        return ensure_universal(tag_dir)
    import atexit
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="tape-universal-"))
    atexit.register(shutil.rmtree, scratch, True)
    return ensure_universal(tag_dir, out_dir=scratch / UNIVERSAL)
