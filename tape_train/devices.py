"""Which device a process computes on: the one place that turns ``auto``/``cpu``/``cuda`` and
``LOCAL_RANK`` into a ``torch.device``, and the process-group backend that goes with it (the
trainer and ``tape-eval`` both call them)."""

from __future__ import annotations

import os


class DeviceError(RuntimeError):
    """The requested device cannot be used here; the message says why in one line."""


def pick_device(requested: str, local_rank: int, setting: str = "train.device"):
    """``cuda:<local_rank>`` (made the current device) for ``cuda``, or for ``auto`` where CUDA
    is available; else the CPU. ``setting`` names the option in messages (``--device``).

    Under torchrun every process of a node sees all of its GPUs and takes the one at its
    ``LOCAL_RANK``; a process whose ``LOCAL_RANK`` has no GPU (more processes per node than
    visible GPUs) fails here in one line, not in the first CUDA call."""
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
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def process_group_backend(device) -> str:
    """NCCL for processes computing on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
