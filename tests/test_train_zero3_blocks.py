"""``parallel.zero3_gather_blocks``: under ZeRO-3 each decoder block is one DeepSpeed "leaf"
(its parameters fetched and released together, no hooks on the modules inside it). Every
parameter is partitioned here (persistence threshold 0, 2 ranks), so the gathers are real:
the losses equal those of per-module gathering bit for bit, with activation checkpointing
(the block's forward runs again inside the backward) and without it (TAPE's update node keeps
its partitioned weights for the backward, gathered again by then)."""

from __future__ import annotations

import pytest

from distributed import run_distributed_test

OVERRIDES = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256", "model.tape_position_size=8",
             "model.pe=tape", "train.seq_len=32", "train.micro_batch_size=2", "train.lr=3e-3",
             "train.warmup_steps=0", "train.dtype=fp32", "train.device=cpu",
             "train.synthetic_data=true", "train.max_steps=6", "checkpoint.interval=100",
             "parallel.zero_stage=3", "parallel.zero3_param_persistence_threshold=0",
             "logging.peak_tflops=1.0",
             "logging.tensorboard=false", "eval.interval=0"]


def _per_block_and_per_module(run_dir: str, checkpointing: bool) -> dict:
    from deepspeed.utils import z3_leaf_module

    from tape_train.config import load_run_config
    from tape_train.train.loop import Trainer

    out = {}
    for name, blocks in (("blocks", True), ("modules", False)):
        trainer = Trainer(load_run_config(None, OVERRIDES + [
            f"parallel.zero3_gather_blocks={str(blocks).lower()}",
            f"train.activation_checkpointing={str(checkpointing).lower()}",
            f"train.run_dir={run_dir}/{name}"]))
        trainer.setup()
        model = trainer.engine.module
        out[name + "_leaves"] = [type(m).__name__ for m in model.modules() if z3_leaf_module(m)]
        out[name + "_partitioned"] = all(p.ds_numel > p.ds_tensor.numel()
                                         for p in model.layers[0].parameters())
        out[name] = [trainer.train_step()["loss"] for _ in range(3)]
        trainer.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("checkpointing", [True, False])
def test_whole_block_gathering_gives_the_same_losses_as_per_module(tmp_path, checkpointing):
    outs = run_distributed_test(_per_block_and_per_module, world_size=2,
                                args=(str(tmp_path), checkpointing), timeout=600)
    for out in outs:
        assert out["blocks_leaves"] == ["DecoderBlock", "DecoderBlock"]
        assert out["modules_leaves"] == []                 # control: per-module hooks
        assert out["blocks_partitioned"] and out["modules_partitioned"]
        assert len(set(out["blocks"])) > 1                 # the updates happen
        assert out["blocks"] == out["modules"]
    assert outs[0]["blocks"] == outs[1]["blocks"]
