"""Token-weighted loss normalisation across micro-batches and data-parallel ranks.

The gradient DeepSpeed hands to the optimizer (ZeRO-3, fp32, 2 gloo ranks × 2 micro-batches,
labels partly −100 so every micro-batch holds a different number of target tokens) must equal
the gradient of the token-mean loss of the whole global batch computed directly on one plain
PyTorch model. Negative control: the usual mean-of-micro-batch-means gives a different
gradient on the same data, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed_test

MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=256,
             tape_position_size=8, max_seq_len=64)
SEQ, MICRO, GAS, SEED, MASK = 32, 2, 2, 7, 0.9


def _model_cfg():
    from tape_train.model import load_model_config

    return load_model_config("tiny", **MODEL)


def _run_cfg(world_size: int, run_dir: str):
    from tape_train.config import load_run_config

    return load_run_config(None, [
        "model=tiny", *(f"model.{k}={v}" for k, v in MODEL.items()),
        f"train.run_dir={run_dir}", f"train.seq_len={SEQ}", f"train.micro_batch_size={MICRO}",
        f"train.grad_accum_steps={GAS}", "train.dtype=fp32", "train.device=cpu",
        "optim.grad_clip=0", "parallel.zero_stage=3"])


def _deepspeed_gradients(run_dir: str) -> dict[str, torch.Tensor]:
    """On each rank: one optimizer step's gradients as seen at the accumulation boundary."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from tape_train.model import TransformerLM
    from tape_train.parallel import RankGrid, parallelize
    from tape_train.train import distributed as tdist
    from tape_train.train.engine import build_engine, count_target_tokens, forward_backward
    from tape_train.data.synthetic import SyntheticLoader

    tdist.init_distributed("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _run_cfg(world, run_dir)
    grid = RankGrid.from_sizes(world, rank=rank)
    grid.build()
    torch.manual_seed(SEED)
    model = parallelize(TransformerLM(cfg.model), grid)
    engine, _ = build_engine(cfg, model, grid)
    loader = SyntheticLoader(MODEL["vocab_size"], SEQ, MICRO, GAS, rank, world, SEED, MASK)
    batches = [next(loader) for _ in range(GAS)]
    local = count_target_tokens(batches)
    global_tokens = int(tdist.all_reduce_sum(torch.tensor([local]))[0])
    grads: dict[str, torch.Tensor] = {}

    def capture(_loss_sum):
        for name, param in engine.module.named_parameters():
            grads[name] = safe_get_full_grad(param).detach().clone()

    forward_backward(engine, batches, grid=grid, global_tokens=global_tokens,
                     before_last_step=capture)
    return {"grads": grads, "local_tokens": local}


def _reference_gradients(world: int) -> tuple[dict, dict]:
    """(token-mean gradient of the global batch, naive mean-of-means gradient)."""
    from tape_train.model import TransformerLM
    from tape_train.data.synthetic import SyntheticLoader

    torch.manual_seed(SEED)
    model = TransformerLM(_model_cfg())
    batches = []
    for rank in range(world):
        loader = SyntheticLoader(MODEL["vocab_size"], SEQ, MICRO, GAS, rank, world, SEED, MASK)
        batches += [next(loader) for _ in range(GAS)]
    outs = [model(b["input_ids"], labels=b["labels"]) for b in batches]
    total_tokens = sum(int(o.num_tokens) for o in outs)
    exact = sum(o.loss_sum for o in outs) / total_tokens
    exact_grads = torch.autograd.grad(exact, list(model.parameters()), retain_graph=True)
    naive = sum(o.loss_sum / o.num_tokens for o in outs) / len(outs)
    naive_grads = torch.autograd.grad(naive, list(model.parameters()))
    names = [n for n, _ in model.named_parameters()]
    counts = [int(o.num_tokens) for o in outs]
    assert len(set(counts)) > 1, f"the test needs uneven token counts, got {counts}"
    return dict(zip(names, exact_grads)), dict(zip(names, naive_grads))


@pytest.mark.distributed
def test_gradient_is_token_mean_of_global_batch_across_micro_batches_and_ranks(tmp_path):
    results = run_distributed_test(_deepspeed_gradients, world_size=2,
                                   args=(str(tmp_path),), timeout=240)
    assert results[0]["local_tokens"] != results[1]["local_tokens"]  # uneven across ranks
    exact, naive = _reference_gradients(world=2)
    worst_naive = 0.0
    for name, ref in exact.items():
        for rank, result in enumerate(results):
            got = result["grads"][name]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-7,
                                       msg=lambda m: f"rank {rank} grad of {name}: {m}")
        scale = ref.abs().max().item() + 1e-12
        worst_naive = max(worst_naive, (naive[name] - ref).abs().max().item() / scale)
    # Negative control: per-micro-batch means weight tokens unevenly and are visibly off.
    assert worst_naive > 1e-2, worst_naive

