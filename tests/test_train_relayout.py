"""Resume on another parallel layout: the rules (``tape_train.train.relayout``) and a ZeRO-1
round trip on synthetic data (the ZeRO-3 DP/SP/TP cases on real text are in
``test_train_resume.py``)."""

from __future__ import annotations

import pytest

from distributed import run_distributed_test
from tape_train.config import load_run_config
from tape_train.parallel import RankGrid
from tape_train.train import relayout

SYNTHETIC = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256",
             "model.tape_position_size=8", "train.seq_len=32", "train.micro_batch_size=2",
             "train.lr=1e-3", "train.warmup_steps=0", "train.dtype=fp32", "train.device=cpu",
             "train.synthetic_data=true", "train.max_steps=8", "checkpoint.interval=4",
             "logging.peak_tflops=1.0", "logging.tensorboard=false", "eval.interval=0"]


def _marker(dp=2, sp=1, tp=1, mb=2, gas=1, sharding="global", zero=3, synthetic=False) -> dict:
    return {"layout": {"dp": dp, "sp": sp, "tp": tp}, "zero_stage": zero,
            "config": {"train": {"micro_batch_size": mb, "grad_accum_steps": gas,
                                 "synthetic_data": synthetic},
                       "data": {"sharding": sharding}}}


def _now(world, gas=1, mb=2, **parallel):
    cfg = load_run_config(None, ["model=tiny", f"train.micro_batch_size={mb}",
                                 f"train.grad_accum_steps={gas}"])
    return cfg, RankGrid.from_sizes(world, rank=0, **parallel)


def test_layout_change_rules_name_what_breaks_and_how_to_fix_it():
    assert relayout.plan(_marker(), *_now(2)) is None  # same layout: nothing to do
    moved = relayout.plan(_marker(), *_now(1, gas=2))
    assert moved.universal and "dp=2 sp=1 tp=1 -> dp=1 sp=1 tp=1" in moved.describe()
    assert relayout.problems(_marker(), *_now(1, gas=2)) == []
    assert relayout.problems(_marker(), *_now(1, mb=4)) == []  # any split of the same batch
    (batch,) = relayout.problems(_marker(), *_now(1, gas=1))
    assert "global batch changes from 4 to 2" in batch and "train.grad_accum_steps=2" in batch
    (odd,) = relayout.problems(_marker(dp=3), *_now(2, gas=1))
    assert "no train.grad_accum_steps keeps it" in odd
    (docs,) = relayout.problems(_marker(sharding="documents"), *_now(1, gas=2))
    assert "data.sharding='documents'" in docs and "data.sharding: global" in docs
    # Documents sharding is fine when only sp/tp change (each dp rank keeps its stream).
    assert relayout.problems(_marker(dp=1, tp=2, gas=2, sharding="documents"),
                             *_now(1, gas=2)) == []
    assert relayout.problems(_marker(sharding="documents", synthetic=True),
                             *_now(1, gas=2)) == []
    (zero0,) = relayout.problems(_marker(dp=1, tp=2, gas=2, zero=0), *_now(1, gas=2))
    assert "ZeRO-0" in zero0
    assert not relayout.plan(_marker(dp=2, zero=0), *_now(1, gas=2)).universal


def test_each_new_rank_continues_the_saved_rank_at_its_data_parallel_coordinate():
    saved = {"dp": 2, "sp": 2, "tp": 2}  # ranks: dp0 -> 0..3, dp1 -> 4..7
    assert [relayout.source_rank(saved, RankGrid.from_sizes(4, rank=r, tp=2))
            for r in range(4)] == [0, 0, 4, 4]
    assert [relayout.source_rank(saved, RankGrid.from_sizes(3, rank=r)) for r in range(3)] \
        == [0, 4, 0]


def _zero1_round_trip(run_root: str) -> dict:
    """At 1 process: the uninterrupted run (grad_accum 2), and the resume of the 2-process
    run's step-4 checkpoint (saved by the caller) with grad_accum 2."""
    from tape_train.train.loop import Trainer

    losses = {}
    for name in ("straight", "resumed"):
        trainer = Trainer(load_run_config(None, SYNTHETIC + [
            "parallel.zero_stage=1", "train.grad_accum_steps=2",
            f"train.run_dir={run_root}/{name}"]))
        trainer.setup()
        losses[name] = {}
        while trainer.state.step < 8:
            loss = trainer.train_step()["loss"]
            losses[name][trainer.state.step] = loss
        trainer.close()
    return losses


def _train_two_ranks(run_dir: str) -> None:
    from tape_train.train.loop import Trainer

    trainer = Trainer(load_run_config(None, SYNTHETIC + [
        "parallel.zero_stage=1", "train.max_steps=8", f"train.run_dir={run_dir}"]))
    trainer.setup()
    for _ in range(4):
        trainer.train_step()
    trainer.save()
    trainer.close()


@pytest.mark.distributed
def test_zero1_checkpoint_resumes_on_one_process(tmp_path):
    import shutil

    run_distributed_test(_train_two_ranks, world_size=2, args=(str(tmp_path / "two"),),
                         timeout=300)
    shutil.copytree(tmp_path / "two" / "checkpoints", tmp_path / "resumed" / "checkpoints")
    losses = run_distributed_test(_zero1_round_trip, world_size=1, args=(str(tmp_path),),
                                  timeout=300)[0]
    assert sorted(losses["resumed"]) == [5, 6, 7, 8]
    assert (tmp_path / "resumed" / "checkpoints" / "step_00000004" / "universal").is_dir()
    for step, loss in losses["resumed"].items():
        assert loss == pytest.approx(losses["straight"][step], rel=1e-5, abs=1e-6), step
    assert len({round(v, 5) for v in losses["straight"].values()}) > 3  # the losses move
