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


# Elements per piece of a large CPU tensor in the AdamW update (4 MiB in fp32): parameter,
# gradient and both moments of one piece stay in cache across the update's ~10 elementwise
# passes. ZeRO hands the optimizer one flat partition of every parameter of a group (162 M
# elements at 125m); updated whole, each pass streams it through DRAM, 3-4x slower on CPU.
CPU_PIECE_ELEMENTS = 1 << 20


class SkippableAdamW(torch.optim.AdamW):
    """torch AdamW whose next ``step()`` can be turned into a no-op, and whose update of large
    CPU tensors runs piece by piece.

    Skipping: DeepSpeed's overflow check covers non-finite gradients, not a non-finite loss
    with finite gradients, nor every configuration; the trainer sets ``skip_next_step`` on
    every rank (after the ranks agreed) before ``engine.step()``: ZeRO then performs its
    bookkeeping (gradient reduction, clearing) but the inner update, and thus the weights and
    Adam moments, stay untouched.

    Pieces: on CPU (single-tensor AdamW, no amsgrad/capturable/differentiable/fused), every
    contiguous parameter larger than ``piece_elements`` is updated as views of
    ``piece_elements`` elements each, with torch's own ``adam`` functional. AdamW is
    elementwise, so the result is bit-identical to the whole-tensor update; only the memory
    traffic changes. The state (``step``, ``exp_avg``, ``exp_avg_sq``) is torch's own.
    """

    def __init__(self, params, piece_elements: int = CPU_PIECE_ELEMENTS, **kwargs) -> None:
        super().__init__(_without_names(params), **kwargs)
        self.skip_next_step = False
        self.piece_elements = int(piece_elements)

    def step(self, closure=None):
        if self.skip_next_step:
            return None
        if not all(self._pieces_apply(group) for group in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_in_pieces(group)
        return loss

    def _pieces_apply(self, group: dict) -> bool:
        flags = ("amsgrad", "maximize", "capturable", "differentiable", "fused", "foreach")
        return (group.get("decoupled_weight_decay") is True and not any(group.get(f) for f in flags)
                and all(p.device.type == "cpu" and not torch.is_complex(p)
                        for p in group["params"]))

    def _step_in_pieces(self, group: dict) -> None:
        from torch.optim.adam import adam

        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
        lists: tuple[list, ...] = ([], [], [], [], [])
        whole_steps = []  # (state step tensor, the step tensor of its first piece)
        n = self.piece_elements
        for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            tensors = (p, g, m, v)
            if p.numel() <= n or not all(x.is_contiguous() for x in tensors):
                for out, x in zip(lists, (*tensors, t)):
                    out.append(x)
                continue
            pieces = [x.view(-1).split(n) for x in tensors]
            piece_steps = [t.clone() for _ in pieces[0]]
            whole_steps.append((t, piece_steps[0]))
            for out, xs in zip(lists, (*pieces, piece_steps)):
                out.extend(xs)
        beta1, beta2 = group["betas"]
        adam(*lists[:4], [], lists[4], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, foreach=False,
             capturable=False, differentiable=False, fused=False, decoupled_weight_decay=True)
        for state_step, first in whole_steps:
            state_step.copy_(first)


def _without_names(params) -> list:
    """The groups without their audit-only ``names`` key (DeepSpeed copies group dicts around;
    it must not reach the optimizer)."""
    return [{k: v for k, v in g.items() if k != "names"} if isinstance(g, dict) else g
            for g in params]


def adamw_settings(optim: OptimConfig, train: TrainConfig) -> dict:
    """The AdamW hyper-parameters of the run, the same for every optimizer it may use."""
    return {"lr": train.lr, "betas": tuple(optim.betas), "eps": optim.eps,
            "weight_decay": optim.weight_decay}


def cpu_adam_problem() -> str | None:
    """``None`` when DeepSpeed's ``cpu_adam`` op loads, else why not, in one line.

    The op is compiled on first use (g++ and ninja; about a minute) and cached under
    ``TORCH_EXTENSIONS_DIR`` (``<venv>/torch_extensions`` unless set, ``init_distributed``),
    unless DeepSpeed was installed with it pre-built (``DS_BUILD_CPU_ADAM=1``)."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - a failed build surfaces as several types
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        telling = [ln for ln in lines if "not found" in ln or "error:" in ln.lower()]
        line = (telling or lines or [type(exc).__name__])[0]
        return line if len(line) <= 300 else line[:297] + "..."
    return None


def skippable_cpu_adam(params, **settings):
    """DeepSpeed's CPU Adam in AdamW mode, with ``SkippableAdamW``'s ``skip_next_step``:
    the optimizer of ``parallel.offload_optimizer=cpu`` (ZeRO hands it the host-side fp32
    partitions). Its update is AdamW's (decoupled weight decay, bias correction), vectorised
    in C++; its results differ from torch's in the last bits (docs/training.md)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    class SkippableCPUAdam(DeepSpeedCPUAdam):
        def __init__(self, params, **kwargs) -> None:
            super().__init__(_without_names(params), adamw_mode=True, **kwargs)
            self.skip_next_step = False

        def __setstate__(self, state):
            # load_state_dict replaces the groups by the saved ones: those of a torch AdamW
            # checkpoint lack CPU Adam's own keys (bias_correction).
            super().__setstate__(state)
            for group in self.param_groups:
                for key, value in self.defaults.items():
                    group.setdefault(key, value)

        def step(self, closure=None):
            if self.skip_next_step:
                return None
            return super().step(closure)

    return SkippableCPUAdam(params, **settings)


def build_optimizer(model: nn.Module, optim: OptimConfig, train: TrainConfig, *,
                    cpu_adam: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``param_groups``: DeepSpeed's CPU Adam with ``cpu_adam`` (ZeRO-Offload),
    else ``SkippableAdamW``; both take ``adamw_settings`` and have ``skip_next_step``."""
    groups, settings = param_groups(model, optim), adamw_settings(optim, train)
    if cpu_adam:
        return skippable_cpu_adam(groups, **settings)
    return SkippableAdamW(groups, foreach=False, **settings)


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


SCHEDULE_KEYS = ("lr", "max_steps", "warmup_steps", "warmup_fraction", "decay", "min_lr_ratio")


def lr_change_at_resume(saved_train: dict, train: TrainConfig, step: int) -> str | None:
    """What a resume at ``step`` (optimizer steps done) does to the learning rate, when the
    schedule's keys differ from the checkpoint's ``saved_train`` (its ``config.train``) so that
    the next step's rate differs too; ``None`` when it does not (or the saved keys cannot be
    read). A longer ``train.max_steps`` re-warms a run that had decayed, and moves a warm-up
    given as ``train.warmup_fraction``: both silent until the curves show it."""
    changed = [k for k in SCHEDULE_KEYS if k in saved_train and saved_train[k] != getattr(train, k)]
    if not changed or step >= train.max_steps:  # no step left to train: nothing changes
        return None
    import dataclasses

    try:
        before = dataclasses.replace(train, **{k: saved_train[k] for k in changed})
    except (ValueError, TypeError):  # a checkpoint of another version: nothing to compare
        return None
    old = before.lr * LRSchedule.from_config(before)(step)
    new = train.lr * LRSchedule.from_config(train)(step)
    if math.isclose(old, new, rel_tol=1e-6):
        return None
    keys = ", ".join(f"train.{k} {saved_train[k]!r} -> {getattr(train, k)!r}" for k in changed)
    line = (f"the learning rate of step {step + 1} changes from {old:.3g} (the checkpoint's "
            f"schedule) to {new:.3g}{f' ({new / old:.2f}x)' if old > 0 else ''} because {keys}: "
            f"the schedule is a function of the step and the current config")
    warmup = train.resolved_warmup_steps
    if step >= before.max_steps and before.decay != "constant" and new > old > 0:
        line += (f"; the checkpoint's run had decayed to its final rate at step "
                 f"{before.max_steps}, and this one re-warms it (to continue at {old:.3g} "
                 f"instead: train.decay=constant train.lr={old:.3g} train.warmup_steps=0)")
    elif before.resolved_warmup_steps <= step < warmup:
        line += f"; step {step + 1} is back in a warm-up, now of {warmup} steps"
        if train.warmup_steps is None:
            line += (f" (train.warmup_fraction={train.warmup_fraction:g} of train.max_steps="
                     f"{train.max_steps}; train.warmup_steps={before.resolved_warmup_steps} "
                     f"keeps the checkpoint's)")
    return line
