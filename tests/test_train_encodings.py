"""Every positional encoding trains through the real Trainer in the demo's setting (DeepSpeed
ZeRO-1, bf16): the engine builds (DeepSpeed broadcasts every parameter as bytes, which a 0-d
parameter cannot survive) and takes finite optimizer steps (synthetic tokens are uniform, so
the loss stays near ln V; that it moves shows the updates happen)."""

from __future__ import annotations

import math

import pytest

from distributed import run_distributed_test
from tape_train.model import POSITIONAL_ENCODINGS

OVERRIDES = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256",
             "model.tape_position_size=8", "train.seq_len=32", "train.micro_batch_size=2",
             "train.lr=3e-3", "train.warmup_steps=0", "train.dtype=bf16", "train.device=cpu",
             "train.synthetic_data=true", "train.max_steps=6", "checkpoint.interval=100",
             "parallel.zero_stage=1", "logging.peak_tflops=1.0", "logging.tensorboard=false",
             "eval.interval=0"]


def _train_every_encoding(run_dir: str) -> dict[str, list[float]]:
    from tape_train.config import load_run_config
    from tape_train.train.loop import Trainer

    losses = {}
    for pe in POSITIONAL_ENCODINGS:
        trainer = Trainer(load_run_config(None, OVERRIDES + [f"model.pe={pe}",
                                                             f"train.run_dir={run_dir}/{pe}"]))
        trainer.setup()
        losses[pe] = [trainer.train_step()["loss"] for _ in range(6)]
        trainer.close()
    return losses


@pytest.mark.distributed
def test_every_encoding_trains_with_zero1_bf16(tmp_path):
    losses = run_distributed_test(_train_every_encoding, world_size=1, args=(str(tmp_path),),
                                  timeout=400)[0]
    assert set(losses) == set(POSITIONAL_ENCODINGS)
    for pe, curve in losses.items():
        assert all(math.isfinite(x) for x in curve), (pe, curve)
        assert len(set(curve)) > 1, (pe, curve)
        assert all(abs(x - math.log(256)) < 0.5 for x in curve), (pe, curve)
