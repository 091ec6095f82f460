"""AdamW parameter groups (what gets weight decay) and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest

from tape_train.config import OptimConfig
from tape_train.train.optim import LRSchedule, SkippableAdamW, param_groups


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


def test_skippable_adamw_step_is_a_no_op_while_flagged():
    import torch

    p = torch.nn.Parameter(torch.ones(3))
    opt = SkippableAdamW([{"params": [p], "names": ["p"]}], lr=0.1)
    p.grad = torch.ones(3)
    opt.skip_next_step = True
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and not opt.state
    opt.skip_next_step = False
    opt.step()
    assert (p.detach() < 1).all()  # negative control: a normal step moves the weights
