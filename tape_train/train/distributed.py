"""Process-group set-up and the few collectives the trainer needs.

Works under ``torchrun`` (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*) and as a plain single
process (``python -m tape_train.train.cli``): then a one-rank group is created on a free local
port, because DeepSpeed always needs an initialised process group.

No C++ build on the way: DeepSpeed's communication backend JIT-compiles its shared-memory
all-reduce op (``deepspeed_shm_comm``, minutes on a small CPU, under a file lock) whenever it
starts on CPU. Training never uses that op (it only serves DeepSpeed's inference all-reduce,
which falls back to the process group without it), so it is not built for gloo runs. Any op
DeepSpeed does build goes to a per-virtualenv cache (``TORCH_EXTENSIONS_DIR``, default
``<venv>/torch_extensions``), and a build lock found there is reported before waiting on it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tape_train.devices import launch_int, pick_device, process_group_backend
from tape_train.train.cuda_allocator import AllocatorSetting, configure_cuda_allocator

log = logging.getLogger("tape_train.train")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cuda_allocator: AllocatorSetting | None = None  # on CUDA, when init_distributed set it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(requested_device: str = "auto", timeout_s: float | None = None,
                     cuda_expandable_segments: bool | None = None) -> DistInfo:
    """Initialise (or reuse) the default process group; gloo on CPU, NCCL on CUDA.

    ``timeout_s``: how long a collective may wait for the other ranks (``None``: DeepSpeed's
    default, 10 min or ``$DEEPSPEED_TIMEOUT`` minutes); also applied to a group that exists
    already. ``cuda_expandable_segments``: ``train.cuda_expandable_segments``, applied to the
    CUDA caching allocator as soon as the device is chosen, before NCCL or anything else
    allocates on it (``tape_train.train.cuda_allocator``); ``None`` leaves the allocator as
    it is."""
    if "RANK" not in os.environ:  # plain single process: give DeepSpeed a 1-rank group
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = launch_int("LOCAL_RANK")
    device = pick_device(requested_device, local_rank)
    allocator = (None if cuda_expandable_segments is None
                 else configure_cuda_allocator(cuda_expandable_segments, device))
    extensions = use_venv_extensions_dir()
    report_build_locks(extensions)
    import deepspeed

    # Also when a group exists already (tests): DeepSpeed then only wraps it for its own comm.
    extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    with _no_shm_comm_build(device.type == "cpu"):
        deepspeed.init_distributed(dist_backend=process_group_backend(device), verbose=False,
                                   **extra)
    if timeout_s is not None:
        set_collective_timeout(timeout_s)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, allocator)


def use_venv_extensions_dir() -> Path:
    """Point torch's C++-extension cache at ``<venv>/torch_extensions`` unless the user chose
    one: not the shared ``~/.cache/torch_extensions`` another checkout may hold locked."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def report_build_locks(extensions_dir: Path) -> list[Path]:
    """Warn about every build lock under ``extensions_dir``: a build that is running (this
    start will wait for it) or a killed one (it would wait forever: delete the file)."""
    try:
        locks = sorted(extensions_dir.glob("*/*/lock")) + sorted(extensions_dir.glob("*/lock"))
    except OSError:
        return []
    for lock in locks:
        log.warning("C++ extension build lock %s exists: a build is running elsewhere, or was "
                    "killed (then delete this file, or start-up waits for it forever)", lock)
    return locks


@contextlib.contextmanager
def _no_shm_comm_build(skip: bool):
    """While DeepSpeed's torch backend starts, make it find no shared-memory comm op instead of
    JIT-compiling one (``deepspeed.comm.torch.build_shm_op``, called from its constructor)."""
    if not skip:
        yield
        return
    import importlib

    # Not `import deepspeed.comm.torch as ...`: deepspeed.comm re-exports torch itself under
    # that attribute name, so the import statement would bind the torch package.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    original = getattr(ds_torch, "build_shm_op", None)
    if original is None:  # another DeepSpeed version: nothing to skip
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = original


def set_collective_timeout(timeout_s: float) -> None:
    """How long any collective of this rank may wait for the others, in every process group
    this rank belongs to: the world and every sub-group (the dp/sp/tp groups and DeepSpeed's,
    which torch creates with its own default, 30 min for gloo and 10 min for NCCL, whatever
    the world group has). Local: each rank sets its own."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def collective_device() -> torch.device:
    """Where small collective tensors must live: CUDA for NCCL, CPU for gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (identity without a group); returns a tensor on ``tensor.device``."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    work = tensor.to(collective_device())
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(tensor.device)


def broadcast_floats(values: list[float], src: int = 0) -> list[float]:
    """Rank ``src``'s ``values`` on every rank (the list as given without a group); each
    rank passes a list of the same length. A collective: every rank waits for ``src``."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.broadcast(tensor, src=src)
    return tensor.tolist()


def all_reduce_max_int(value: int) -> int:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def end_rank(code: int) -> int:
    """How a training process ends with exit ``code``: returned as is where no process group
    was set up; otherwise the process ends here, without the interpreter's finalization
    (``tape_train.progress.exit_without_finalizing``: gloo's worker threads could abort it at
    exit, and torchrun would count a finished run as a failed attempt). A cleanly finished
    group is destroyed first; after a failure it is left alone (a dead peer must not hold up
    the exit). Either way the teardown is bounded (``bound_teardown``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return code
    bound_teardown(code)
    if code == 0:
        dist.destroy_process_group()
    from tape_train.progress import exit_without_finalizing

    exit_without_finalizing(code)
    return code  # not reached


TEARDOWN_S = 60.0  # from the trainer's return to the process's end (measured: well under 1 s)


def bound_teardown(code: int, seconds: float | None = None) -> None:
    """End this process with ``code`` if its teardown (``destroy_process_group``, the atexit
    handlers) has not ended it within ``seconds``: a peer or the launcher's store gone at the
    wrong moment can leave it waiting for many minutes, in C code where a SIGTERM's Python
    handler never runs. The run's work is done by then (checkpoint written, lock released),
    so the code stays the trainer's (``seconds``: ``TEARDOWN_S``). faulthandler backs it up
    (stacks, exit 1) 30 s later, for a wait that holds the GIL."""
    import faulthandler
    import threading

    from tape_train.progress import exit_flushed

    seconds = TEARDOWN_S if seconds is None else seconds

    def end() -> None:
        threading.Event().wait(seconds)
        rank = os.environ.get("RANK")
        line = (f"{f'[rank{rank}] ' if rank else ''}tape-train: the teardown of the process "
                f"group did not end within {seconds:g} s; exiting without it (exit {code})\n")
        try:  # not logging: the stuck thread may hold a handler's lock
            os.write(2, line.encode())
        except OSError:
            pass
        exit_flushed(code)

    threading.Thread(target=end, name="tape-train-teardown", daemon=True).start()
    try:
        faulthandler.dump_traceback_later(seconds + 30, exit=True)
    except (AttributeError, ValueError, OSError):  # stderr without a file descriptor
        pass


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

