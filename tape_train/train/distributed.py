"""Process-group set-up and the few collectives the trainer needs.

Works under ``torchrun`` (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*) and as a plain single
process (``python -m tape_train.train.cli``): then a one-rank group is created on a free local
port, because DeepSpeed always needs an initialised process group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(requested_device: str = "auto") -> DistInfo:
    """Initialise (or reuse) the default process group; gloo on CPU, NCCL on CUDA."""
    if "RANK" not in os.environ:  # plain single process: give DeepSpeed a 1-rank group
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    import deepspeed

    # Also when a group exists already (tests): DeepSpeed then only wraps it for its own comm.
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               verbose=False)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


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


def all_reduce_max_int(value: int) -> int:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

