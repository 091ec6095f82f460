"""Helpers for the multi-process parallelism tests (gloo, CPU).

``run_distributed(fn, world_size, out_dir, *args)`` runs ``fn(rank, world_size, out_dir,
*args)`` on ``world_size`` spawned ranks through ``tests/distributed.py`` (timeouts, per-rank
tracebacks), after ``deepspeed.init_distributed`` wrapped the gloo group; returns the per-rank
results. The rest builds the tiny model / batches shared by the workers, the single-process
reference, and a ZeRO-3 DeepSpeed engine for a layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distributed import run_distributed_test

TINY = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
            tape_position_size=8, max_seq_len=64, attn_backend="sdpa")
SEQ_LEN = 16
ROWS_PER_DP_RANK = 2
SPAWN_TIMEOUT_S = 480.0  # generous: the CI machine is 2 shared cores


def _with_deepspeed(fn, out_dir, args):
    import torch.distributed as dist

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # wraps the existing group
    return fn(dist.get_rank(), dist.get_world_size(), Path(out_dir), *args)


def run_distributed(fn, world_size: int, out_dir, *args) -> list:
    """Run ``fn`` on ``world_size`` spawned gloo ranks; return the per-rank results."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return run_distributed_test(_with_deepspeed, world_size=world_size,
                                args=(fn, str(out_dir), args), timeout=SPAWN_TIMEOUT_S)


# ---------------------------------------------------------------------- model and data
def tiny_config(pe: str, **overrides):
    from tape_train.model import ModelConfig

    return ModelConfig(**{**TINY, "pe": pe, **overrides})


def tiny_model(pe: str, seed: int = 0, **overrides):
    """The tiny model with, for TAPE, non-zero W_up and W_pa so the cross-head paths are live."""
    from tape_train.model import TransformerLM

    torch.manual_seed(seed)
    model = TransformerLM(tiny_config(pe, **overrides))
    with torch.no_grad():
        for layer in model.layers:
            if layer.pos_update is not None:
                layer.pos_update.w_pa.normal_(std=0.3)
                layer.pos_update.w_up.normal_(std=0.3)
    return model


def global_batch(step: int, dp: int, seed: int = 1) -> dict:
    """(dp·ROWS_PER_DP_RANK, SEQ_LEN) tokens and labels with a varying number of ignored
    labels per row, so shards hold different token counts (tests the normalisation)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    rows = dp * ROWS_PER_DP_RANK
    ids = torch.randint(0, TINY["vocab_size"], (rows, SEQ_LEN), generator=g)
    labels = (ids * 5 + 3) % TINY["vocab_size"]  # a learnable rule: the run's loss must drop
    for r in range(rows):
        k = int(torch.randint(0, SEQ_LEN // 2, (), generator=g))
        labels[r, torch.randperm(SEQ_LEN, generator=g)[:k]] = -100
    return {"input_ids": ids, "labels": labels}


def dp_slice(batch: dict, grid) -> dict:
    rows = slice(grid.dp_rank * ROWS_PER_DP_RANK, (grid.dp_rank + 1) * ROWS_PER_DP_RANK)
    return {k: v[rows] for k, v in batch.items()}


def reference_grads(model, batch) -> tuple[float, dict]:
    """Single-process token-mean loss and full gradients on the global batch."""
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], labels=batch["labels"])
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


LR = 3e-3


def ds_config(grid, clip: float = 0.0, zero: dict | None = None) -> dict:
    from tape_train.parallel import deepspeed_config_updates

    cfg = {
        "train_micro_batch_size_per_gpu": ROWS_PER_DP_RANK,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero or {"stage": 3, "reduce_scatter": True},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    cfg.update(deepspeed_config_updates(grid))
    return cfg


def reference_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.01)


def make_engine(model, grid, clip: float = 0.0, zero: dict | None = None):
    import deepspeed

    from tape_train.parallel import parallelize, verify_engine

    parallelize(model, grid)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(grid, clip, zero))
    verify_engine(engine, grid)
    return engine


def engine_step_loss(engine, batch, grid, before_step=None):
    """One optimizer step on this rank's share of the global batch through the trainer's own
    path (``tape_train.train.engine.forward_backward``: shard, token-weighted loss, backward,
    step); returns the GLOBAL token-mean loss (identical on all ranks).

    ``before_step()`` runs after the backward and before the optimizer step, on every rank
    (e.g. to compare gradients; it may call collectives).
    """
    import torch.distributed as dist

    from tape_train.train.engine import count_target_tokens, forward_backward

    global_tokens = count_target_tokens([batch])
    hook = None if before_step is None else (lambda local_sum: before_step())
    local_sum = forward_backward(engine, [dp_slice(batch, grid)], grid=grid,
                                 global_tokens=global_tokens, before_last_step=hook)
    total = local_sum.clone()
    if grid.groups.dp_sp is not None:
        dist.all_reduce(total, group=grid.groups.dp_sp)
    return (total / global_tokens).item()


def local_shard(name: str, full: torch.Tensor, grid) -> torch.Tensor:
    """The part of a full (single-process) tensor this TP rank holds under AutoTP."""
    from tape_train.parallel import partition_dim

    dim = partition_dim(name)
    if dim is None or grid.tp == 1:
        return full
    return full.chunk(grid.tp, dim=dim)[grid.tp_rank]


def compare_grads(engine, ref_grads: dict, grid) -> dict:
    """{name: max|g − g_ref| / max|g_ref|} over all parameters (ZeRO-3 grads gathered)."""
    from deepspeed.utils import safe_get_full_grad

    errors = {}
    for name, param in engine.module.named_parameters():
        grad = safe_get_full_grad(param)
        ref = local_shard(name, ref_grads[name], grid)
        assert grad is not None, f"no gradient for {name}"
        assert grad.shape == ref.shape, f"{name}: {tuple(grad.shape)} vs {tuple(ref.shape)}"
        errors[name] = ((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
    return errors
