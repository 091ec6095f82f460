"""AdamW parameter groups (what gets weight decay) and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest

from tape_train.config import OptimConfig, TrainConfig
from tape_train.train.optim import (LRSchedule, SkippableAdamW, lr_change_at_resume,
                                   param_groups)


def _groups(decay_embeddings: bool, **model):
    from tape_train.model import TransformerLM, load_model_config

    cfg = load_model_config("tiny", num_layers=2, hidden_size=64, num_heads=4,
                            intermediate_size=128, vocab_size=128, tape_position_size=8, **model)
    model = TransformerLM(cfg)
    groups = param_groups(model, OptimConfig(weight_decay=0.1,
                                             decay_embeddings=decay_embeddings))
    by_name = {n: g["weight_decay"] for g in groups for n in g["names"]}
    assert set(by_name) == {n for n, _ in model.named_parameters()}  # every parameter once
    return by_name


def test_no_decay_on_norms_and_tape_gates_embeddings_configurable():
    wd = _groups(decay_embeddings=True)
    for gate in ("w_pa", "w_up", "w_dn", "w_x.weight"):
        assert wd[f"layers.0.pos_update.{gate}"] == 0.0
    assert wd["layers.1.attn_norm.weight"] == 0.0 and wd["norm.weight"] == 0.0
    assert wd["layers.0.attn.q_proj.weight"] == 0.1 and wd["layers.1.mlp.down_proj.weight"] == 0.1
    assert wd["embed.weight"] == 0.1 and wd["lm_head.weight"] == 0.1
    wd = _groups(decay_embeddings=False)
    assert wd["embed.weight"] == 0.0 and wd["lm_head.weight"] == 0.0
    assert wd["layers.0.attn.q_proj.weight"] == 0.1


def test_shared_positional_tables_are_not_decayed():
    wd = _groups(decay_embeddings=True, pe="t5")
    pe = [n for n in wd if n.startswith("pe.")]
    assert pe and all(wd[n] == 0.0 for n in pe)


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_schedule_warmup_then_decay_to_min(decay):
    s = LRSchedule(warmup=10, total=110, decay=decay, min_ratio=0.1)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0) and s(110) == pytest.approx(0.1)
    mid = 0.1 + 0.9 * (0.5 if decay == "linear" else 0.5 * (1 + math.cos(math.pi / 2)))
    assert s(60) == pytest.approx(mid)
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone after warm-up
    assert LRSchedule(0, 100, "constant", 0.0)(50) == 1.0



def _saved(**train) -> dict:
    """``config.train`` of a checkpoint saved with these schedule keys (the rest default)."""
    return vars(TrainConfig(**train)).copy()


def test_a_resume_that_moves_the_learning_rate_says_from_what_to_what_and_why():
    # A finished cosine run (decayed to min_lr_ratio at step 100) extended to 200 steps.
    saved = _saved(max_steps=100, lr=1e-3, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    longer = TrainConfig(max_steps=200, lr=1e-3, warmup_steps=10, decay="cosine",
                         min_lr_ratio=0.1)
    line = lr_change_at_resume(saved, longer, 100)
    new = 1e-3 * LRSchedule(10, 200, "cosine", 0.1)(100)
    assert line is not None and "of step 101 changes from 0.0001" in line
    assert f"to {new:.3g}" in line and "train.max_steps 100 -> 200" in line
    assert "re-warms" in line and "train.decay=constant train.lr=0.0001" in line
    # Mid-run, a longer run with a warm-up given as a fraction falls back into it.
    saved = _saved(max_steps=1000, warmup_steps=None, warmup_fraction=0.02)
    line = lr_change_at_resume(saved, TrainConfig(max_steps=10000, warmup_steps=None), 100)
    assert line is not None and "back in a warm-up, now of 200 steps" in line
    assert "train.warmup_steps=20 keeps the checkpoint's" in line
    # Negative controls: what does not move the next step's rate is not reported.
    constant = _saved(max_steps=100, warmup_steps=10, decay="constant")
    assert lr_change_at_resume(constant, TrainConfig(max_steps=200, warmup_steps=10,
                                                     decay="constant"), 100) is None
    same = _saved(max_steps=100, warmup_steps=10)
    in_warmup = TrainConfig(max_steps=100, warmup_steps=10, min_lr_ratio=0.5)
    assert lr_change_at_resume(same, in_warmup, 5) is None     # the key changed, the rate not
    assert lr_change_at_resume(same, in_warmup, 50) is not None
    # A finished run whose max_steps is lowered trains no step: nothing to say.
    assert lr_change_at_resume(same, TrainConfig(max_steps=50, warmup_steps=10), 100) is None

def _skipped_step(make, p):
    """An optimizer from ``make`` over ``p`` (ones) whose flagged step left everything as it
    was; the flag is cleared again."""
    import torch

    opt = make([{"params": [p], "names": ["p"]}], lr=0.1)
    p.grad = torch.ones(3)
    opt.skip_next_step = True
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and not opt.state
    opt.skip_next_step = False
    return opt


def test_skippable_adamw_step_is_a_no_op_while_flagged():
    import torch

    p = torch.nn.Parameter(torch.ones(3))
    opt = _skipped_step(SkippableAdamW, p)
    opt.step()
    assert (p.detach() < 1).all()  # negative control: a normal step moves the weights


def _adamw_pair(piece_elements: int):
    import torch

    torch.manual_seed(0)
    shapes = [(37, 29), (5,), (64, 48), (7, 300)]
    base = [torch.randn(s, dtype=torch.float32) for s in shapes]
    ours_params = [torch.nn.Parameter(b.clone()) for b in base]
    ref_params = [torch.nn.Parameter(b.clone()) for b in base]
    # A non-contiguous parameter (a transposed view) is updated whole.
    ours_params.append(torch.nn.Parameter(torch.randn(40, 30).t()))
    ref_params.append(torch.nn.Parameter(ours_params[-1].detach().clone()))
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    ours = SkippableAdamW([{"params": ours_params[:3], "weight_decay": 0.1, "names": ["a"] * 3},
                           {"params": ours_params[3:], "weight_decay": 0.0, "names": ["b"] * 2}],
                          piece_elements=piece_elements, **kwargs)
    ref = torch.optim.AdamW([{"params": ref_params[:3], "weight_decay": 0.1},
                             {"params": ref_params[3:], "weight_decay": 0.0}], **kwargs)
    return ours, ours_params, ref, ref_params


def test_adamw_in_pieces_is_bit_identical_to_torch_adamw(monkeypatch):
    import torch
    import torch.optim.adam as adam_module

    ours, ours_params, ref, ref_params = _adamw_pair(piece_elements=100)
    seen = []
    real = adam_module.adam

    def counting(params, *args, **kwargs):
        seen.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(adam_module, "adam", counting)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours_params, ref_params):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        for p, q in zip(ours_params, ref_params):
            assert torch.equal(p.detach(), q.detach())
    # The large tensors really were cut: 37·29 → 11 pieces, 64·48 → 31, 7·300 → 21.
    assert seen[0] == 11 + 1 + 31 and seen[1] == 21 + 1
    for p, q in zip(ours_params, ref_params):
        a, b = ours.state[p], ref.state[q]
        assert torch.equal(a["step"], b["step"]) and float(a["step"]) == 4
        assert torch.equal(a["exp_avg"], b["exp_avg"])
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    # Same state layout as torch's AdamW: its state_dict loads into ours and vice versa.
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())



def _cpu_adam_or_skip():
    from tape_train.train.optim import cpu_adam_problem

    problem = cpu_adam_problem()
    if problem is not None:
        pytest.skip(f"DeepSpeed's cpu_adam op cannot be built here: {problem}")


def _train_groups(cpu_adam: bool, decay_embeddings: bool = True, steps: int = 4):
    """The tiny model's parameters after ``steps`` updates with synthetic gradients."""
    import torch

    from tape_train.config import TrainConfig
    from tape_train.model import TransformerLM, load_model_config
    from tape_train.train.optim import build_optimizer

    torch.manual_seed(0)
    model = TransformerLM(load_model_config(
        "tiny", num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128,
        vocab_size=128, tape_position_size=8))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.5, decay_embeddings=decay_embeddings),
                          TrainConfig(lr=1e-2), cpu_adam=cpu_adam)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.integration  # builds DeepSpeed's cpu_adam op: minutes of C++
def test_cpu_adam_is_the_same_adamw_on_the_same_groups():
    _cpu_adam_or_skip()
    opt, ours = _train_groups(cpu_adam=True)
    assert type(opt).__name__ == "SkippableCPUAdam" and opt.adam_w_mode
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    _, ref = _train_groups(cpu_adam=False)
    worst = max(float((ours[n] - ref[n]).abs().max()) for n in ref)
    assert worst < 1e-6, worst
    _, wrong = _train_groups(cpu_adam=False, decay_embeddings=False)  # negative control
    assert float((ours["embed.weight"] - wrong["embed.weight"]).abs().max()) > 1e-4


@pytest.mark.integration  # builds DeepSpeed's cpu_adam op: minutes of C++
def test_cpu_adam_skips_while_flagged_and_loads_a_torch_adamw_state():
    import torch

    _cpu_adam_or_skip()
    from tape_train.train.optim import SkippableAdamW, skippable_cpu_adam

    p = torch.nn.Parameter(torch.ones(3))
    opt = _skipped_step(skippable_cpu_adam, p)
    # A resume that turns offload on: torch AdamW's groups lack CPU Adam's bias_correction.
    q = torch.nn.Parameter(torch.ones(3))
    torch_opt = SkippableAdamW([{"params": [q], "names": ["q"]}], lr=0.1)
    q.grad = torch.ones(3)
    torch_opt.step()
    opt.load_state_dict(torch_opt.state_dict())
    opt.step()  # KeyError 'bias_correction' without SkippableCPUAdam.__setstate__
    assert (p.detach() < 1).all() and float(opt.state[p]["step"]) == 2


def test_deepspeed_offload_sections_pin_memory_only_on_cuda():
    from tape_train.config import load_run_config
    from tape_train.train.engine import deepspeed_config

    cfg = load_run_config(None, ["model=tiny", "parallel.offload_optimizer=cpu",
                                 "parallel.offload_params=cpu"])
    for device, pin in (("cuda", True), ("cpu", False)):
        zero = deepspeed_config(cfg, device)["zero_optimization"]
        assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": pin}
        assert zero["offload_param"] == {"device": "cpu", "pin_memory": pin}
    zero = deepspeed_config(load_run_config(None, ["model=tiny"]), "cuda")["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero
