"""Non-finite losses: the update is skipped on all ranks, counted, and too many in a row stop
the run with a checkpoint (whose TensorBoard log is checked too). Runs the real Trainer (ZeRO-3, fp32) in a spawned process and
injects NaN through a forward hook on the LM head at chosen steps."""

from __future__ import annotations

import pytest

from distributed import run_distributed_test

OVERRIDES = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256",
             "model.tape_position_size=8", "train.seq_len=32", "train.micro_batch_size=2",
             "train.grad_accum_steps=2", "train.lr=1e-3", "train.warmup_steps=0",
             "train.dtype=fp32", "train.device=cpu", "train.synthetic_data=true",
             "train.max_bad_steps=3", "train.max_steps=8", "checkpoint.interval=100",
             "logging.peak_tflops=1.0", "logging.tensorboard=false", "eval.interval=0"]


def _full_params(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _nan_scenarios(run_dir: str) -> dict:
    import math

    from tape_train.config import load_run_config
    from tape_train.train.checkpoint import find_latest_complete, read_marker
    from tape_train.train.loop import Trainer

    out = {}
    # 1. A transient NaN at step 3: skipped, weights untouched, training continues.
    trainer = Trainer(load_run_config(None, OVERRIDES + [f"train.run_dir={run_dir}/a"]))
    trainer.setup()
    poison = {"on": False}
    trainer.model.lm_head.register_forward_hook(
        lambda module, args, output: output * float("nan") if poison["on"] else None)
    params, losses = [_full_params(trainer.engine)], []
    for step in range(1, 6):
        poison["on"] = step == 3
        losses.append(trainer.train_step()["loss"])
        params.append(_full_params(trainer.engine))
    trainer.close()
    out["losses"] = losses
    out["skipped"] = trainer.state.skipped_steps
    out["unchanged_by_skip"] = all((params[3][n] == params[2][n]).all() for n in params[2])
    out["changed_by_good_step"] = any((params[4][n] != params[3][n]).any() for n in params[3])
    out["finite_after"] = all(t.isfinite().all() for t in params[5].values())
    out["loss_finite"] = [math.isfinite(x) for x in losses]

    # 2. NaN from step 2 on: stop after max_bad_steps=3 in a row, with a checkpoint.
    trainer = Trainer(load_run_config(None, OVERRIDES + [f"train.run_dir={run_dir}/b",
                                                         "logging.tensorboard=true"]))
    trainer.setup()
    trainer.model.lm_head.register_forward_hook(
        lambda module, args, output: output * float("nan") if trainer.state.step >= 1 else None)
    out["exit_code"] = trainer.train()
    trainer.close()
    tag = find_latest_complete(f"{run_dir}/b")
    out["checkpoint_step"] = read_marker(tag)["step"] if tag else None
    out["checkpoint_skipped"] = read_marker(tag)["train_state"]["skipped_steps"] if tag else None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{run_dir}/b/tensorboard")
    events.Reload()
    out["tb_tags"] = events.Tags()["scalars"]
    out["tb_loss_steps"] = [e.step for e in events.Scalars("train/loss")]
    return out


@pytest.mark.distributed
def test_nan_loss_skips_update_and_too_many_stop_with_checkpoint(tmp_path):
    [result] = run_distributed_test(_nan_scenarios, world_size=1, args=(str(tmp_path),),
                                    timeout=300)
    assert result["loss_finite"] == [True, True, False, True, True]
    assert result["skipped"] == 1
    assert result["unchanged_by_skip"]          # the NaN step did not touch the weights
    assert result["changed_by_good_step"]       # negative control: a normal step does
    assert result["finite_after"]               # no NaN leaked into weights or Adam moments
    assert result["exit_code"] == 1
    assert result["checkpoint_step"] == 4 and result["checkpoint_skipped"] == 3
    # TensorBoard got the finite losses only (NaN scalars are left out), plus the rest.
    assert result["tb_loss_steps"] == [1]
    for tag in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu",
                "train/data_wait_frac", "mem/rss_gib", "train/skipped_steps"):
        assert tag in result["tb_tags"], tag
