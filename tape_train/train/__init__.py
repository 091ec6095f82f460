"""DeepSpeed training: engine set-up, the loop, checkpoints, metrics, signal handling.

Public entry points: ``Trainer`` (``tape_train.train.loop``), the checkpoint helpers
``find_latest_complete`` and ``load_model_from_checkpoint`` (``tape_train.train.checkpoint``),
and the ``tape-train`` console script (``tape_train.train.cli``). Imports are lazy so that
``from tape_train.train import load_model_from_checkpoint`` does not pull in DeepSpeed.
"""

from __future__ import annotations

__all__ = ["Trainer", "find_latest_complete", "load_model_from_checkpoint"]


def __getattr__(name: str):
    if name == "Trainer":
        from tape_train.train.loop import Trainer

        return Trainer
    if name in ("find_latest_complete", "load_model_from_checkpoint"):
        from tape_train.train import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'tape_train.train' has no attribute {name!r}")
