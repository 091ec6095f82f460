"""Resume on another parallel layout: the rules (``tape_train.train.relayout``), a ZeRO-1
round trip and a ZeRO-3 TP1 → TP2 resume on synthetic data (the ZeRO-3 DP/SP/TP → 1 cases on
real text are in ``test_train_resume.py``)."""

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


def test_a_zero_stage_change_into_or_out_of_zero3_or_zero0_cannot_be_loaded():
    def why(saved, now):
        cfg, _ = _now(1)
        cfg.parallel.zero_stage = now
        return relayout.unloadable(_marker(zero=saved), cfg)

    assert why(3, 1) == ("parallel.zero_stage changes from 3 to 1: DeepSpeed cannot load a "
                         "ZeRO-3 checkpoint into a ZeRO-1 engine (universal form included); "
                         "resume with parallel.zero_stage=3")
    for saved, now in ((1, 3), (3, 2), (0, 1), (1, 0), (0, 3)):
        assert f"from {saved} to {now}" in why(saved, now), (saved, now)
        assert why(saved, now).endswith(f"resume with parallel.zero_stage={saved}")
    for saved, now in ((1, 2), (2, 1), (3, 3), (0, 0)):
        assert why(saved, now) is None, (saved, now)


def test_each_new_rank_continues_the_saved_rank_at_its_data_parallel_coordinate():
    saved = {"dp": 2, "sp": 2, "tp": 2}  # ranks: dp0 -> 0..3, dp1 -> 4..7
    assert [relayout.source_rank(saved, RankGrid.from_sizes(4, rank=r, tp=2))
            for r in range(4)] == [0, 0, 4, 4]
    assert [relayout.source_rank(saved, RankGrid.from_sizes(3, rank=r)) for r in range(3)] \
        == [0, 4, 0]


def _round_trip(run_root: str, stage: int) -> dict:
    """At 1 process: the uninterrupted run (grad_accum 2), and the resume of the 2-process
    run's step-4 checkpoint (saved by the caller) with grad_accum 2."""
    from tape_train.train.loop import Trainer

    losses = {}
    for name in ("straight", "resumed"):
        trainer = Trainer(load_run_config(None, SYNTHETIC + [
            f"parallel.zero_stage={stage}", "train.grad_accum_steps=2",
            f"train.run_dir={run_root}/{name}"]))
        trainer.setup()
        losses[name] = {}
        while trainer.state.step < 8:
            loss = trainer.train_step()["loss"]
            losses[name][trainer.state.step] = loss
        trainer.close()
    return losses


def _train_two_ranks(run_dir: str, stage: int) -> None:
    from tape_train.train.loop import Trainer

    trainer = Trainer(load_run_config(None, SYNTHETIC + [
        f"parallel.zero_stage={stage}", "train.max_steps=8", f"train.run_dir={run_dir}"]))
    trainer.setup()
    for _ in range(4):
        trainer.train_step()
    trainer.save()
    trainer.close()


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1])
def test_zero_checkpoint_resumes_on_one_process(tmp_path, stage):
    """DP2 → DP1: ZeRO-1 through the universal form; ZeRO-0 (whole weights in one file)
    loads directly, which the world-size check of a same-layout resume used to refuse."""
    import shutil

    run_distributed_test(_train_two_ranks, world_size=2, args=(str(tmp_path / "two"), stage),
                         timeout=300)
    shutil.copytree(tmp_path / "two" / "checkpoints", tmp_path / "resumed" / "checkpoints")
    losses = run_distributed_test(_round_trip, world_size=1, args=(str(tmp_path), stage),
                                  timeout=300)[0]
    assert sorted(losses["resumed"]) == [5, 6, 7, 8]
    universal = tmp_path / "resumed" / "checkpoints" / "step_00000004" / "universal"
    assert universal.is_dir() == (stage == 1)
    for step, loss in losses["resumed"].items():
        assert loss == pytest.approx(losses["straight"][step], rel=1e-5, abs=1e-6), step
    assert len({round(v, 5) for v in losses["straight"].values()}) > 3  # the losses move


def _zero3_one_rank(run_dir: str) -> dict:
    """One process, ZeRO-3 without tensor parallelism (grad_accum 2): 8 steps, with the
    step-4 checkpoint saved on the way. Returns the losses of every step."""
    from tape_train.train.loop import Trainer

    trainer = Trainer(load_run_config(None, SYNTHETIC + [
        "parallel.zero_stage=3", "train.grad_accum_steps=2", f"train.run_dir={run_dir}"]))
    trainer.setup()
    losses = {}
    while trainer.state.step < 8:
        loss = trainer.train_step()["loss"]
        losses[trainer.state.step] = loss
        if trainer.state.step == 4:
            trainer.save()
    trainer.close()
    return losses


def _zero3_tp2_resume(run_dir: str) -> dict:
    from tape_train.train.loop import Trainer

    trainer = Trainer(load_run_config(None, SYNTHETIC + [
        "parallel.zero_stage=3", "parallel.tp=2", "train.grad_accum_steps=2",
        f"train.run_dir={run_dir}"]))
    trainer.setup()
    losses = {}
    while trainer.state.step < 8:
        loss = trainer.train_step()["loss"]
        losses[trainer.state.step] = loss
    trainer.close()
    return losses


@pytest.mark.distributed
def test_zero3_checkpoint_without_tensor_parallelism_resumes_at_tp2(tmp_path):
    """TP1 → TP2: DeepSpeed's converter writes a ZeRO-3 checkpoint without TP as bare tensors,
    which its loader does not cut into TP shards (the resume failed with "start (…) + length
    (…) exceeds dimension size (…)"); stored as dicts, the TP2 resume continues the one-process
    run's losses."""
    import shutil

    straight = run_distributed_test(_zero3_one_rank, world_size=1,
                                    args=(str(tmp_path / "one"),), timeout=300)[0]
    tag = "step_00000004"
    shutil.copytree(tmp_path / "one" / "checkpoints" / tag,
                    tmp_path / "tp2" / "checkpoints" / tag)
    resumed = run_distributed_test(_zero3_tp2_resume, world_size=2,
                                   args=(str(tmp_path / "tp2"),), timeout=300)
    assert resumed[0] == resumed[1]
    assert sorted(resumed[0]) == [5, 6, 7, 8]
    for step, loss in resumed[0].items():
        assert loss == pytest.approx(straight[step], rel=1e-5, abs=1e-6), step
    assert len({round(v, 5) for v in straight.values()}) > 3  # the losses move


_BARE_CONVERTER = """import os, sys, torch
out = sys.argv[sys.argv.index("--output_folder") + 1]
for name in ("embed.weight", "layers.0.attn.q_proj.weight"):
    os.makedirs(os.path.join(out, "zero", name))
    for i, state in enumerate(("exp_avg", "exp_avg_sq", "fp32")):
        torch.save(torch.arange(6.0) + i, os.path.join(out, "zero", name, state + ".pt"))
torch.save({"optimizer_state_dict": {}}, os.path.join(out, "zero", "optimizer_state.pt"))
"""


@pytest.mark.parametrize("cached", [False, True])
def test_universal_form_of_a_zero3_checkpoint_stores_every_state_as_a_dict(
        tmp_path, monkeypatch, cached):
    """What DeepSpeed's ZeRO-3 loader needs to cut TP shards (see the test above), made fast:
    a converter writing bare tensors, as DeepSpeed's does for ZeRO-3 without TP. For a load at
    tp > 1, fresh conversions and universal forms cached without it (one file already done,
    as a killed pass leaves them) end with every state as ``{"param": tensor}``, values
    intact; the optimizer's global state is left alone. A load at tp = 1 rewrites nothing."""
    import json
    import subprocess
    import sys

    import torch

    from tape_train import loading

    tag = tmp_path / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps(
        {"files": {}, "zero_stage": 3, "layout": {"dp": 2, "sp": 1, "tp": 1}}))
    script = tmp_path / "converter.py"
    script.write_text(_BARE_CONVERTER)
    command = lambda tag_dir, out: [sys.executable, str(script), "--output_folder", str(out)]  # noqa: E731
    if cached:
        subprocess.run(command(tag, tag / "universal"), check=True)
        first = tag / "universal" / "zero" / "embed.weight" / "exp_avg.pt"
        torch.save({"param": torch.load(first)}, first)
        monkeypatch.setattr(loading, "converter_command", None)  # must not convert again
    else:
        monkeypatch.setattr(loading, "converter_command", command)
        bare = loading.ensure_universal(tag, out_dir=tmp_path / "for-tp1")
        assert torch.is_tensor(torch.load(bare / "zero" / "embed.weight" / "fp32.pt"))
    universal = loading.ensure_universal(tag, tensor_parallel=True)
    files = sorted(universal.glob("zero/*/*.pt"))
    assert len(files) == 6
    for path in files:
        state = torch.load(path, weights_only=False)
        assert isinstance(state, dict) and set(state) == {"param"}, path
        offset = ("exp_avg", "exp_avg_sq", "fp32").index(path.stem)
        assert torch.equal(state["param"], torch.arange(6.0) + offset), path
    assert torch.load(universal / "zero" / "optimizer_state.pt") == {"optimizer_state_dict": {}}
    assert loading.read_universal_weights(universal)["embed.weight"].shape == (6,)


def test_an_unreadable_file_of_a_cached_universal_form_is_named_with_the_fix(tmp_path):
    """A damaged state file in a cached universal form (a disk error) is named, with what to
    do: delete the form, which the next run converts anew; the checkpoint is not touched."""
    import json

    import torch

    from tape_train import loading

    tag = tmp_path / "checkpoints" / "step_00000004"
    state = tag / "universal" / "zero" / "norm.weight"
    state.mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps(
        {"files": {}, "zero_stage": 3, "layout": {"dp": 2, "sp": 1, "tp": 1}}))
    torch.save(torch.ones(4), state / "exp_avg.pt")
    (state / "fp32.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(loading.CheckpointError) as failed:
        loading.ensure_universal(tag, tensor_parallel=True)
    message = str(failed.value)
    assert message.startswith(f"{state / 'fp32.pt'} of the universal form is unreadable (")
    assert message.endswith(f"delete {tag / 'universal'} and run again: it is converted anew "
                            f"from the checkpoint, which is untouched")
