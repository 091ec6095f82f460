"""Which device a process computes on: the one place that turns ``auto``/``cpu``/``cuda`` and
``LOCAL_RANK`` into a ``torch.device``, and the process-group backend that goes with it (the
trainer and ``tape-eval`` both call them); and the one reader of the variables torchrun sets
for each process it starts (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)."""

from __future__ import annotations

import os


class DeviceError(RuntimeError):
    """The requested device cannot be used here; the message says why in one line."""


class LaunchError(ValueError):
    """A variable of torchrun's environment is unusable; the message names it in one line."""


# torchrun's variables, each with its value for a process started alone and its least value.
LAUNCH_VARIABLES = {"WORLD_SIZE": (1, 1), "RANK": (0, 0), "LOCAL_RANK": (0, 0),
                    "LOCAL_WORLD_SIZE": (1, 1)}


def launch_int(name: str) -> int:
    """The integer torchrun put in ``name`` (one of ``LAUNCH_VARIABLES``), or a lone
    process's value when it is unset. Raises ``LaunchError`` naming the variable when it is
    set to anything else (empty, text, below its least value)."""
    alone, least = LAUNCH_VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None:
        return alone
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        raise LaunchError(f"{name}={raw!r} in the environment is not an integer >= {least} "
                          f"(torchrun sets it for each process it starts; unset it to run one "
                          f"process)")
    return value


def speaks_for_node() -> bool:
    """Whether this process reports an error that every process of its node meets alike (a
    config error, the preflight's problems): the one with ``LOCAL_RANK`` 0, or a process
    started alone. A malformed ``LOCAL_RANK`` counts as 0, so that its own error is seen."""
    try:
        return launch_int("LOCAL_RANK") == 0
    except LaunchError:
        return True


def check_launch_environment() -> None:
    """Before any start-up work: torchrun's variables are integers, and a ``WORLD_SIZE`` above
    1 comes with the ``RANK`` below it that torchrun gives each process. A ``WORLD_SIZE`` left
    in the shell (``tape-train --dry-run`` plans for it) would otherwise make one plain process
    expect ranks that never start. An ``ATEN_CPU_CAPABILITY`` above this CPU's would end the
    start-up in SIGILL (``machine_cache.isa_limit_error``)."""
    from tape_train.machine_cache import isa_limit_error

    if error := isa_limit_error():
        raise LaunchError(error)
    values = {name: launch_int(name) for name in LAUNCH_VARIABLES}
    world = values["WORLD_SIZE"]
    if world > 1 and "RANK" not in os.environ:
        raise LaunchError(f"WORLD_SIZE={world} is set but RANK is not: this process was not "
                          f"started by torchrun and cannot be {world} ranks alone; launch them "
                          f"with `launch/local.sh {world} ...` (torchrun), or unset WORLD_SIZE "
                          f"to run one process")
    if values["RANK"] >= world:
        raise LaunchError(f"RANK={values['RANK']} is not below WORLD_SIZE={world}"
                          f"{'' if 'WORLD_SIZE' in os.environ else ' (WORLD_SIZE is unset)'}")


def pick_device(requested: str, local_rank: int, setting: str = "train.device"):
    """``cuda:<local_rank>`` (made the current device) for ``cuda``, or for ``auto`` where CUDA
    is available; else the CPU. ``setting`` names the option in messages (``--device``).

    Under torchrun every process of a node sees all of its GPUs and takes the one at its
    ``LOCAL_RANK``; a process whose ``LOCAL_RANK`` has no GPU (more processes per node than
    visible GPUs) fails here in one line, not in the first CUDA call."""
    import torch

    if check_device(requested, local_rank, setting) == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_device(requested: str, local_rank: int, setting: str = "train.device") -> str:
    """The device type ``pick_device`` will choose (``"cuda"`` or ``"cpu"``), touching no
    device; raises ``DeviceError`` where it would: ``cuda`` asked for without CUDA, or a
    ``LOCAL_RANK`` with no GPU of its own."""
    import torch

    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise DeviceError(f"{setting} cuda: no CUDA device here (torch.cuda.is_available() "
                              f"is False); use {setting} cpu or auto")
        visible = torch.cuda.device_count()
        if not 0 <= local_rank < visible:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise DeviceError(
                f"LOCAL_RANK={local_rank} but this process sees {visible} CUDA device(s)"
                f"{f' (CUDA_VISIBLE_DEVICES={shown})' if shown is not None else ''}: start at "
                f"most {visible} process(es) per node (torchrun --nproc_per_node)")
        return "cuda"
    return "cpu"


def process_group_backend(device) -> str:
    """NCCL for processes computing on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
