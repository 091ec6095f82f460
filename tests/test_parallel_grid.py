"""The rank grid, its validation, AutoTP specs and batch sharding — single process, no groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tape_train.model import ModelConfig, TransformerLM
from tape_train.parallel import (RankGrid, autotp_partition_config, deepspeed_config_updates,
                                 loss_scale, partition_dim, shard_batch)

SMALL = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
             tape_position_size=8)


@pytest.mark.parametrize("world,sp,tp,dp", [(1, 1, 1, 1), (8, 2, 2, 2), (8, 1, 4, 2),
                                            (6, 3, 1, 2), (4, 2, 2, 1)])
def test_rank_formula_and_groups_partition_the_world(world, sp, tp, dp):
    for rank in range(world):
        grid = RankGrid.from_sizes(world, sp=sp, tp=tp, rank=rank)
        assert grid.dp == dp
        assert rank == grid.dp_rank * sp * tp + grid.sp_rank * tp + grid.tp_rank
        assert grid.my_group_ranks("tp") == [rank - grid.tp_rank + t for t in range(tp)]
        assert grid.my_group_ranks("sp") == [grid.dp_rank * sp * tp + s * tp + grid.tp_rank
                                             for s in range(sp)]
        # data is sharded over dp only: all ranks of one dp group share dp_rank's batch
        for other in grid.my_group_ranks("dp_sp"):
            assert other % tp == grid.tp_rank
    grid = RankGrid.from_sizes(world, sp=sp, tp=tp, rank=0)
    for axis, size in (("tp", tp), ("sp", sp), ("dp", dp), ("dp_sp", dp * sp)):
        groups = grid.group_ranks(axis)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world)), axis
    # DeepSpeed's AutoTP mesh: tp groups contiguous, its data-parallel groups range(t, W, tp)
    assert grid.group_ranks("tp") == [list(range(s, s + tp)) for s in range(0, world, tp)]
    assert grid.group_ranks("dp_sp") == [list(range(t, world, tp)) for t in range(tp)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=4, sp=3), "not divisible by parallel.sp × parallel.tp"),
    (dict(world_size=8, sp=2, tp=2, dp=4), "does not equal the world size 8"),
    (dict(world_size=4, tp=0), "parallel.tp must be a positive integer"),
    (dict(world_size=4, sp=2.0), "parallel.sp must be a positive integer"),
    (dict(world_size=4, dp=True), "parallel.dp must be"),
])
def test_invalid_layouts_fail_before_any_process_group(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankGrid.from_sizes(rank=0, **kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize("cfg,sp,tp,match", [
    (dict(SMALL), 4, 2, r"model.num_heads=4 is not divisible by parallel.tp × parallel.sp"),
    (dict(SMALL, num_heads=8, num_kv_heads=2, pe="rope"), 2, 2, r"model.num_kv_heads=2"),
    (dict(SMALL, intermediate_size=130), 1, 4, r"model.intermediate_size=130"),
    (dict(SMALL, pe="alibi"), 2, 1, r"model.pe=alibi is not supported with parallel.sp=2"),
    (dict(SMALL, pe="randpe"), 1, 2, r"model.pe=randpe"),
    (dict(SMALL, tape_train_offset=True), 2, 1, r"tape_train_offset"),
])
def test_model_checks_fail_before_any_process_group(cfg, sp, tp, match):
    grid = RankGrid.from_sizes(sp * tp * 2, sp=sp, tp=tp, rank=0)
    with pytest.raises(ValueError, match=match):
        grid.check_model(ModelConfig(**cfg))
    assert not dist.is_initialized()


def test_supported_models_pass_the_check():
    for pe in ("tape", "rope", "nope", "xpos"):
        RankGrid.from_sizes(8, sp=2, tp=2, rank=0).check_model(ModelConfig(**SMALL, pe=pe))
    for pe in ("alibi", "t5", "fire"):  # bias encodings: fine under TP, not under SP
        RankGrid.from_sizes(4, tp=2, rank=0).check_model(ModelConfig(**SMALL, pe=pe))


def test_build_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        RankGrid.from_sizes(2, tp=2, rank=0).build()


def test_partition_specs_cover_exactly_the_projections():
    """Our regexes and DeepSpeed's own matcher agree on every parameter of the model."""
    from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType

    ds_specs = AutoTPConfig.from_dict(autotp_partition_config())
    model = TransformerLM(ModelConfig(**SMALL, pe="tape"))
    expected = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
                "o_proj": 1, "down_proj": 1}
    names = {name for name, _ in model.named_parameters()}
    for tape_param in ("w_pa", "w_up", "w_dn", "w_x.weight"):
        assert f"layers.0.pos_update.{tape_param}" in names  # present, and replicated:
        assert partition_dim(f"layers.0.pos_update.{tape_param}") is None
    for name, _ in model.named_parameters():
        module = name.split(".")[-2]
        want = expected.get(module) if name.startswith("layers.") else None
        assert partition_dim(name) == want, name
        spec = ds_specs.find_matching_spec(name)
        got = None if spec is None else {PartitionType.COLUMN: 0, PartitionType.ROW: 1}[
            spec.partition_type]
        assert got == want, f"DeepSpeed would split {name} along {got}, expected {want}"


def test_deepspeed_config_updates():
    assert deepspeed_config_updates(RankGrid.from_sizes(4, sp=4, rank=0)) == {}
    section = deepspeed_config_updates(RankGrid.from_sizes(4, tp=2, rank=0))["tensor_parallel"]
    assert section["autotp_size"] == 2
    assert section["partition_config"]["use_default_specs"] is False


def test_loss_scale_is_dp_times_sp():
    grid = RankGrid.from_sizes(8, sp=2, tp=2, rank=0)
    assert loss_scale(grid) == 4
    assert loss_scale(grid, zero_stage=1, reduce_scatter=False) == 4
    with pytest.raises(ValueError, match="stage=4"):
        loss_scale(grid, zero_stage=4)


def test_shard_batch_reassembles_and_positions_are_global():
    ids = torch.arange(2 * 12).reshape(2, 12)
    labels = ids + 100
    chunks = []
    for rank in range(6):  # sp=3, tp=2: tp ranks of one sp rank get the same chunk
        grid = RankGrid.from_sizes(6, sp=3, tp=2, rank=rank)
        i, lab, pos = shard_batch({"input_ids": ids, "labels": labels}, grid)
        assert torch.equal(lab, i + 100)  # labels cut exactly like inputs
        assert torch.equal(pos, torch.arange(4 * grid.sp_rank, 4 * grid.sp_rank + 4)[None])
        if grid.tp_rank == 0:
            chunks.append(i)
    assert torch.equal(torch.cat(chunks, dim=1), ids)
    with pytest.raises(ValueError, match="length 12 is not divisible by parallel.sp=5"):
        shard_batch({"input_ids": ids, "labels": labels}, RankGrid.from_sizes(5, sp=5, rank=0))
