"""The encoding registry: what each spec declares is what its module does, and the config
reads it without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tape_train.model import ModelConfig, TransformerLM
from tape_train.model.pe import ENCODINGS, PositionalEncoding, encoding_spec
from model_utils import small_model


def test_config_and_registry_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"   # any torch import now fails
            "from tape_train.model.config import ModelConfig\n"
            "cfg = ModelConfig(pe='tape', hidden_size=64, num_heads=4)\n"
            "assert cfg.encoding.carries_state and cfg.encoding.value_width == 3\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_declared_capabilities_match_the_module(name):
    spec = encoding_spec(name)
    assert spec.name == name
    cls = spec.load()
    assert issubclass(cls, PositionalEncoding)
    model = small_model(name)
    assert model.pe.spec is spec and type(model.pe) is cls
    pos = torch.arange(6)[None]
    ctx = model.pe.context(pos, pos, torch.float64)
    state = model.pe.initial_state(pos, torch.float64)
    assert (ctx.bias is not None) == spec.dense_bias
    assert (ctx.alibi_slopes is not None) == spec.flash_bias
    # Rotary: tables for q/k, or (TAPE) a state whose layer-0 value is the rotary tables.
    assert (ctx.q_tables is not None or state is not None) == spec.rotary
    assert (state is not None) == spec.carries_state
    carrying = [layer.pos_update is not None for layer in model.layers]
    assert sum(carrying) == spec.state_layers(model.cfg.num_layers)
    assert carrying == sorted(carrying, reverse=True)  # the last block never carries
    for layer in model.layers:
        if layer.pos_update is not None:
            assert sum(p.numel() for p in layer.pos_update.parameters()) == spec.state_params(
                model.cfg)
    assert sum(p.numel() for p in model.pe.parameters()) == spec.shared_params(model.cfg)
    model.train()
    draws = [model.pe.layer0_positions(2, 8, 0, torch.device("cpu")) for _ in range(8)]
    assert any(not torch.equal(d, draws[0]) for d in draws) == spec.draws_random_positions(
        model.cfg)


def test_gqa_and_even_head_dim_come_from_the_spec():
    for name, spec in ENCODINGS.items():
        base = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, pe=name)
        if spec.gqa:
            ModelConfig(**base, num_kv_heads=2)
        else:
            with pytest.raises(ValueError, match=f"GQA. is not supported with pe={name}"):
                ModelConfig(**base, num_kv_heads=2)
        odd = dict(base, hidden_size=36)  # head dim 9
        if spec.rotary:
            with pytest.raises(ValueError, match="odd"):
                ModelConfig(**odd)
        else:
            ModelConfig(**odd)


def test_tape_train_offset_turns_random_positions_on():
    spec = encoding_spec("tape")
    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4)
    assert not spec.draws_random_positions(cfg)
    cfg.tape_train_offset = True
    assert spec.draws_random_positions(cfg)


def test_a_new_encoding_is_one_registry_entry(monkeypatch):
    """docs/model.md's recipe: a subclass plus an EncodingSpec, nothing else edited."""
    from tape_train.model.flops import count_parameters
    from tape_train.model.pe.spec import EncodingSpec

    spec = EncodingSpec("rope2", "tape_train.model.pe.rope:RoPE", "RoPE under another name",
                        rotary=True)
    monkeypatch.setitem(ENCODINGS, "rope2", spec)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, pe="rope2")
    model = TransformerLM(cfg)
    torch.manual_seed(0)
    rope = TransformerLM(ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4,
                                     pe="rope"))
    ids = torch.randint(0, 97, (1, 12))
    torch.testing.assert_close(model(ids).logits, rope(ids).logits)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in model.parameters())
