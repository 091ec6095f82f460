"""The FLOP model (``tape_train.model.flops``) against a count of one real training step.

``torch.utils.flop_counter.FlopCounterMode`` counts every matrix product of one forward +
backward of a tiny fp32 model on the eager backend. Eager attention computes the full N×N
logits and P·V, where the FLOP model counts the causal half (spec §4's U = N·C per token),
so, for a micro-batch of b sequences of N tokens (L blocks, S of them carrying TAPE's state):

    counted = b·N·training_flops_per_token(cfg, N, micro_batch=b)   # what MFU multiplies by
            + b·N·N·C·(L·u₁ + S·(u_w − u₁))            # the masked half eager computes
            + b·N·S·state_update_recompute_flops(cfg)  # TAPE's update recomputes W_pa·Ê

with u₁ = 6 (QKᵀ + PV, backward twice the forward) and u_w = 12 for TAPE's 3D-wide value.
FIRE's MLP (1 → h → M over the N×N distances, shared by the micro-batch) is in the FLOP
model as each token's share of 6·N²·h·(M+1) per micro-batch, hence ``micro_batch``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tape_train.model.config import POSITIONAL_ENCODINGS, ModelConfig
from tape_train.model.flops import (attention_units, state_update_recompute_flops,
                                    training_flops_per_token)
from tape_train.model.transformer import TransformerLM


def _config(pe: str, **overrides) -> ModelConfig:
    shape = dict(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
                 tape_position_size=8, fire_hidden=8, max_seq_len=32, attn_backend="eager")
    return ModelConfig(pe=pe, **{**shape, **overrides})


def _counted(cfg: ModelConfig, batch: int, length: int, checkpointing: bool = False) -> int:
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    model.reset_parameters()
    for p in model.parameters():  # zero-init TAPE weights still get their products counted
        torch.nn.init.normal_(p, std=0.02)
    if checkpointing:
        from tape_train.train.engine import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    ids = torch.randint(0, cfg.vocab_size, (batch, length))
    counter = FlopCounterMode(display=False)
    with counter:
        model(ids, labels=ids).loss_sum.backward()
    return counter.get_total_flops()


def _expected(cfg: ModelConfig, batch: int, length: int) -> int:
    tokens = batch * length
    model = training_flops_per_token(cfg, length, micro_batch=batch) * tokens
    plain = attention_units(cfg.pe, value_width=1)
    state_layers = cfg.encoding.state_layers(cfg.num_layers)
    units = cfg.num_layers * plain + state_layers * (attention_units(cfg.pe) - plain)
    masked_half = units * length * cfg.hidden_size * tokens
    recomputed = state_layers * state_update_recompute_flops(cfg) * tokens
    return round(model + masked_half + recomputed)


CASES = [(pe, {}) for pe in POSITIONAL_ENCODINGS] + [
    (pe, {"num_kv_heads": 2}) for pe in POSITIONAL_ENCODINGS if pe != "tape"] + [
    ("tape", {"tie_embeddings": True}), ("rope", {"tie_embeddings": True}),
    ("tape", {"tape_post_attn": "rowsum"}), ("tape", {"tape_train_offset": True}),
    ("tape", {"num_layers": 1}), ("fire", {"fire_hidden": 16})]


@pytest.mark.parametrize("pe,overrides", CASES, ids=[
    f"{pe}-{'-'.join(map(str, o.items())) or 'plain'}" for pe, o in CASES])
def test_flop_model_matches_a_count_of_the_real_step(pe, overrides):
    cfg = _config(pe, **overrides)
    for batch, length in ((2, 16), (1, 24)):
        assert _counted(cfg, batch, length) == _expected(cfg, batch, length)


def test_rowsum_does_no_head_mixing_product():
    """`tape_post_attn: rowsum` scales each head of Ê by one number: the two (M×M)·(M×D)
    products per token of `headmix` are not done, and the FLOP model does not count them
    (it did: MFU was too high by their share). The real step does them a fourth time: the
    update's backward recomputes E' = E + W_pa·Ê rather than keeping it (not model FLOPs)."""
    headmix, rowsum = _config("tape"), _config("tape", tape_post_attn="rowsum")
    tokens, state_layers = 32, headmix.num_layers - 1
    w_pa = 3 * 2 * (2 * headmix.num_heads ** 2 * headmix.head_dim) * state_layers * tokens
    recomputed = state_update_recompute_flops(headmix) * state_layers * tokens
    assert recomputed == w_pa / 3 and state_update_recompute_flops(rowsum) == 0
    assert _counted(headmix, 2, 16) - _counted(rowsum, 2, 16) == w_pa + recomputed
    assert (training_flops_per_token(headmix, 16, micro_batch=2)
            - training_flops_per_token(rowsum, 16, micro_batch=2)) * tokens == w_pa


def test_fire_mlp_is_counted_once_per_micro_batch():
    """FIRE's MLP runs once per micro-batch over the N×N distances, whatever b is: the real
    step's count grows by exactly that much less than b-fold, and the FLOP model, given the
    micro-batch, follows it; told the wrong micro-batch (negative control), it does not."""
    cfg, n = _config("fire"), 16
    mlp = 6 * n * n * cfg.fire_hidden * (cfg.num_heads + 1)
    one, three = _counted(cfg, 1, n), _counted(cfg, 3, n)
    assert three - 3 * one == -2 * mlp  # one MLP in each count, not one per sequence
    assert three == _expected(cfg, 3, n)
    told_one = training_flops_per_token(cfg, n, micro_batch=1)
    told_three = training_flops_per_token(cfg, n, micro_batch=3)
    wrong = round(_expected(cfg, 3, n) + 3 * n * (told_one - told_three))
    assert wrong - three == 2 * mlp
    for pe in ("rope", "tape", "t5"):  # no per-micro-batch work: the micro-batch changes nothing
        other = _config(pe)
        assert (training_flops_per_token(other, n, micro_batch=1)
                == training_flops_per_token(other, n, micro_batch=3))


def test_activation_checkpointing_recomputes_flops_mfu_does_not_count():
    """MFU counts model FLOPs: the trainer's FLOPs per token come from the model config alone,
    while a checkpointed step really does more products (the recomputed forward)."""
    cfg = _config("tape")
    assert _counted(cfg, 2, 16, checkpointing=True) > _counted(cfg, 2, 16) == _expected(cfg, 2, 16)


def test_trainer_and_plan_count_fire_at_the_runs_micro_batch():
    """The trainer's MFU basis and the preflight's time plan take FLOPs per token at the run's
    `train.micro_batch_size` (FIRE's MLP share differs at micro-batch 1: negative control)."""
    from types import SimpleNamespace

    from tape_train.config import load_run_config
    from tape_train.train import preflight
    from tape_train.train.loop import Trainer

    cfg = load_run_config(None, ["model=tiny", "model.pe=fire", "model.fire_hidden=1024",
                                 "train.seq_len=64", "train.micro_batch_size=4",
                                 "logging.peak_tflops=1.0"])
    at_run = training_flops_per_token(cfg.model, 64, micro_batch=4)
    at_one = training_flops_per_token(cfg.model, 64, micro_batch=1)
    assert f"{at_run / 1e9:.3f}" != f"{at_one / 1e9:.3f}"  # a wide MLP: the plan's line shows it

    trainer = SimpleNamespace(cfg=cfg, rank=0, dtype=torch.float32,
                              dist=SimpleNamespace(device=torch.device("cpu")))
    Trainer._setup_mfu(trainer)
    assert trainer.flops_per_token == trainer._mfu_basis["flops_per_token"] == at_run

    report = preflight.Report()
    preflight._plan_time(cfg, SimpleNamespace(dp=1, world_size=1), "cpu", None, 0.5, report)
    assert f"{at_run / 1e9:.3f} GFLOP per token" in report.lines[0]
