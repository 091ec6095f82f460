"""Autograd-correct collectives for head-sharded and sequence-sharded tensors.

All of them use only ``all_gather`` (list form) and ``all_to_all_single``, which gloo, NCCL
and the CPU/CUDA tensors of this project all support (``torch.distributed.nn``'s all-gather
needs reduce-scatter in backward, which gloo lacks). A ``None`` group means a group of one
rank: every function is then the identity.

Shapes follow the attention layout (b, H, N, D): heads on dim 1, sequence on dim 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _local_slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


class _GatherAlongDim(torch.autograd.Function):
    """Forward: all-gather and concatenate along ``dim``. Backward: this rank's slice.

    The output is replicated on every rank and each rank's downstream graph is the same, so the
    gradient arriving here is already the full gradient: the local slice of it is exact (an
    all-reduce would multiply it by the group size).
    """

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _local_slice(grad, ctx.group, ctx.dim).contiguous(), None, None


class _ScatterAlongDim(torch.autograd.Function):
    """Forward: this rank's slice along ``dim`` of a replicated tensor. Backward: all-gather.

    Each rank's graph uses only its slice, so each holds the gradient of its slice only; the
    full gradient of the replicated input is their concatenation.
    """

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _local_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_cat(grad, ctx.group, ctx.dim), None, None


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(b, H/g, N, D) local heads → (b, H, N, D) all heads, in group-rank order."""
    if group_size(group) == 1:
        return x
    return _GatherAlongDim.apply(x, group, 1)


def scatter_heads(x: torch.Tensor, group, sync_grad: bool = True) -> torch.Tensor:
    """(b|1, H, N, D) replicated → (b|1, H/g, N, D), this rank's heads.

    ``sync_grad=False`` is a plain slice (gradient zero outside the local heads): wrong for a
    replicated input, kept only as the negative control of the tests.
    """
    if group_size(group) == 1:
        return x
    if not sync_grad:
        return _local_slice(x, group, 1)
    return _ScatterAlongDim.apply(x, group, 1)


class _SeqToHeads(torch.autograd.Function):
    """Ulysses all-to-all. (b, H, n, D) sequence chunk, all heads → (b, H/g, g·n, D) full
    sequence, local heads. The backward is the inverse exchange (:class:`_HeadsToSeq`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Inverse Ulysses all-to-all: (b, H/g, g·n, D) → (b, H, n, D)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    g = dist.get_world_size(group)
    b, h, n, d = x.shape
    # chunk j of dim 0 (heads j·h/g …) goes to rank j; what arrives from rank j is its
    # sequence chunk j for our heads.
    send = x.reshape(b, g, h // g, n, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // g, g * n, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    g = dist.get_world_size(group)
    b, h, big_n, d = x.shape
    n = big_n // g
    send = x.reshape(b, h, g, n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, g * h, n, d)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses forward exchange; identity for a group of one."""
    if group_size(group) == 1:
        return x
    return _SeqToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses inverse exchange; identity for a group of one."""
    if group_size(group) == 1:
        return x
    return _HeadsToSeq.apply(x, group)
