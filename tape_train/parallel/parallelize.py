"""Apply tensor and sequence parallelism to a :class:`TransformerLM` from outside, in one
fixed order, and tell DeepSpeed and the trainer what they need.

Integration (per rank; see docs/parallelism.md)::

    grid = RankGrid.from_sizes(world_size, dp=cfg.parallel.dp, sp=..., tp=...)  # validates
    # the model against sp/tp: RunConfig already ran grid.check_model when the config loaded
    deepspeed.init_distributed(dist_backend=...)
    grid.build()                                      # every rank, same order
    model = parallelize(TransformerLM(model_cfg), grid)
    ds_config.update(deepspeed_config_updates(grid))  # AutoTP section; NO mpu, NO sp keys
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, ...)   # no mpu=
    verify_engine(engine, grid)
    loader = build_train_loader(..., dp_rank=grid.dp_rank, dp_size=grid.dp_size)
    for micro_batches in steps:       # the trainer's one loss path: shard, weight, backward, step
        forward_backward(engine, micro_batches, grid=grid, global_tokens=...)  # train/engine.py

Why no mpu: DeepSpeed does not compose its SP mpu with AutoTP. Without it, DeepSpeed sees every
rank of a tp group's stride (the dp×sp group) as data-parallel: ZeRO partitions over dp·sp
ranks and averages gradients over them in every ZeRO stage, which is what Ulysses needs (the SP
ranks' gradients are contributions of disjoint tokens to one sum) once the loss carries the
factor dp·sp / (global token count): :func:`loss_scale` here, applied by the trainer's
``tape_train.train.engine.forward_backward``, the one loss path (every parallel test uses it).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from tape_train.parallel.collectives import group_size
from tape_train.parallel.grid import RankGrid
from tape_train.parallel.sequence import ParallelAttentionCore
from tape_train.parallel.tensor import autotp_partition_config, shard_tape_state_over_heads


def parallelize(model: nn.Module, grid: RankGrid) -> nn.Module:
    """Make ``model`` (a ``TransformerLM``, on its device, before ``deepspeed.initialize``)
    sequence- and tensor-parallel on ``grid``. Modifies in place and returns it.

    Precondition, not repeated here: ``grid.check_model(model.cfg)`` passed (heads divisible
    by tp·sp, encoding supported). ``RunConfig`` runs it once when the config loads, before
    any process group; call it yourself for a hand-made grid.

    Order (each step relies on the previous one):
      1. TP, for an encoding that carries a state (TAPE): hooks on every ``layer.attn`` that cut the state E to this rank's heads
         and all-gather the attended state Ê (``tensor.shard_tape_state_over_heads``).
      2. Every ``layer.attn.core`` becomes a :class:`ParallelAttentionCore` (Ulysses exchange
         when sp > 1; per-head bias cut to local heads when tp > 1). It has no parameters, so
         parameter names, checkpoints and AutoTP's patterns are unchanged. TAPE's fused Triton
         kernel runs inside the core too (raw q, k and [v|E⁰|E¹] are exchanged), so it is
         sequence-parallel like every other backend.
      3. AutoTP itself (splitting q/k/v/o/gate/up/down) is done by ``deepspeed.initialize`` from
         :func:`deepspeed_config_updates` — the model is not tensor-parallel until then.
    """
    if getattr(model, "parallel_grid", None) is not None:
        raise RuntimeError("parallelize() was already applied to this model")
    if grid.world_size > 1 and grid.groups is None:
        raise RuntimeError("call grid.build() on every rank before parallelize()")
    groups = grid.groups
    tp_group = groups.tp if groups is not None else None
    sp_group = groups.sp if groups is not None else None
    shard_tape_state_over_heads(model, tp_group)
    if group_size(tp_group) > 1 or group_size(sp_group) > 1:
        for layer in model.layers:
            layer.attn.core = ParallelAttentionCore(layer.attn.core, sp_group, tp_group)
    model.parallel_grid = grid
    return model


def deepspeed_config_updates(grid: RankGrid) -> dict:
    """Keys to merge into the DeepSpeed config: the AutoTP section when tp > 1, else nothing.

    Deliberately absent: ``sequence_parallel_size`` / ``data_parallel_size`` (the mesh route
    lost optimizer state in checkpoints, see the notes) and any ``mpu``.
    """
    if grid.tp == 1:
        return {}
    return {"tensor_parallel": {"autotp_size": grid.tp,
                                "partition_config": autotp_partition_config()}}


def loss_scale(grid: RankGrid, zero_stage: int = 3, reduce_scatter: bool = True) -> int:
    """The number of ranks DeepSpeed averages gradients over in this setup: dp·sp.

    Without an mpu every ZeRO stage (0–3, reduce_scatter on or off) averages over DeepSpeed's
    data-parallel group, which here is the dp×sp group (world/tp ranks); the arguments are
    validated and documented, not branched on. (With DeepSpeed's SP mpu, which we never pass,
    stages ≤ 2 and reduce_scatter=false would divide by dp only.)
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={zero_stage!r} is not one of 0, 1, 2, 3")
    if not isinstance(reduce_scatter, bool):
        raise ValueError(f"zero_optimization.reduce_scatter must be a bool, got "
                         f"{reduce_scatter!r}")
    return grid.dp * grid.sp


def verify_engine(engine, grid: RankGrid) -> None:
    """Check after ``deepspeed.initialize`` that DeepSpeed's groups are the grid's.

    AutoTP builds its own tensor-parallel group (contiguous ranks, the same layout); if it
    ever differed, heads and gradients would silently be mixed up, so fail loudly instead.
    """
    expected_dp = grid.dp * grid.sp
    ds_dp = getattr(engine, "dp_world_size", None)
    if ds_dp is not None and ds_dp != expected_dp:
        raise RuntimeError(f"DeepSpeed averages gradients over {ds_dp} ranks, the grid expects "
                           f"dp·sp = {expected_dp}: was an mpu or sequence_parallel_size passed?")
    if grid.tp > 1:
        from deepspeed.utils import groups as ds_groups

        ranks = dist.get_process_group_ranks(ds_groups.get_tensor_model_parallel_group())
        if sorted(ranks) != grid.my_group_ranks("tp"):
            raise RuntimeError(f"DeepSpeed's tensor-parallel group {ranks} differs from the "
                               f"grid's {grid.my_group_ranks('tp')}")
