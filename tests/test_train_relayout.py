"""Resume on another parallel layout: the rules (``tape_train.train.relayout``), a ZeRO-1
round trip, a ZeRO-3 TP1 → TP2 resume and ZeRO-3 ↔ ZeRO-1 resumes on synthetic data (the
ZeRO-3 DP/SP/TP → 1 cases on real text are in ``test_train_resume.py``)."""

from __future__ import annotations

from pathlib import Path

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
    # A ZeRO-0 checkpoint cannot change tp: refused whatever --allow-config-change says (it
    # was a problem that flag overrode, and the load then failed on every weight's shape).
    cfg, grid = _now(1, gas=2)
    cfg.parallel.zero_stage = 0
    assert relayout.problems(_marker(dp=1, tp=2, gas=2, zero=0), cfg, grid) == []
    assert relayout.unloadable(_marker(dp=1, tp=2, gas=2, zero=0), cfg) == (
        "a ZeRO-0 checkpoint stores one weight shard per tensor-parallel rank and cannot be "
        "re-split (saved tp=2, now tp=1); DeepSpeed's universal conversion needs ZeRO-1/2/3: "
        "resume with parallel.tp=2")
    assert relayout.unloadable(_marker(dp=2, zero=0), cfg) is None  # dp and sp may change
    assert not relayout.plan(_marker(dp=2, zero=0), *_now(1, gas=2)).universal


def test_the_zero_stage_may_change_among_1_2_3_and_not_into_or_out_of_zero0():
    def now(stage, world=2):
        cfg, grid = _now(world)
        cfg.parallel.zero_stage = stage
        return cfg, grid

    assert relayout.unloadable(_marker(zero=1), *now(0)[:1]) == (
        "parallel.zero_stage changes from 1 to 0: DeepSpeed cannot load a ZeRO-1 checkpoint "
        "into a ZeRO-0 engine (universal form included: ZeRO-0 keeps no optimizer shards, and "
        "a ZeRO-0 engine has no universal load); resume with parallel.zero_stage=1, 2 or 3")
    for saved, stage in ((3, 0), (2, 0), (0, 1), (0, 3)):
        why = relayout.unloadable(_marker(zero=saved), now(stage)[0])
        assert f"from {saved} to {stage}" in why, (saved, stage)
        assert why.endswith("parallel.zero_stage=0" if saved == 0 else "1, 2 or 3"), why
    for saved, stage in ((1, 2), (2, 1), (3, 1), (1, 3), (2, 3), (3, 2), (3, 3), (0, 0)):
        assert relayout.unloadable(_marker(zero=saved), now(stage)[0]) is None, (saved, stage)
    # Into or out of ZeRO-3 through the universal form, at the same layout too; ZeRO-1 <-> 2
    # share their files and load directly.
    moved = relayout.plan(_marker(zero=3), *now(1))
    assert moved.universal and (moved.saved_stage, moved.stage) == (3, 1)
    assert moved.describe() == ("dp=2 sp=1 tp=1 -> dp=2 sp=1 tp=1 (ZeRO-3 -> ZeRO-1, DeepSpeed "
                                "universal checkpoint)")
    assert relayout.plan(_marker(zero=2), *now(3)).universal
    assert relayout.plan(_marker(zero=1), *now(2)) is None
    assert "ZeRO" not in relayout.plan(_marker(), *now(3, world=1)).describe()  # dp only
    # A layout change, like dp: no problem to report, nothing protected.
    changes = relayout.classify_changes([("parallel.zero_stage", 3, 1)])
    assert changes.layout == [("parallel.zero_stage", 3, 1)] and not changes.protected


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


def _one_rank_saving_step4(run_dir: str, stage: int = 3) -> dict:
    """One process, ZeRO-``stage`` without tensor parallelism (grad_accum 2): 8 steps, with
    the step-4 checkpoint saved on the way. Returns the losses of every step."""
    from tape_train.train.loop import Trainer

    trainer = Trainer(load_run_config(None, SYNTHETIC + [
        f"parallel.zero_stage={stage}", "train.grad_accum_steps=2", f"train.run_dir={run_dir}"]))
    trainer.setup()
    losses = {}
    while trainer.state.step < 8:
        loss = trainer.train_step()["loss"]
        losses[trainer.state.step] = loss
        if trainer.state.step == 4:
            trainer.save()
    trainer.close()
    return losses


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """The uninterrupted one-process ZeRO-3 run: ``(its step-4 tag, losses by step)``."""
    run_dir = tmp_path_factory.mktemp("zero3") / "one"
    losses = run_distributed_test(_one_rank_saving_step4, world_size=1, args=(str(run_dir),),
                                  timeout=300)[0]
    assert len({round(v, 5) for v in losses.values()}) > 3  # the losses move
    return run_dir / "checkpoints" / "step_00000004", losses


def _copy_tag(tag, run_dir):
    import shutil

    shutil.copytree(tag, run_dir / "checkpoints" / tag.name)
    return run_dir / "checkpoints" / tag.name


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
def test_zero3_checkpoint_without_tensor_parallelism_resumes_at_tp2(tmp_path, zero3_run):
    """TP1 → TP2: DeepSpeed's converter writes a ZeRO-3 checkpoint without TP as bare tensors,
    which its loader does not cut into TP shards (the resume failed with "start (…) + length
    (…) exceeds dimension size (…)"); stored as dicts, the TP2 resume continues the one-process
    run's losses."""
    tag, straight = zero3_run
    _copy_tag(tag, tmp_path / "tp2")
    resumed = run_distributed_test(_zero3_tp2_resume, world_size=2,
                                   args=(str(tmp_path / "tp2"),), timeout=300)
    assert resumed[0] == resumed[1]
    assert sorted(resumed[0]) == [5, 6, 7, 8]
    for step, loss in resumed[0].items():
        assert loss == pytest.approx(straight[step], rel=1e-5, abs=1e-6), step


def _resume_step4(run_dir: str, stage: int, grad_accum: int, negative_control: bool = False):
    """Resume the step-4 checkpoint of ``run_dir`` with ZeRO-``stage`` and train to step 8.
    Returns the state just loaded (``_loaded_state``), the losses of steps 5-8 and, with
    ``negative_control`` (one process), the error of loading the universal form as DeepSpeed
    converts it into this run's engine, tried first."""
    from tape_train.train.loop import Trainer

    cfg = load_run_config(None, SYNTHETIC + [
        f"parallel.zero_stage={stage}", f"train.grad_accum_steps={grad_accum}",
        f"train.run_dir={run_dir}"])
    error = _unfitted_load_error(cfg) if negative_control else None
    trainer = Trainer(cfg)
    trainer.setup()
    loaded = _loaded_state(trainer.engine)
    losses = {}
    while trainer.state.step < 8:
        loss = trainer.train_step()["loss"]
        losses[trainer.state.step] = loss
    trainer.close()
    return loaded, losses, error


def _unfitted_load_error(cfg) -> str:
    from tape_train import loading
    from tape_train.model import TransformerLM
    from tape_train.parallel import RankGrid, parallelize
    from tape_train.train import checkpoint as ckpt
    from tape_train.train.engine import build_engine

    tag = Path(cfg.train.run_dir) / "checkpoints" / "step_00000004"
    loading.ensure_universal(tag)  # cached as converted: the trainer fits it later
    grid = RankGrid.from_sizes(1, rank=0)
    grid.build()
    engine, _ = build_engine(cfg, parallelize(TransformerLM(cfg.model), grid), grid,
                             load_universal=True)
    with pytest.raises(ckpt.CheckpointError) as failed:
        ckpt.load_training_state(engine, tag, 0, universal=True)
    return str(failed.value)


def _loaded_state(engine) -> tuple[dict, list]:
    """Every parameter's whole module weight, fp32 master weight and AdamW moments (gathered
    under ZeRO-3: collective), and the distinct AdamW steps."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):  # no-op below ZeRO-3
        module = {name: p.detach().clone() for name, p in params.items()}
    state = {name: {"module": module[name], "fp32": safe_get_full_fp32_param(p),
                    "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                    "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
             for name, p in params.items()}
    steps = sorted({float(s["step"]) for s in engine.optimizer.optimizer.state.values()})
    return state, steps


def _check_loaded(loaded, tag) -> None:
    """``_resume_step4``'s loaded state against the saved checkpoint: weights (module and
    fp32 master) equal its fp32 master weights (DeepSpeed's zero_to_fp32, not the universal
    route), the moments equal those of its universal form, AdamW at step 4."""
    import torch

    from tape_train import loading

    state, steps = loaded
    _, master, _ = loading.load_model_from_checkpoint(tag, verify=False)
    assert steps == [4.0]
    assert sorted(state) == sorted(master)
    for name, values in state.items():
        assert torch.equal(values["module"], master[name]), name
        assert torch.equal(values["fp32"], master[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            saved = torch.load(tag / "universal" / "zero" / name / f"{key}.pt",
                               weights_only=False)
            saved = saved["param"] if isinstance(saved, dict) else saved
            assert torch.equal(values[key], saved.view_as(values[key])), (name, key)
            assert values[key].abs().sum() > 0, (name, key)  # carried, not fresh zeros


def _file_sums(tag) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in tag.iterdir() if p.is_file()}


@pytest.mark.distributed
def test_zero3_checkpoint_resumes_with_zero1(tmp_path, zero3_run):
    """ZeRO-3 -> ZeRO-1 at the same layout: the universal form, fitted for ZeRO-1 (its
    model-states file, AdamW's step per parameter), loads the saved weights and moments, and
    the next steps continue the uninterrupted ZeRO-3 run. The checkpoint's own files are not
    changed. Negative control: the universal form as DeepSpeed converts it fails to load
    into the ZeRO-1 engine (no mp_rank_*_model_states.pt), as the refusal said before."""
    source, straight = zero3_run
    tag = _copy_tag(source, tmp_path)
    before = _file_sums(tag)
    loaded, losses, error = run_distributed_test(_resume_step4, world_size=1,
                                                 args=(str(tmp_path), 1, 2, True),
                                                 timeout=300)[0]
    assert error.startswith(f"could not load checkpoint {tag} (universal form): "
                            f"AssertionError"), error
    assert (tag / "universal" / "FOR_ZERO1_2.json").is_file()
    assert (tag / "universal" / "mp_rank_00_model_states.pt").is_file()
    _check_loaded(loaded, tag)
    assert sorted(losses) == [5, 6, 7, 8]
    for step, loss in losses.items():
        assert loss == pytest.approx(straight[step], rel=1e-5, abs=1e-6), step
    after = _file_sums(tag)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) <= {"latest_universal"}  # DeepSpeed's converter's pointer


@pytest.mark.distributed
def test_zero1_checkpoint_resumes_with_zero3_on_two_processes(tmp_path, zero3_run):
    """ZeRO-1 (one process) -> ZeRO-3 on two (dp 2, the same global batch): the universal
    form fitted for ZeRO-3 (its model-states file, AdamW's step in the optimizer state)
    loads the saved weights and moments on both ranks, and the next steps continue the
    uninterrupted ZeRO-1 run and the ZeRO-3 one."""
    straight = run_distributed_test(_one_rank_saving_step4, world_size=1,
                                    args=(str(tmp_path / "one"), 1), timeout=300)[0]
    tag = _copy_tag(tmp_path / "one" / "checkpoints" / "step_00000004", tmp_path / "two")
    resumed = run_distributed_test(_resume_step4, world_size=2,
                                   args=(str(tmp_path / "two"), 3, 1), timeout=300)
    assert (tag / "universal" / "FOR_ZERO3.json").is_file()
    assert resumed[0][1] == resumed[1][1] and sorted(resumed[0][1]) == [5, 6, 7, 8]
    for loaded, _, _ in resumed:
        _check_loaded(loaded, tag)
    for step, loss in resumed[0][1].items():
        assert loss == pytest.approx(straight[step], rel=1e-5, abs=1e-6), step
        assert loss == pytest.approx(zero3_run[1][step], rel=1e-5, abs=1e-6), step


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


@pytest.mark.parametrize("stage, gone", [(1, "zero/embed.weight/fp32.pt"),
                                         (2, "zero/norm.weight/step.pt"),
                                         (3, "zero_pp_rank_0_mp_rank_00_model_states.pt")])
def test_a_universal_form_missing_a_file_its_engine_needs_is_refused_naming_it(
        tmp_path, stage, gone):
    """DeepSpeed's ZeRO-1/2 universal load reads whichever state files it finds: a form cut
    short of a parameter's fp32.pt loaded that weight as freshly initialised, without its
    step.pt AdamW's step restarted, silently. Each file a stage's load needs is checked first
    (a listing, no read), also where the fitting marker says the form is ready."""
    import json

    from tape_train import loading

    tag = tmp_path / "checkpoints" / "step_00000004"
    universal = tag / "universal"
    (universal / "zero").mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps(
        {"files": {}, "zero_stage": 1, "layout": {"dp": 2, "sp": 1, "tp": 1}}))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                 "FOR_ZERO3.json", "zero/optimizer_state.pt"):
        (universal / name).touch()
    for param in ("embed.weight", "norm.weight"):
        (universal / "zero" / param).mkdir()
        for state in ("fp32", "exp_avg", "exp_avg_sq", "step"):
            (universal / "zero" / param / f"{state}.pt").touch()
    assert loading.ensure_universal(tag, zero_stage=stage) == universal
    (universal / gone).unlink()
    with pytest.raises(loading.CheckpointError) as failed:
        loading.ensure_universal(tag, zero_stage=stage)
    named = gone.replace("mp_rank_00", "mp_rank_*")  # the file of any tensor-parallel rank
    assert str(failed.value) == (
        f"{universal / named} is missing from the universal form, which a ZeRO-{stage} engine "
        f"needs; delete {universal} and run again: it is converted anew from the checkpoint, "
        f"which is untouched")


@pytest.mark.parametrize("cached_flat", [False, True])
def test_states_of_a_zero3_form_without_tp_take_their_parameters_shapes(tmp_path, cached_flat):
    """DeepSpeed's converter writes a ZeRO-3 checkpoint without TP as flat tensors; its
    ZeRO-1/2 loader at tp > 1 needs each state in its parameter's shape (a ZeRO-3 -> ZeRO-1
    resume at tp 2 failed with "full param numel 16384 != tensor slice numel 16384 *
    tp_world_size 2"). Fresh forms and forms wrapped flat earlier (``cached_flat``) get the
    shapes of the saved model states, values intact; ``step.pt`` stays as it is."""
    import json

    import torch

    from tape_train import loading

    tag = tmp_path / "checkpoints" / "step_00000004"
    universal = tag / "universal"
    (universal / "zero").mkdir(parents=True)
    (tag / "COMPLETE.json").write_text(json.dumps(
        {"files": {}, "zero_stage": 3, "layout": {"dp": 2, "sp": 1, "tp": 1}}))
    shapes = {"proj.weight": (2, 3), "norm.weight": (6,)}
    torch.save({"param_shapes": [{k: torch.Size(v) for k, v in shapes.items()}]},
               universal / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for param in shapes:
        (universal / "zero" / param).mkdir()
        for i, state in enumerate(("exp_avg", "exp_avg_sq", "fp32")):
            flat = torch.arange(6.0) + i
            torch.save({"param": flat} if cached_flat else flat,
                       universal / "zero" / param / f"{state}.pt")
        torch.save(torch.tensor(4.0), universal / "zero" / param / "step.pt")
    loading.ensure_universal(tag, tensor_parallel=True)
    for param, shape in shapes.items():
        for i, state in enumerate(("exp_avg", "exp_avg_sq", "fp32")):
            saved = torch.load(universal / "zero" / param / f"{state}.pt")
            assert set(saved) == {"param"}, (param, state)
            assert torch.equal(saved["param"], (torch.arange(6.0) + i).reshape(shape))
        assert torch.equal(torch.load(universal / "zero" / param / "step.pt"), torch.tensor(4.0))
