"""Reading what training wrote: the one public loading API for eval, inference and resume.

A training run leaves checkpoints (``tape_train.train.checkpoint`` writes them); an export
leaves a ``save_pretrained`` directory. Everything that *consumes* either goes through here:

    model, tokenizer, meta = load_model(path)        # run dir, tag dir or export dir
    tag_dir = resolve_checkpoint(path)               # the complete checkpoint a path means
    tag_dir = find_latest_complete(run_dir)          # the newest complete tag, or None

Discovery trusts only ``COMPLETE.json`` markers (see the layout in
``tape_train.train.checkpoint``): incomplete tags are skipped with a warning, and a path that
names one is refused. No process group is needed; DeepSpeed is imported only to consolidate
ZeRO shards. Data flows one way: train → (files) → this module → eval / inference.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tape_train.checkpoint_layout import (  # noqa: F401 - find_latest_complete: public API
    MARKER, UNIVERSAL, CheckpointError, deleted_while_read, find_latest_complete, read_marker,
    resolve_checkpoint, why_incomplete, with_run_paths)
from tape_train.files import write_atomic
from tape_train.machine_cache import usable_cpus

log = logging.getLogger("tape_train.checkpoint")
# Each parameter's full fp32 value in DeepSpeed's universal form: ``zero/<name>/fp32.pt``.
UNIVERSAL_PARAM = "fp32.pt"

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


# The converter ignores the stop signals (SIGINT, SIGTERM, SIGUSR1): Slurm delivers a
# preemption or scancel to every process of the job step, not only to the trainer, and the
# trainer decides (a stop kills the converter between two beats and exits 75, not "conversion
# failed"). It ends with the process that started it (a rank ended by its watchdog leaves by
# os._exit): it checks its parent every second and, when it is gone, kills its own process
# group (its pool workers with it; run_with_progress makes it the group's leader). Then it
# runs the module named next.
_WITH_PARENT = """import os, runpy, signal, sys, threading, time
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, signal.SIG_IGN)
parent = os.getppid()
def watch():
    while os.getppid() == parent:
        time.sleep(1)
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(1)
threading.Thread(target=watch, daemon=True).start()
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def converter_command(tag_dir: Path, out_dir: Path) -> list[str]:
    """DeepSpeed's universal conversion of ``tag_dir`` into ``out_dir``, as a child process
    (unbuffered, so its stage lines arrive as it prints them; it ends if its parent does)."""
    import sys

    workers = str(min(4, usable_cpus()))
    return [sys.executable, "-u", "-c", _WITH_PARENT, "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", str(tag_dir), "--output_folder", str(out_dir),
            "--num_extract_workers", workers, "--num_merge_workers", "1",
            "--inject_missing_state"]


def ensure_universal(tag_dir: Path, out_dir: Path | None = None, *,
                     tick: Callable[[bool], None] | None = None, tick_s: float = 5.0,
                     tensor_parallel: bool = False, zero_stage: int | None = None) -> Path:
    """DeepSpeed's universal form of a complete ZeRO checkpoint, converted once.

    Converts ``tag_dir`` with ``deepspeed.checkpoint.ds_to_universal`` into a temporary sibling
    and renames it to ``<tag_dir>/universal`` (or ``out_dir``) only when the conversion
    finished, so an interrupted conversion is never mistaken for a complete one and is simply
    redone. Runs on one process (no process group); returns the universal directory.

    Processes that need the same conversion at once (the ranks of a ``torchrun tape-eval``, an
    evaluation job next to an export) take turns on a lock file beside the target: one
    converts, the others wait for it (logging that they do) and then use its result; if it
    dies, the next one converts (the lock file stays beside a failed conversion, holding only
    the last converter's host and pid). On a filesystem without ``flock`` each converts on its
    own and the first finished result is kept.

    It may take minutes on a large model: its progress is logged (DeepSpeed's stage lines, and
    at least every ``progress.LOG_EVERY_S`` the time so far and what it wrote), and ``tick``
    (see ``tape_train.progress.run_with_progress``) hears every ``tick_s`` whether it moved,
    also while waiting for another process's conversion.

    ``tensor_parallel``: the caller loads it into an engine with tp > 1 (see
    ``_wrap_bare_states``); ``zero_stage``: the ZeRO stage of the engine that loads it, when
    it may differ from the checkpoint's (see ``_fit_for_stage``). Both are also applied to a
    form cached earlier without them.
    """
    from tape_train.progress import run_with_progress

    tag_dir = Path(tag_dir)
    target = Path(out_dir) if out_dir is not None else tag_dir / UNIVERSAL
    if target.is_dir():
        return _fit_for_engine(target, tag_dir, tensor_parallel, zero_stage)
    reason = why_incomplete(tag_dir)
    if reason is not None:
        raise CheckpointError(f"checkpoint {tag_dir} is not complete ({reason}); refusing to "
                              f"convert it")
    if read_marker(tag_dir).get("zero_stage", 3) < 1:
        raise CheckpointError(f"checkpoint {tag_dir} was written with ZeRO stage 0; DeepSpeed's "
                              f"universal conversion needs ZeRO-1/2/3 optimizer shards")
    with _conversion_lock(target, tick=tick, tick_s=tick_s) as locked:
        if target.is_dir():  # another process converted it while this one waited
            log.info("universal checkpoint converted by another process: %s", target)
            return _fit_for_engine(target, tag_dir, tensor_parallel, zero_stage)
        if locked:  # only a killed conversion can have left these
            for stale in target.parent.glob(f".{target.name}.tmp*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}-{os.urandom(4).hex()}")
        start = time.perf_counter()
        log.info("converting %s to DeepSpeed's universal format (once; cached in %s)", tag_dir,
                 target)
        try:
            code, tail = run_with_progress(
                converter_command(tag_dir, tmp), what=f"universal conversion of {tag_dir.name}",
                output_dir=tmp, logger=log, tick=tick, tick_s=tick_s, stage_prefix="***")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # A converter that exits 0 having written no parameter (zero/<name>/fp32.pt) failed
        # too: cached, its empty output would be taken for the conversion by every later run.
        if code != 0 or not any(tmp.glob(f"zero/*/{UNIVERSAL_PARAM}")):
            shutil.rmtree(tmp, ignore_errors=True)
            last = "\n".join(tail)
            how = (f"exit {code}" if code != 0
                   else f"exit 0 without writing zero/*/{UNIVERSAL_PARAM}")
            raise CheckpointError(f"converting {tag_dir} to the universal format failed "
                                  f"({how}); the checkpoint itself is untouched. Last "
                                  f"output:\n{last}")
        _fit_for_engine(tmp, tag_dir, tensor_parallel, zero_stage)
        write_atomic(tmp / "CONVERTED.json", json.dumps(
            {"source": tag_dir.name, "seconds": round(time.perf_counter() - start, 2)}))
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # unlocked: another process was first
        log.info("universal checkpoint ready in %.1f s: %s", time.perf_counter() - start, target)
    # Removed only once the target exists: a process still waiting on the removed file finds
    # the target when it gets the lock, one arriving later before it locks anything.
    target.with_name(f".{target.name}.lock").unlink(missing_ok=True)
    # Done in the temporary form above; again here for a form another process renamed first.
    return _fit_for_engine(target, tag_dir, tensor_parallel, zero_stage)


def _fit_for_engine(universal_dir: Path, tag_dir: Path, tensor_parallel: bool,
                    zero_stage: int | None) -> Path:
    """What ``ensure_universal``'s caller's engine needs beyond DeepSpeed's conversion (each
    step idempotent and skipped when done); returns ``universal_dir``."""
    if tensor_parallel or zero_stage in (1, 2):  # both read a state only as {"param": ...}
        _wrap_bare_states(universal_dir, tag_dir)
    if zero_stage is not None:
        _fit_for_stage(universal_dir, tag_dir, zero_stage)
        _check_loadable(universal_dir, zero_stage)
    return universal_dir


def _check_loadable(universal_dir: Path, zero_stage: int) -> None:
    """Refuse a universal form missing a file a ZeRO-``zero_stage`` engine's load needs,
    naming it and the fix (e.g. a copy of the tag cut short, or a form whose fitting marker
    outlived one of its files).

    DeepSpeed 0.19.8's ZeRO-1/2 universal load reads whatever ``zero/<name>/*.pt`` it finds:
    without ``fp32.pt`` the parameter keeps its fresh initial value, without ``step.pt``
    AdamW restarts its bias correction, and nothing says so. Its ZeRO-3 load and both stages'
    search for the model-states file fail only with a bare error. A listing, no file read."""
    family = 3 if zero_stage == 3 else 1
    needed = [universal_dir / "zero" / "optimizer_state.pt"]
    model_states = _MODEL_STATES[family].format("*")
    if not any(universal_dir.glob(model_states)):
        needed.append(universal_dir / model_states)
    states = _STATES + (("step",) if family == 1 else ())
    params = sorted(p for p in (universal_dir / "zero").iterdir() if p.is_dir()) \
        if (universal_dir / "zero").is_dir() else []
    if not params:
        needed.append(universal_dir / "zero" / "<name>" / UNIVERSAL_PARAM)
    needed += [param / f"{state}.pt" for param in params for state in states]
    missing = [path for path in needed if not path.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{missing[0]}{more} is missing from the universal form, which a ZeRO-{zero_stage} "
            f"engine needs; delete {universal_dir} and run again: it is converted anew from "
            f"the checkpoint, which is untouched")


def _wrap_bare_states(universal_dir: Path, tag_dir: Path) -> None:
    """Store every ``zero/<name>/<state>.pt`` of a converted ZeRO-3 checkpoint without tensor
    parallelism as ``{"param": tensor}`` of the parameter's shape, the form the converter
    writes for every other checkpoint.

    DeepSpeed 0.19.8's converter writes those states as bare flat tensors, and its ZeRO-3
    loader cuts a tensor-parallel rank's shard only out of the dict form: a resume at tp > 1
    from such a checkpoint read the whole weight as if it were the shard and failed with
    ``start (…) + length (…) exceeds dimension size (…)``; its ZeRO-1/2 loader reads only
    the dict form (``ckpt_dict["param"]``) and, at tp > 1, takes a state of the parameter's
    own shape for a replicated one and cuts a shard along a dimension of the full shape (a
    flat state failed with ``full param numel … != tensor slice numel … * tp_world_size``).
    The shapes are the saved model states' ``param_shapes`` (at tp = 1 the whole
    parameters'); without that file the states stay flat, which the ZeRO-3 loader reads
    alike (it flattens every state). Both forms load the same into ZeRO-3 at tp = 1, so only
    a load at tp > 1 or into ZeRO-1/2 pays for this rewrite of every state (once per cached
    form). ``step.pt`` (``_fit_for_stage``) stays a bare tensor, as the ZeRO-1/2 loader
    reads it.
    Idempotent; files are replaced atomically and in order (a process killed half-way left
    a prefix done)."""
    marker = read_marker(tag_dir)
    if int(marker.get("zero_stage", 3)) != 3 or saved_layout(marker)["tp"] != 1:
        return  # the converter wrote dicts of the parameters' shapes
    paths = sorted(p for p in Path(universal_dir).glob("zero/*/*.pt") if p.stem in _STATES)
    shapes = _saved_param_shapes(universal_dir)

    def done(state, path: Path) -> bool:
        shape = shapes.get(path.parent.name)
        return isinstance(state, dict) and (
            shape is None or tuple(state["param"].shape) == tuple(shape))

    # Done in order: the last file done means all are, but a form wrapped flat before the
    # shapes were applied has its one-dimensional ones right already: the last of the others too.
    shaped = [p for p in paths if len(shapes.get(p.parent.name, ())) > 1]
    if not paths or all(done(_load_state(p, universal_dir), p) for p in {paths[-1], *shaped[-1:]}):
        return
    for path in paths:
        state = _load_state(path, universal_dir)
        if done(state, path):
            continue
        state = dict(state) if isinstance(state, dict) else {"param": state}
        shape = shapes.get(path.parent.name)
        if shape is not None:
            if state["param"].numel() != math.prod(shape):
                raise CheckpointError(
                    f"{path} of the universal form holds {state['param'].numel()} values, "
                    f"its parameter {tuple(shape)}; delete {universal_dir} and run again: it "
                    f"is converted anew from the checkpoint, which is untouched")
            state["param"] = state["param"].reshape(shape)
        write_atomic(path, lambda fh, state=state: torch.save(state, fh))


def _saved_param_shapes(universal_dir: Path) -> dict[str, tuple]:
    """Each parameter's shape by name, from the ZeRO-3 model states of a universal form
    without tensor parallelism (``param_shapes``); empty without that file."""
    path = universal_dir / _MODEL_STATES[3].format("00")
    if not path.is_file():
        return {}
    groups = _load_state(path, universal_dir).get("param_shapes") or []
    return {name: tuple(shape) for group in groups for name, shape in group.items()}


# The per-parameter states of the universal form, ``zero/<name>/<state>.pt``.
_STATES = ("fp32", "exp_avg", "exp_avg_sq")
# DeepSpeed's model-states file of tensor-parallel rank ``*`` in a universal form, by the
# stage family of the engine that reads it (``DeepSpeedEngine._get_ckpt_name``; the universal
# load looks for data-parallel rank 0's only).
_MODEL_STATES = {3: "zero_pp_rank_0_mp_rank_{}_model_states.pt",
                 1: "mp_rank_{}_model_states.pt"}


def _fit_for_stage(universal_dir: Path, tag_dir: Path, zero_stage: int) -> None:
    """Let a ZeRO-``zero_stage`` engine load the universal form of a checkpoint saved at a
    stage of the other family (ZeRO-3 vs ZeRO-1/2); nothing to do within a family.

    DeepSpeed 0.19.8's universal load (``load_checkpoint`` with ``load_universal``) reads
    three things, each in the saving stage's own form:

    - the model-states file of its tensor-parallel rank, found by the loading stage's name
      (ZeRO-3 ``zero_pp_rank_0_mp_rank_XX_model_states.pt``, ZeRO-1/2
      ``mp_rank_XX_model_states.pt``; none found: a bare ``AssertionError``). From it the
      load takes the client state (our step, token counters, config), DeepSpeed's step and
      sample counters and world sizes, and the lr scheduler's state (none: our schedule is a
      function of the step), not ``module``: the weights come from ``zero/*/fp32.pt``. Each
      saved file is written again under the other stage's name, its ``module`` cut to the
      buffers (``buffer_names``; ZeRO-3 keeps only empty placeholders of the parameters
      there, and ZeRO-1/2's whole weights would be a second, unread copy of fp32.pt);
    - ``zero/optimizer_state.pt``: ZeRO-3 takes AdamW's ``step`` and hyperparameters from
      its ``optimizer_state_dict`` (absent from a ZeRO-1/2 form: added from ``step.pt``),
      ZeRO-1/2 requires ``ds_version`` (absent from a ZeRO-3 form: added from the saved
      model states);
    - ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``, which both read (ZeRO-1/2 only as
      ``{"param": tensor}``: ``_wrap_bare_states``), and ``step.pt``, which only ZeRO-1/2
      reads (without it AdamW would restart its bias correction at step 0): written for
      every parameter of a ZeRO-3 form.

    Every file is replaced atomically and the form's files and the checkpoint are never
    changed otherwise; ``FOR_ZERO3.json`` / ``FOR_ZERO1_2.json`` is written last, so a form
    without it (a process killed half-way) is fitted again.
    """
    saved = int(read_marker(tag_dir).get("zero_stage", 3))
    family, target = (3 if saved == 3 else 1), (3 if zero_stage == 3 else 1)
    if saved < 1 or zero_stage < 1 or family == target:
        return
    done = universal_dir / ("FOR_ZERO3.json" if target == 3 else "FOR_ZERO1_2.json")
    if done.is_file():
        return
    start = time.perf_counter()
    zero = universal_dir / "zero"
    optimizer_path = zero / "optimizer_state.pt"
    optimizer = _load_state(optimizer_path, universal_dir)
    sources = sorted(universal_dir.glob(_MODEL_STATES[family].format("*")))
    if not sources:
        raise CheckpointError(f"{universal_dir} holds no {_MODEL_STATES[family].format('*')}"
                              f" to derive the ZeRO-{zero_stage} model states from; delete it "
                              f"and run again: it is converted anew from the checkpoint")
    if target == 3:
        steps = sorted(zero.glob("*/step.pt"))
        if not steps:
            raise CheckpointError(f"{universal_dir} holds no zero/*/step.pt: AdamW's step of "
                                  f"the ZeRO-{saved} checkpoint is unknown")
        step = _load_state(steps[0], universal_dir)
        if "optimizer_state_dict" not in optimizer:
            optimizer["optimizer_state_dict"] = {"state": {0: {"step": step}},
                                                 "param_groups": optimizer["param_groups"]}
            write_atomic(optimizer_path, lambda fh: torch.save(optimizer, fh))
    else:
        step = optimizer["optimizer_state_dict"]["state"][0]["step"]
        for param_dir in sorted(p.parent for p in zero.glob(f"*/{UNIVERSAL_PARAM}")):
            write_atomic(param_dir / "step.pt", lambda fh: torch.save(step, fh))
        if "ds_version" not in optimizer:
            optimizer["ds_version"] = _load_state(sources[0], universal_dir)["ds_version"]
            write_atomic(optimizer_path, lambda fh: torch.save(optimizer, fh))
    for source in sources:
        states = _load_state(source, universal_dir)
        buffers = set(states.get("buffer_names") or ())
        states["module"] = {k: v for k, v in (states.get("module") or {}).items()
                            if k in buffers}
        tp_rank = source.name.split("mp_rank_")[1].split("_")[0]
        write_atomic(universal_dir / _MODEL_STATES[target].format(tp_rank),
                     lambda fh, states=states: torch.save(states, fh))
    write_atomic(done, json.dumps({"saved_zero_stage": saved, "model_states": len(sources),
                                   "seconds": round(time.perf_counter() - start, 2)}))
    log.info("universal form of %s fitted for a ZeRO-%d engine (saved with ZeRO-%d)",
             tag_dir.name, zero_stage, saved)


def _load_state(path: Path, universal_dir: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a damaged file surfaces as many types
        raise CheckpointError(
            f"{path} of the universal form is unreadable ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); delete "
            f"{universal_dir} and run again: it is converted anew from the checkpoint, "
            f"which is untouched") from exc


@contextlib.contextmanager
def _conversion_lock(target: Path, *, tick: Callable[[bool], None] | None, tick_s: float):
    """Holds ``.<target name>.lock`` beside ``target`` (an exclusive ``flock``) for one
    conversion; yields whether it is held (False where the filesystem has no ``flock``).

    While another process holds it: waits, calling ``tick`` every ``tick_s`` (moved = that
    process's temporary output grew) and logging at least every ``progress.LOG_EVERY_S``
    who converts and for how long. The kernel releases the lock of a process that dies."""
    import fcntl

    lock_path = target.with_name(f".{target.name}.lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # an unwritable directory: the conversion itself says so
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = _wait_for_lock(fd, lock_path, target, tick, tick_s)
        except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: e.g. Lustre without -o flock
            _warn_unlocked(lock_path, exc)
            held = False
        else:
            held = True
        if not held:
            yield False
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _warn_unlocked(lock_path: Path, exc: OSError) -> None:
    log.warning("cannot lock %s (%s): processes converting this checkpoint at the same time "
                "will each convert it", lock_path, exc.strerror or exc)


def _wait_for_lock(fd: int, lock_path: Path, target: Path,
                   tick: Callable[[bool], None] | None, tick_s: float) -> bool:
    """Blocks until ``fd``'s exclusive lock is this process's (see ``_conversion_lock``):
    True; False if locking stopped working meanwhile (an NFS lock manager lost: ENOLCK), when
    this process goes on unlocked, as on a filesystem without ``flock``."""
    import fcntl

    from tape_train.progress import LOG_EVERY_S, _elapsed, _tree_size

    def holder() -> str:
        try:
            return lock_path.read_text().strip() or "another process"
        except OSError:
            return "another process"

    what = tag if (tag := target.parent.name) and target.name == UNIVERSAL else str(target)
    start = ticked = logged = time.monotonic()
    log.info("waiting for %s, which is converting %s to the universal format", holder(), what)
    seen = None
    while True:
        time.sleep(min(tick_s, 1.0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as exc:
            _warn_unlocked(lock_path, exc)
            return False
        now = time.monotonic()
        if tick is not None and now - ticked >= tick_s:
            ticked = now
            sizes = [_tree_size(p) for p in sorted(target.parent.glob(f".{target.name}.tmp*"))]
            tick(seen is not None and sizes != seen)
            seen = sizes
        if now - logged >= LOG_EVERY_S:
            logged = now
            log.info("still waiting for %s's universal conversion of %s (%s so far)", holder(),
                     what, _elapsed(now - start))


def read_universal_weights(universal_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 parameters of a universal checkpoint (every TP shard merged)."""
    zero = Path(universal_dir) / "zero"
    state = {}
    for param_dir in sorted(p for p in zero.iterdir() if (p / UNIVERSAL_PARAM).is_file()):
        state[param_dir.name] = torch.load(param_dir / UNIVERSAL_PARAM, map_location="cpu",
                                           weights_only=False)["param"]
    if not state:
        raise CheckpointError(f"{universal_dir}: no parameters under zero/*/{UNIVERSAL_PARAM}")
    return state


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def load_model_from_checkpoint(path: str | Path, map_dtype: torch.dtype | None = torch.float32,
                               verify: bool = True) -> tuple[Any, dict[str, torch.Tensor], dict]:
    """Consolidated model weights of any checkpoint, without a process group.

    Args:
        path: a run dir (→ its latest complete checkpoint), a checkpoint root, or a tag dir.
            Incomplete and damaged (checksum mismatch) checkpoints are refused.
        map_dtype: cast floating tensors to this dtype (``None``: keep as stored; ZeRO-1/2/3
            consolidation yields the fp32 master weights, ZeRO-0 the module's own dtype).
        verify: read every file back against its checksum first (``False``: the caller did).

    Returns:
        ``(model_cfg, state_dict, meta)``: the ``ModelConfig`` the run trained (a CUDA-only
        attention backend replaced by ``auto``: ``ModelConfig.for_any_device``), a state dict
        loadable into ``TransformerLM(model_cfg)``, and the marker (step, tokens_seen, config,
        code_version, ...).
    """
    tag_dir = resolve_checkpoint(path, verify=verify)
    try:
        return _consolidate(tag_dir, map_dtype)
    except (OSError, ValueError, CheckpointError) as exc:  # a reader of a live run may lose its tag
        vanished = deleted_while_read(tag_dir, exc)
        if vanished is None:
            raise
        raise vanished from exc


def _consolidate(tag_dir: Path, map_dtype: torch.dtype | None
                 ) -> tuple[Any, dict[str, torch.Tensor], dict]:
    meta = with_run_paths(read_marker(tag_dir), tag_dir)
    model_cfg = checkpoint_model_config(tag_dir, meta)
    if meta.get("zero_stage", 3) >= 1 and saved_layout(meta)["tp"] > 1:
        # zero_to_fp32 cannot merge tensor-parallel shards: go through the universal form.
        state = _read_universal_weights_of(tag_dir)
    elif meta.get("zero_stage", 3) >= 1:  # ZeRO-1/2/3: fp32 master weights in the shards
        from tape_train.progress import library_bars

        # DeepSpeed prints as it imports (its logger's handler is bound to the stdout of that
        # moment) and as it consolidates: on stderr, as every message of ours; a reader's
        # stdout is its data (tape-generate's text or JSON lines).
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.utils import zero_to_fp32

            with library_bars(zero_to_fp32):  # no carriage returns in a redirected log
                state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                    str(tag_dir.parent), tag=tag_dir.name)
    elif saved_layout(meta)["tp"] > 1:
        raise CheckpointError(f"{tag_dir}: a ZeRO-0 checkpoint with tensor parallelism holds "
                              f"only weight shards per file and cannot be consolidated; train "
                              f"with parallel.zero_stage >= 1 to export tensor-parallel runs")
    else:
        states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
        if not states:
            raise CheckpointError(f"{tag_dir}: no mp_rank_*_model_states.pt")
        state = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    from tape_train.model.pretrained import weights_mismatch

    problem = weights_mismatch(state, model_cfg)
    if problem:  # a marker edited, or weights of another model copied in with it
        raise CheckpointError(f"checkpoint {tag_dir}: its weights do not match the model config "
                              f"of its {MARKER}: {problem}")
    state = {k: (v.to(map_dtype) if map_dtype is not None and v.is_floating_point() else v)
             for k, v in state.items()}
    return model_cfg, state, meta


@contextlib.contextmanager
def held_checkpoint(tag_dir: Path):
    """``tag_dir`` kept readable while the block runs, also if the training run that wrote it
    deletes it meanwhile (``checkpoint.keep``): every file is opened now and the block reads a
    private mirror of the tag (same name, in a temp dir) whose entries link to the open files
    (``/proc/<pid>/fd/N``, the open file itself, deleted or not: for this process and the
    ones it starts). Yields the mirror, or ``tag_dir`` itself where that cannot be done (no
    ``/proc``; more files than the open-file limit allows; a tensor-parallel checkpoint
    without its universal form, which the reader converts into the tag to share it), where a
    deletion is reported by ``deleted_while_read``."""
    tag_dir = Path(tag_dir)
    fd_dir = Path(f"/proc/{os.getpid()}/fd")
    meta = read_marker(tag_dir)
    converts = (meta.get("zero_stage", 3) >= 1 and saved_layout(meta)["tp"] > 1
                and not (tag_dir / UNIVERSAL).is_dir())
    files = [Path(root) / name for root, _, names in os.walk(tag_dir) for name in names]
    if converts or not fd_dir.is_dir() or not _fd_room(len(files), fd_dir):
        yield tag_dir
        return
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="tape-held-"))
    mirror, fds = scratch / tag_dir.name, []
    try:
        for path in files:
            try:
                fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            except FileNotFoundError as exc:  # the run deleted it just now
                raise deleted_while_read(tag_dir, exc) or exc from None
            link = mirror / path.relative_to(tag_dir)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(fd_dir / str(fds[-1]))
        yield mirror
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)


def _fd_room(n: int, fd_dir: Path, spare: int = 256) -> bool:
    """Whether ``n`` more files can be opened with ``spare`` descriptors left over, after
    raising the soft open-file limit up to the hard one if that is what it takes."""
    import resource

    want = len(os.listdir(fd_dir)) + n + spare
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if want > soft:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return want <= soft


def checkpoint_model_config(tag_dir: Path, meta: dict):
    """The ``ModelConfig`` a checkpoint's marker ``meta`` records, runnable on any device (a
    CUDA-only attention backend replaced by ``auto``); read without touching the weights."""
    from tape_train.model.config import ModelConfig

    model = (meta.get("config") or {}).get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{tag_dir / MARKER} records no model config (config.model); "
                              f"the weights cannot be rebuilt from it")
    source = f"{tag_dir / MARKER} [model]"
    try:
        return ModelConfig.from_dict(dict(model), source=source).for_any_device()
    except (TypeError, ValueError) as exc:  # a value of the wrong type or out of range
        if source in str(exc):
            raise
        raise ValueError(f"{source}: {exc}") from None


def _read_universal_weights_of(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a tensor-parallel checkpoint, through its universal form: cached in
    the tag when that directory is writable, else converted into a scratch directory of the
    machine's temp dir that the processes reading this checkpoint share (one converts, see
    ``ensure_universal``) and the last of them removes."""
    if (tag_dir / UNIVERSAL).is_dir() or os.access(tag_dir, os.W_OK):
        return read_universal_weights(ensure_universal(tag_dir))
    with _shared_scratch(tag_dir) as scratch:
        return read_universal_weights(ensure_universal(tag_dir, out_dir=scratch / UNIVERSAL))


@contextlib.contextmanager
def _shared_scratch(tag_dir: Path):
    """``<tmp>/tape-universal-<uid>-<key of tag_dir>``, held with a shared ``flock`` on its
    ``.readers`` file while in use; on leaving, a reader that then takes the lock exclusively
    is the last one and removes the directory. A reader that locked a ``.readers`` file just
    removed (its inode is no longer the path's) starts again on a fresh one.

    Where that directory cannot be shared safely (not this user's own private directory: one
    made by another user in a shared temp dir could hold anything) or the temp dir has no
    ``flock`` (ENOLCK on NFS), this reader converts into a private directory of its own,
    removed when it is done."""
    import fcntl
    import stat
    import tempfile

    scratch = _scratch_path(tag_dir)
    fd, why = None, None
    while True:
        try:
            scratch.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(scratch)
        except FileNotFoundError:  # removed by the last reader just now
            continue
        except OSError as exc:
            why = f"cannot create it: {exc.strerror or exc}"
            break
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            why = "it is not this user's own private directory"
            break
        try:
            fd = os.open(scratch / ".readers", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:  # removed by the last reader just now
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: no flock on this filesystem
            os.close(fd)
            fd, why = None, f"cannot lock it: {exc.strerror or exc}"
            with contextlib.suppress(OSError):  # nobody can share it: not left behind empty
                (scratch / ".readers").unlink()
                scratch.rmdir()
            break
        if _same_file(fd, scratch / ".readers"):
            break
        os.close(fd)
    if fd is None:
        private = Path(tempfile.mkdtemp(prefix=f"{scratch.name}-"))
        log.warning("not sharing the universal conversion of %s in %s (%s): converting it "
                    "into %s for this process alone", tag_dir, scratch, why, private)
        try:
            yield private
        finally:
            shutil.rmtree(private, ignore_errors=True)
        return
    try:
        yield scratch
    finally:
        # Unlocked first, then tried exclusively: where a conversion of the lock is atomic
        # (flock emulated with POSIX locks, as on NFS) two readers leaving at once would each
        # keep their shared lock and fail, and neither would remove the directory.
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, scratch / ".readers"):  # not removed by a reader that left first
                shutil.rmtree(scratch, ignore_errors=True)  # the last reader
        except OSError:
            pass  # another process still reads it, and removes it when done
        finally:
            os.close(fd)


def _scratch_path(tag_dir: Path) -> Path:
    """``<tmp>/tape-universal-<uid>-<key>``: the key is the checkpoint's real path and its
    marker's content (a checkpoint rewritten in place is another key, also where the marker's
    mtime did not change)."""
    import hashlib
    import tempfile

    marker = (Path(tag_dir) / MARKER).read_bytes()
    key = hashlib.sha256(os.path.realpath(tag_dir).encode() + b"\0" + marker).hexdigest()
    return Path(tempfile.gettempdir()) / f"tape-universal-{os.getuid()}-{key[:16]}"


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def trained_tokenizer(tag_dir: Path, meta: dict) -> str | None:
    """The sha256 of the tokenizer ``tag_dir``'s run trained with: saved rank 0's data-loader
    state (``data.state.recorded_tokenizer``). ``None`` where the checkpoint does not say:
    synthetic data, a state without it, or one that cannot be read (the loaders name it)."""
    from tape_train.checkpoint_layout import rank_state_name
    from tape_train.data.state import recorded_tokenizer

    if ((meta.get("config") or {}).get("train") or {}).get("synthetic_data"):
        return None
    try:  # train.checkpoint.read_rank_state's read; that module is above this one
        state = torch.load(Path(tag_dir) / rank_state_name(0), map_location="cpu",
                           weights_only=False)
    except Exception:  # noqa: BLE001 - unreadable: nothing to compare (a resume names it)
        return None
    return recorded_tokenizer(state.get("loader") if isinstance(state, dict) else None)


def other_tokenizer(tag_dir: Path, meta: dict, tokenizer) -> str | None:
    """Why ``tokenizer`` (a loaded ``Tokenizer``) is not the one ``tag_dir``'s run trained
    with, or ``None`` when it is (or the checkpoint does not say)."""
    own = ((meta.get("config") or {}).get("data") or {}).get("tokenizer")
    return tokenizer_mismatch(tokenizer, trained_tokenizer(tag_dir, meta),
                              f"the one {tag_dir}'s run trained with", own)


def tokenizer_mismatch(tokenizer, expected: str | None, whose: str,
                       own: str | None = None) -> str | None:
    """Why ``tokenizer`` is not ``whose`` (sha256 ``expected``; ``own``: its path), or
    ``None`` when it is or nothing is known: with another tokenizer of the same size the
    model's token ids are read as other pieces, and perplexities, samples and exports are
    wrong without any error."""
    if expected is None or expected == tokenizer.sha256:
        return None
    changed = own is not None and _same_path(own, tokenizer.path)
    return (f"tokenizer {tokenizer.path} (sha256 {tokenizer.sha256[:12]}…) is not {whose} "
            f"(sha256 {expected[:12]}…{f', its data.tokenizer {own}' if own else ''}"
            f"{', a file that has changed since' if changed else ''}): the model's token ids "
            f"would be read as other pieces")


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except OSError:
        return False


def is_export_dir(path: Path) -> bool:
    """A ``save_pretrained`` directory (weights and config present)."""
    from tape_train.model.pretrained import CONFIG, WEIGHTS

    return (Path(path) / WEIGHTS).is_file() and (Path(path) / CONFIG).is_file()


def load_model(path: str | Path, dtype: torch.dtype | None = None):
    """``(model in eval mode, tokenizer path or None, meta)`` from an export directory or a
    training checkpoint (run dir → its latest complete checkpoint, or a tag dir; ``meta``: its
    marker with ``tag_dir``, the checkpoint read).

    ``dtype``: cast the model (default: the export's stored dtype, fp32 for checkpoints).
    """
    from tape_train.model.pretrained import PROVENANCE, TOKENIZER, from_pretrained
    from tape_train.model.transformer import TransformerLM

    path = Path(path)
    # An export missing a file is named as such (from_pretrained says which), not searched
    # for checkpoints.
    if is_export_dir(path) or (path / PROVENANCE).is_file():
        tok = path / TOKENIZER
        return (from_pretrained(path, dtype=dtype), str(tok) if tok.is_file() else None,
                {"source": str(path)})
    tag_dir = resolve_checkpoint(path)
    cfg, state, meta = load_model_from_checkpoint(tag_dir, verify=False)
    model = TransformerLM(cfg)
    model.load_state_dict(state)
    model = model.to(dtype or torch.float32).eval()
    tokenizer = (meta.get("config") or {}).get("data", {}).get("tokenizer")
    return model, tokenizer, {**meta, "tag_dir": str(tag_dir)}
