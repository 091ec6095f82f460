"""The rank grid: world = dp × sp × tp, and every process group derived from ONE rank array.

Layout (tp fastest, then sp, then dp), the layout DeepSpeed's AutoTP mesh also uses::

    rank = dp_rank·(sp·tp) + sp_rank·tp + tp_rank
    ranks = arange(world).reshape(dp, sp, tp)

    tp group   ranks[d, s, :]      contiguous        (AutoTP's tensor-parallel group)
    sp group   ranks[d, :, t]      strided by tp     (Ulysses all-to-all)
    dp group   ranks[:, s, t]      strided by sp·tp  (what the data loader shards over)
    dp×sp      ranks[:, :, t]      strided by tp     (DeepSpeed's data-parallel group: ZeRO-3
                                                      partitions and averages gradients here)

Sizes are validated in :meth:`RankGrid.from_sizes` / :meth:`RankGrid.check_model`, i.e. before
any process group exists; :meth:`RankGrid.build` then creates the groups (every rank must call
it, in the same order, because ``torch.distributed.new_group`` is collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

AXES = ("dp", "sp", "tp")


@dataclass
class ParallelGroups:
    """Process groups of one rank (``None`` for an axis of size 1: nothing to communicate)."""

    tp: object = None
    sp: object = None
    dp: object = None
    dp_sp: object = None


@dataclass
class RankGrid:
    """One rank's place in the dp × sp × tp grid.

    Attributes:
        world_size: number of processes.
        dp, sp, tp: data-, sequence- and tensor-parallel degrees; dp·sp·tp == world_size.
        rank: this process's global rank.
        groups: filled by :meth:`build`.
    """

    world_size: int
    dp: int
    sp: int
    tp: int
    rank: int = 0
    groups: ParallelGroups | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sizes(cls, world_size: int, dp: int | None = None, sp: int = 1, tp: int = 1,
                   rank: int | None = None) -> "RankGrid":
        """Validate the degrees (``dp=None`` infers it) and return the grid. No collective runs.

        ``rank`` defaults to ``torch.distributed.get_rank()`` when a process group exists, else
        to the ``RANK`` environment variable (torchrun sets it), else 0.
        """
        for key, value in (("world size", world_size), ("parallel.sp", sp), ("parallel.tp", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
            raise ValueError(f"parallel.dp must be a positive integer or null (inferred), "
                             f"got {dp!r}")
        if world_size % (sp * tp):
            raise ValueError(f"world size {world_size} is not divisible by parallel.sp × "
                             f"parallel.tp = {sp} × {tp} = {sp * tp}")
        inferred = world_size // (sp * tp)
        if dp is not None and dp != inferred:
            raise ValueError(f"parallel.dp × parallel.sp × parallel.tp = {dp} × {sp} × {tp} = "
                             f"{dp * sp * tp} does not equal the world size {world_size} "
                             f"(leave parallel.dp unset to infer dp = {inferred})")
        if rank is None:
            rank = _current_rank()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} processes")
        return cls(world_size=world_size, dp=inferred, sp=sp, tp=tp, rank=rank)

    def check_model(self, cfg) -> None:
        """Raise ``ValueError`` if the model (a ``ModelConfig``) cannot be split this way.

        Heads are split over tp (AutoTP) and then over sp (Ulysses), so both the query and the
        key/value heads must be divisible by tp·sp; the MLP width is split over tp.
        """
        split = self.tp * self.sp
        for key in ("num_heads", "num_kv_heads"):
            heads = getattr(cfg, key)
            if heads % split:
                raise ValueError(
                    f"model.{key}={heads} is not divisible by parallel.tp × parallel.sp = "
                    f"{self.tp} × {self.sp} = {split} (heads are split over tp, then over sp)")
        if cfg.intermediate_size % self.tp:
            raise ValueError(f"model.intermediate_size={cfg.intermediate_size} is not divisible "
                             f"by parallel.tp={self.tp}")
        spec = cfg.encoding
        if self.sp > 1 and not spec.sequence_parallel:
            from tape_train.model.pe import ENCODINGS

            usable = ", ".join(n for n, s in ENCODINGS.items()
                               if s.sequence_parallel and s.random_positions is not True)
            raise ValueError(
                f"model.pe={cfg.pe} is not supported with parallel.sp={self.sp}: its dense "
                f"attention bias is built per rank for the local sequence chunk only; use "
                f"{usable} with sequence parallelism")
        if self.sp * self.tp > 1 and spec.draws_random_positions(cfg):
            flag = spec.random_positions
            setting = f"model.{flag}=true" if isinstance(flag, str) else f"model.pe={cfg.pe}"
            raise ValueError(
                f"{setting} is not supported with parallel.sp/tp > 1: its training positions "
                f"are sampled per process and would differ between the ranks that share a "
                f"sequence" + ("; set it to false" if isinstance(flag, str) else ""))

    # ------------------------------------------------------------------ coordinates
    @property
    def dp_rank(self) -> int:
        return self.rank // (self.sp * self.tp)

    @property
    def sp_rank(self) -> int:
        return (self.rank // self.tp) % self.sp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_size(self) -> int:
        return self.dp

    def rank_array(self) -> torch.Tensor:
        """(dp, sp, tp) int64 array of global ranks; the single source of every group."""
        return torch.arange(self.world_size).reshape(self.dp, self.sp, self.tp)

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` ('tp', 'sp', 'dp' or 'dp_sp') as lists of global ranks.

        Moves the axis (or axes) last and flattens the rest, so group ``i`` is a row.
        """
        ranks = self.rank_array()
        if axis == "tp":
            rows = ranks.reshape(-1, self.tp)
        elif axis == "sp":
            rows = ranks.permute(0, 2, 1).reshape(-1, self.sp)
        elif axis == "dp":
            rows = ranks.permute(1, 2, 0).reshape(-1, self.dp)
        elif axis == "dp_sp":
            rows = ranks.permute(2, 0, 1).reshape(self.tp, -1)
        else:
            raise ValueError(f"unknown parallel axis {axis!r}; expected tp, sp, dp or dp_sp")
        return rows.tolist()

    def my_group_ranks(self, axis: str) -> list[int]:
        for row in self.group_ranks(axis):
            if self.rank in row:
                return row
        raise AssertionError(f"rank {self.rank} is in no {axis} group")  # unreachable

    # ------------------------------------------------------------------ groups
    def build(self) -> ParallelGroups:
        """Create this rank's process groups (collective: call on every rank, same order).

        Needs an initialised default process group of ``world_size`` ranks.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("RankGrid.build() needs torch.distributed initialised first "
                               "(deepspeed.init_distributed or "
                               "torch.distributed.init_process_group)")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise RuntimeError(f"RankGrid was made for rank {self.rank} of {self.world_size}, "
                               f"but this process is rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}")
        groups = ParallelGroups()
        sizes = {"tp": self.tp, "sp": self.sp, "dp": self.dp, "dp_sp": self.dp * self.sp}
        for axis in ("tp", "sp", "dp", "dp_sp"):
            if sizes[axis] == 1:
                continue
            for row in self.group_ranks(axis):
                group = dist.new_group(row)  # every rank creates every group: collective
                if self.rank in row:
                    setattr(groups, axis, group)
        self.groups = groups
        return groups

    def describe(self) -> str:
        """One grep-able log line."""
        return (f"parallel grid: world={self.world_size} dp={self.dp} sp={self.sp} tp={self.tp} "
                f"| rank {self.rank} = (dp {self.dp_rank}, sp {self.sp_rank}, tp {self.tp_rank})")


def _current_rank() -> int:
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
