"""Checkpoint layout, atomic saving and resuming. Discovery, validation and model loading (the
read side, shared with eval and inference) live in ``tape_train.loading`` and are re-exported
here.

Layout of a run directory::

    <run_dir>/checkpoints/
        latest                         text: tag of the newest complete checkpoint (a hint;
                                       discovery scans the tags and trusts markers only)
        step_00000100/                 one tag per saved optimizer step
            *_states.pt                DeepSpeed's shards (ZeRO-3: zero_pp_rank_*_mp_rank_00_
                                       model_states.pt and [bf16_]zero_pp_rank_*_mp_rank_00_
                                       optim_states.pt; ZeRO-0/1/2: mp_rank_*_model_states.pt,
                                       with ZeRO-1/2 the optimizer's zero_pp_rank_* files)
            trainer_state_rank00000.pt one per rank: RNG states, data-loader state
            COMPLETE.json              written last, by rank 0, after every rank finished:
                                       step, tokens, layout (dp, sp, tp), resolved config,
                                       code version, and the size and xxh3-64 checksum of
                                       every file of the tag
            universal/                 only after a resume on another layout or into or
                                       out of ZeRO-3: DeepSpeed's universal form of the
                                       shards, converted once and renamed into place when
                                       complete (its presence means complete), fitted for
                                       the other ZeRO stage family when one loads it
                                       (FOR_ZERO3.json / FOR_ZERO1_2.json written last);
                                       deleted with its tag

A tag counts only if ``COMPLETE.json`` exists, parses, and every file it lists exists with the
recorded size (``why_incomplete``: cheap, no file is read). Before a tag is loaded its files
are also read back and compared with the recorded checksums (``verify_files``; spread over the
ranks when a process group exists, each rank reading its share once). Anything else (killed
mid-write, disk full, truncated file, flipped bytes) is skipped with one warning naming the
file, and the next older intact tag is used; ``tape-export``/``tape-eval`` refuse it. Old tags
are deleted only after a newer one is complete, keeping ``checkpoint.keep`` ≥ 2, and only by
the process that holds the run-directory lock (``tape_train.train.run_lock``).
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

from tape_train.checkpoint_layout import (  # noqa: F401 - re-exported
    CHECKSUM, LATEST, MARKER, UNIVERSAL, CheckpointError, checkpoint_root,
    checksum_bytes, describe_size, file_checksum, find_latest_complete, find_newest, list_tags, rank_state_name,
    read_marker, resolve_checkpoint, step_of_tag, stray_tag_file, tag_for_step, verify_files,
    why_incomplete)
from tape_train.files import (describe_os_error, file_size_limit_hit, free_bytes, human_bytes,
                              is_disk_full, write_atomic)
from tape_train.loading import (ensure_universal,  # noqa: F401 - re-exported
                                load_model_from_checkpoint, saved_layout)
from tape_train.train import distributed as tdist

log = logging.getLogger("tape_train.train")


# ----------------------------------------------------------------------------------------------
# Collective verification (every rank reads its share of the files)
# ----------------------------------------------------------------------------------------------


def _my_share(names: list[str]) -> list[str]:
    """This rank's round-robin share of ``names`` (all of them without a process group)."""
    world, rank = tdist.world_size(), _rank()
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def verify_checkpoint(tag_dir: Path) -> str | None:
    """Collective checksum verification: each rank reads its share of the tag's files once.

    Returns the same verdict on every rank: ``None`` if intact, else the first rank's reason
    (naming the damaged file), so rank 0 can say which file in one line.
    """
    tag_dir = Path(tag_dir)
    reason = why_incomplete(tag_dir)
    if reason is None:
        if _rank() == 0:
            log.info("checking %s against its checksums (%s; each rank reads its share)",
                     tag_dir, describe_size(tag_dir))
        sums = (read_marker(tag_dir).get("checksums") or {})
        reason = verify_files(tag_dir, _my_share(list(sums)))
    if not tdist.all_reduce_max_int(1 if reason is not None else 0):
        return None
    reasons = _gather_dicts({_rank(): reason})  # only on failure: one small all-gather
    return next(reasons[r] for r in sorted(reasons) if reasons[r] is not None)


def find_latest_intact(path: str | Path, warn: bool = True,
                       damaged: set[str] | None = None) -> Path | None:
    """Newest tag that is complete and passes ``verify_checkpoint``. Collective when a process
    group exists (every rank must call it); damaged tags are skipped with one warning each.

    ``damaged``: gets the names of the skipped tags that are complete by their sizes but fail
    their checksums (``rotate_checkpoints`` does not count them as kept checkpoints)."""
    def why_not(tag_dir: Path) -> str | None:
        reason = verify_checkpoint(tag_dir)
        if reason is not None and damaged is not None and why_incomplete(tag_dir) is None:
            damaged.add(tag_dir.name)
        return reason

    return find_newest(path, why_not, warn)


# RNG and code version
# ----------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """This rank's random streams: Python, NumPy, torch's CPU generator and, on a GPU, the
    generator of this rank's own device (the current one, ``cuda:LOCAL_RANK``) only: the other
    GPUs of the node are other ranks', and a resume may see another number of them."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Undo ``capture_rng_state``. The CUDA state goes to this rank's current device; a state
    saved as one entry per visible device (older checkpoints) gives the entry of the current
    device's index, or its first when this process sees fewer devices than the saver did."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)


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


def save_checkpoint(engine, run_dir: Path, step: int, *, rank: int, meta: dict,
                    rank_state: dict, keep: int, owner=None,
                    damaged: set[str] | frozenset[str] = frozenset()) -> Path:
    """Write tag ``step_<step>`` on all ranks, then mark it complete and rotate. Collective.

    Args:
        engine: the DeepSpeed engine.
        meta: JSON-able run-level state (step, tokens_seen, config, ...); stored as DeepSpeed
            client state and in the marker.
        rank_state: this rank's own state (RNG, data loader); stored in its own file.
        keep: complete checkpoints to keep (older ones are deleted after this one is complete).
        owner: on rank 0, the ``RunLock`` of the run directory (``None``: no lock, e.g. tests
            and tools); every deletion (a leftover partial tag, rotation) first checks that the
            lock is still this process's, so a save never deletes a tag another run started.
        damaged: names of complete tags known to fail their checksums (``find_latest_intact``);
            rotation keeps ``keep`` intact checkpoints besides them.

    Raises ``CheckpointError`` on every rank if any rank failed to write; the partial tag is
    removed and the previous complete checkpoint is untouched. A full disk is named as such,
    with the bytes the checkpoint needs and the bytes free.
    """
    root = checkpoint_root(run_dir)
    tag = tag_for_step(step)
    tag_dir = root / tag
    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = exc
    # 2 on every rank when a rank sees a file where the tag's directory goes (never deleted:
    # not the run's to remove), 1 when rank 0 could not create the root.
    stray = os.path.lexists(tag_dir) and not tag_dir.is_dir()
    failed = tdist.all_reduce_max_int(2 if stray else 1 if error is not None else 0)
    if failed == 2:
        why = stray_tag_file(tag_dir) if stray else "another rank found a file there"
        raise CheckpointError(f"cannot save checkpoint {tag_dir}: {why}; {_what_survives(root)}")
    if failed:
        raise CheckpointError(f"cannot create the checkpoint directory: "
                              f"{describe_os_error(error, root) if error else 'see rank 0'}")
    existing = why_incomplete(tag_dir) if tag_dir.exists() else "absent"
    if existing is None:  # complete (stopped right after resuming from it, or a replay)
        existing = verify_checkpoint(tag_dir)  # a damaged one (skipped at resume) is rewritten
        if existing is None:
            log.info("checkpoint %s already complete; not rewriting it", tag_dir)
            return tag_dir
    if rank == 0:
        if tag_dir.exists():
            _check_owner(owner, f"delete the partial checkpoint {tag_dir}")
            shutil.rmtree(tag_dir, ignore_errors=True)  # leftover of an interrupted save
        try:  # made here, so that an unwritable root is named (DeepSpeed says "does not exist")
            tag_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = exc
    if tdist.all_reduce_max_int(1 if error is not None else 0):
        raise CheckpointError(
            f"cannot create checkpoint {tag_dir}: "
            f"{describe_os_error(error, tag_dir) if error else 'see rank 0'}; "
            f"{_what_survives(root)}")

    start = time.perf_counter()
    checksums: dict[str, str] = {}
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=meta, save_latest=False)
    except Exception as exc:  # noqa: BLE001 - reported collectively below
        error = exc
        # Mirror the barrier that ends DeepSpeed's save on the ranks that succeeded.
        tdist.barrier()
    if error is None:
        try:
            buffer = _serialize(rank_state)
            name = rank_state_name(rank)
            write_atomic(tag_dir / name, buffer)
            checksums[name] = checksum_bytes(buffer)  # from memory: no read-back
            # DeepSpeed's torch.save does not fsync its shards: flush this node's dirty pages
            # so that the marker, written after every rank returns here, never vouches for
            # shards that a crash could still lose.
            os.sync()
        except Exception as exc:  # noqa: BLE001
            error = exc
    failed_ranks = tdist.all_reduce_max_int(1 if error is not None else 0)
    if not failed_ranks:
        # Checksum DeepSpeed's shards (just written: read from the page cache), each rank a
        # round-robin share, then gather the sums on rank 0 for the marker.
        try:
            shards = [str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*")
                      if p.is_file() and not p.name.startswith("trainer_state_rank")]
            for name in _my_share(shards):
                checksums[name] = file_checksum(tag_dir / name)
        except OSError as exc:
            error = exc
        failed_ranks = tdist.all_reduce_max_int(1 if error is not None else 0)
    if failed_ranks:
        needed, at_least = _expected_bytes(root, tag_dir)
        if rank == 0 and _still_owner(owner):
            shutil.rmtree(tag_dir, ignore_errors=True)  # this save's own partial tag
        tdist.barrier()
        why = _describe_save_error(error, tag_dir, needed, at_least)
        raise CheckpointError(f"writing checkpoint {tag_dir} failed: {why}; the partial "
                              f"checkpoint was removed; {_what_survives(root)}") from error
    checksums = _gather_dicts(checksums)

    if rank == 0:
        files = {str(p.relative_to(tag_dir)): p.stat().st_size
                 for p in sorted(tag_dir.rglob("*")) if p.is_file()}
        missing = sorted(set(files) - set(checksums))
        marker = dict(meta, tag=tag, files=files, checksum=CHECKSUM,
                      checksums={k: checksums[k] for k in sorted(checksums) if k in files},
                      saved_at=time.time())
        try:
            if missing:
                raise OSError(f"no checksum for {', '.join(missing)} (written during the save "
                              f"by something else?)")
            write_atomic(tag_dir / MARKER, json.dumps(marker, indent=1).encode())
            write_atomic(root / LATEST, tag.encode())
        except OSError as exc:
            error = exc
    if tdist.all_reduce_max_int(1 if error is not None else 0):
        removed = ""
        if rank == 0 and why_incomplete(tag_dir) is not None and _still_owner(owner):
            shutil.rmtree(tag_dir, ignore_errors=True)  # no marker: it only holds the space
            removed = "the partial checkpoint was removed; "
        raise CheckpointError(f"could not mark checkpoint {tag_dir} complete "
                              f"({_describe_save_error(error, tag_dir, None)}); {removed}"
                              f"{_what_survives(root)}")
    if rank == 0:
        _check_owner(owner, f"rotate the checkpoints in {root}")
        rotate_checkpoints(root, keep, damaged=set(damaged) - {tag})
        log.info("saved checkpoint %s in %.1f s", tag_dir, time.perf_counter() - start)
    tdist.barrier()
    return tag_dir


def _what_survives(root: Path) -> str:
    """What a re-run after a failed save starts from, for the end of its error."""
    previous = find_latest_complete(root, warn=False)
    if previous is None:
        return "no previous complete checkpoint (a re-run starts at step 0)"
    return f"previous complete checkpoint: {previous} (a re-run resumes from it)"


def _check_owner(owner, action: str) -> None:
    if owner is not None:
        try:
            owner.verify()
        except Exception as exc:  # noqa: BLE001 - RunLockError and filesystem errors alike
            raise CheckpointError(f"not allowed to {action}: {exc}") from exc


def _still_owner(owner) -> bool:
    try:
        _check_owner(owner, "delete")
    except CheckpointError as exc:
        log.error("leaving the partial checkpoint in place: %s", exc)
        return False
    return True


def _gather_dicts(local: dict) -> dict:
    """Union of every rank's dict (one all_gather_object); ``local`` without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(local)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def _expected_bytes(root: Path, tag_dir: Path) -> tuple[int | None, bool]:
    """What a checkpoint needs on disk, and whether that is only a lower bound: the size of
    the newest complete one (the model and optimizer do not change size), else what this save
    had written when it failed (a lower bound)."""
    previous = find_latest_complete(root, warn=False)
    try:
        if previous is not None:
            return sum(read_marker(previous)["files"].values()), False
        return sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file()) or None, True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, False


def _describe_save_error(error: BaseException | None, tag_dir: Path, needed: int | None,
                         at_least: bool = False) -> str:
    """One line for a failed save. A full disk says "no space left on device" with bytes
    needed and free even when the writer hid the errno (torch.save's "unexpected pos");
    ``at_least``: ``needed`` is only what the failed save had written."""
    if error is None:
        return "another rank failed (see its log)"
    free = free_bytes(tag_dir)
    full = is_disk_full(error) or (needed is not None and free is not None and free < needed)
    limit = None if full else file_size_limit_hit(error)
    if limit is not None:
        return (f"a file under {tag_dir} reached this process's file-size limit of "
                f"{human_bytes(limit)} ({limit} bytes; `ulimit -f`): raise or remove the limit "
                f"[{type(error).__name__}: {error}]")
    if full:
        parts = [f"no space left on device under {tag_dir.parent}"]
        if needed is not None:
            parts.append(f"a checkpoint needs {'at least' if at_least else 'about'} "
                         f"{human_bytes(needed)} ({needed} bytes)")
        if free is not None:
            parts.append(f"{human_bytes(free)} ({free} bytes) free")
        return ", ".join(parts) + f" [{type(error).__name__}: {error}]"
    if isinstance(error, OSError):
        return describe_os_error(error, tag_dir)
    return f"{type(error).__name__}: {error}"


def _serialize(obj: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


SUPERSEDED = "superseded"
RESTART_COUNTS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def restart_resumes_newest(run_dir: str | Path, resume_from: Path) -> Path | None:
    """The run dir's newest complete tag when ``--resume-from resume_from`` is not to be
    applied again: this process is a restart of the job (a Slurm requeue or torchrun restart,
    which run the same command line again: ``RESTART_COUNTS`` above 0) and the run has saved a
    newer checkpoint since that rewind or fork. ``None``: apply ``--resume-from``."""
    if all((os.environ.get(k) or "0") == "0" for k in RESTART_COUNTS):
        return None
    newest = find_latest_complete(run_dir, warn=False)
    if newest is None or (step_of_tag(newest.name) or 0) <= (step_of_tag(resume_from.name) or 0):
        return None
    return newest


def restarts_described() -> str:
    """``"SLURM_RESTART_COUNT=1, TORCHELASTIC_RESTART_COUNT=0"`` for the log lines."""
    return ", ".join(f"{k}={os.environ.get(k) or '0'}" for k in RESTART_COUNTS)


def set_aside_newer(root: Path, step: int, owner=None,
                    damaged: set[str] | frozenset[str] = frozenset()) -> tuple[list[Path], Path | None]:
    """Move the complete tags of ``root`` newer than ``step`` to
    ``<root>/superseded/<UTC time>/`` and point ``latest`` at the newest tag left; returns the
    tags moved and where they went. Rank 0 only, under the run-directory lock (``owner``).

    A run resumed from an older tag (``--resume-from``) writes another trajectory from there
    on: left in place, the newer tags of the one it abandons would be taken for its own (a save
    at their step kept them as "already complete", rotation kept them as the newest, and a
    re-run after a crash resumed from them). Moved aside, they stay loadable by ``tape-eval`` and
    ``tape-export`` (give the tag directory) and are never rotated. ``damaged`` tags (skipped
    at resume for a checksum mismatch, rewritten by the replay) stay where they are."""
    root = Path(root)
    newer = [t for t in list_tags(root) if step_of_tag(t.name) > step
             and t.name not in damaged and why_incomplete(t) is None]
    if not newer:
        return [], None
    _check_owner(owner, f"move the checkpoints after step {step} in {root} aside")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = root / SUPERSEDED / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = root / SUPERSEDED / f"{stamp}-{n}"
    try:
        dest.mkdir(parents=True)
        for tag_dir in newer:
            os.replace(tag_dir, dest / tag_dir.name)
        left = find_latest_complete(root, warn=False)
        if left is not None:
            write_atomic(root / LATEST, left.name.encode())
        else:
            (root / LATEST).unlink(missing_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot move the checkpoints after step {step} aside to {dest}: "
                              f"{describe_os_error(exc, dest)}") from exc
    return newer, dest


def rotate_checkpoints(root: Path, keep: int,
                       damaged: set[str] | frozenset[str] = frozenset()) -> list[Path]:
    """Delete all but the newest ``keep`` complete tags, and incomplete tags older than the
    newest complete one. Returns what was deleted.

    ``damaged`` (names of complete tags that failed their checksums) do not count among the
    ``keep``: a damaged newer tag never pushes out an intact one. They are deleted once older
    than the oldest kept intact tag, and kept while newer (the replay rewrites them)."""
    tags = list_tags(root)
    complete = [t for t in tags if why_incomplete(t) is None]
    if not complete:
        return []
    newest = step_of_tag(complete[-1].name)
    intact = [t for t in complete if t.name not in damaged]
    oldest_kept = step_of_tag(intact[-keep:][0].name) if intact else newest
    doomed = intact[:-keep] + [t for t in complete if t.name in damaged
                               and step_of_tag(t.name) < oldest_kept]
    doomed += [t for t in tags if t not in complete and step_of_tag(t.name) < newest]
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
                        other_layout: bool = False,
                        state_rank: int | None = None) -> tuple[dict, dict]:
    """Load engine (weights, optimizer, scheduler) and one rank's state from a complete tag.

    Args:
        universal: load ``<tag_dir>/universal`` (see ``ensure_universal``; the engine was built
            with ``checkpoint.load_universal``): the checkpoint's layout, or ZeRO stage family,
            differs from this run's.
        other_layout: the checkpoint's layout differs from this run's and it loads directly
            (``relayout.Relayout.universal`` false: a ZeRO-0 checkpoint, whose one file of
            whole weights per tensor-parallel rank suits any dp and sp).
        state_rank: whose ``trainer_state_rank*.pt`` to read (default: ``rank``); on another
            layout the caller maps this rank to one of the saved ranks.

    Returns ``(meta, rank_state)``. Collective (DeepSpeed loads on all ranks).
    """
    tag_dir = Path(tag_dir)
    marker = read_marker(tag_dir)
    if not (universal or other_layout) and marker.get("world_size") != tdist.world_size():
        raise CheckpointError(
            f"checkpoint {tag_dir} was written by {marker.get('world_size')} ranks, this run "
            f"has {tdist.world_size()} but was not set up for a resume on another layout")
    load_dir, tag = (tag_dir, UNIVERSAL) if universal else (tag_dir.parent, tag_dir.name)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    if rank == 0:
        log.info("loading %s (%s%s)", tag_dir, describe_size(tag_dir),
                 "; through its universal form" if universal else "")
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
    return client_state or marker, read_rank_state(
        tag_dir, rank if state_rank is None else state_rank)


def read_rank_state(tag_dir: Path, rank: int) -> dict:
    """Saved rank ``rank``'s own state of a tag (RNG states, ``"loader"``: its data-loader
    state); ``CheckpointError`` naming the file if it cannot be read."""
    state_path = Path(tag_dir) / rank_state_name(rank)
    try:
        return torch.load(state_path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"could not read {state_path}: {exc}") from exc


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


