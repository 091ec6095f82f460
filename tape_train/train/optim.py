"""AdamW parameter groups, the skippable optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from tape_train.config import OptimConfig, TrainConfig
from tape_train.model.transformer import is_positional_parameter

EMBEDDING_PARAMS = ("embed.weight", "lm_head.weight")


def decays(name: str, param: nn.Parameter, decay_embeddings: bool) -> bool:
    """Whether weight decay applies to parameter ``name``.

    Never: 0-d/1-d tensors (norm gains, biases, scalars), positional-encoding parameters
    (TAPE's gates under ``pos_update``, FIRE/T5's shared ``pe.*`` tables; spec §6).
    Embedding and LM head: only with ``decay_embeddings``.
    """
    if param.ndim < 2 or is_positional_parameter(name):
        return False
    if name in EMBEDDING_PARAMS:
        return decay_embeddings
    return True


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two AdamW groups, ``decay`` and ``no_decay``, each with a ``names`` list for audit.

    Tied embeddings appear once (``named_parameters`` deduplicates shared tensors).
    """
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if decays(name, param, cfg.decay_embeddings):
            decay.append(param)
            decay_names.append(name)
        else:
            no_decay.append(param)
            no_decay_names.append(name)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "names": decay_names},
              {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names}]
    return [g for g in groups if g["params"]]


class SkippableAdamW(torch.optim.AdamW):
    """torch AdamW whose next ``step()`` can be turned into a no-op.

    DeepSpeed only checks overflow for fp16; for bf16/fp32 a NaN/inf loss would be applied.
    The trainer sets ``skip_next_step`` on every rank (after the ranks agreed) before
    ``engine.step()``: ZeRO then performs its bookkeeping (gradient reduction, clearing) but the
    inner update, and thus the weights and Adam moments, stay untouched.
    """

    def __init__(self, params, **kwargs) -> None:
        # DeepSpeed copies group dicts around; the audit-only "names" key must not reach torch.
        params = [{k: v for k, v in g.items() if k != "names"} if isinstance(g, dict) else g
                  for g in params]
        super().__init__(params, **kwargs)
        self.skip_next_step = False

    def step(self, closure=None):
        if self.skip_next_step:
            return None
        return super().step(closure)


def build_optimizer(model: nn.Module, optim: OptimConfig, train: TrainConfig) -> SkippableAdamW:
    return SkippableAdamW(param_groups(model, optim), lr=train.lr, betas=tuple(optim.betas),
                          eps=optim.eps, weight_decay=optim.weight_decay, foreach=False)


class LRSchedule:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warm-up from lr/warmup to lr over ``warmup`` steps, then ``linear`` or ``cosine``
    decay to ``min_ratio`` · lr at ``total`` steps, or ``constant``.

    The trainer sets ``lr · schedule(step)`` on the optimizer before every step instead of using
    a stateful scheduler: the schedule is a pure function of the step and the *current*
    config, so a resumed run continues exactly and a deliberately changed ``train.lr`` or
    ``train.max_steps`` takes effect.
    """

    @classmethod
    def from_config(cls, train: TrainConfig) -> "LRSchedule":
        return cls(train.resolved_warmup_steps, train.max_steps, train.decay, train.min_lr_ratio)

    def __init__(self, warmup: int, total: int, decay: str, min_ratio: float) -> None:
        self.warmup, self.total, self.decay, self.min_ratio = warmup, total, decay, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay == "constant":
            return 1.0
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.decay == "linear":
            shape = 1.0 - progress
        elif self.decay == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"unknown decay {self.decay!r}")
        return self.min_ratio + (1.0 - self.min_ratio) * shape
