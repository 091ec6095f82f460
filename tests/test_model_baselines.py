"""Defining property of each baseline encoding (spec §5), and RoPE parity with HF Llama."""

from __future__ import annotations

import math

import pytest
import torch

from model_utils import small_config, small_model, tokens
from tape_train.model import TransformerLM
from tape_train.model.pe.alibi import alibi_slopes
from tape_train.model.pe.t5 import causal_bucket
from tape_train.model.pe.xpos import xpos_zeta


def test_rope_equals_hugging_face_llama_fp32():
    transformers = pytest.importorskip("transformers")
    from tape_train.model.hf import hf_llama_config, to_hf_llama_state_dict

    torch.manual_seed(0)
    for kv_heads in (4, 2):  # MHA and GQA
        ours = TransformerLM(small_config("rope", num_kv_heads=kv_heads)).eval()
        hf = transformers.LlamaForCausalLM(hf_llama_config(ours.cfg)).eval()
        hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict()), strict=True)
        x = tokens(length=40)
        with torch.no_grad():
            want = hf(input_ids=x).logits
            got = ours(x).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert want.abs().max() > 1e-2  # not vacuous
    # Negative control: a model with another θ is measurably different.
    other = TransformerLM(small_config("rope", num_kv_heads=2, rope_theta=500.0)).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (other(x).logits - want).abs().max() > 1e-4


def test_hf_weight_mapping_round_trips():
    from tape_train.model.hf import from_hf_llama_state_dict, to_hf_llama_state_dict

    state = TransformerLM(small_config("rope")).state_dict()
    assert from_hf_llama_state_dict(to_hf_llama_state_dict(state)).keys() == state.keys()
    with pytest.raises(KeyError, match="pos_update"):
        to_hf_llama_state_dict(TransformerLM(small_config("tape")).state_dict())


def test_alibi_slopes_and_bias():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)]))
    # 12 heads: the 8 slopes of 8, then every other slope of 16 (2^-0.5, 2^-1.5, ...).
    want12 = [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -(h + 0.5) for h in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(want12))
    model = small_model("alibi")
    pos = torch.arange(6)[None]
    ctx = model.pe.context(pos, pos, torch.float64)
    assert ctx.bias.shape == (1, 4, 6, 6)
    dist = (pos[0][:, None] - pos[0][None, :]).double()
    for h, m in enumerate(alibi_slopes(4).double()):
        torch.testing.assert_close(ctx.bias[0, h], -m * dist)


def test_rope_shift_invariance_and_negative_control():
    model = small_model("rope")
    x = tokens()
    base = model(x).logits
    for shift in (517, 4096):
        torch.testing.assert_close(model(x, positions=torch.arange(24)[None] + shift).logits,
                                   base, rtol=0, atol=1e-9)
    assert (model(x, positions=3 * torch.arange(24)[None]).logits - base).abs().max() > 1e-4


def test_nope_has_no_positional_signal_beyond_the_mask():
    model = small_model("nope", num_layers=1)
    x = tokens(batch=1, length=12)
    base = model(x).logits
    # Positions are ignored entirely ...
    torch.testing.assert_close(model(x, positions=torch.randperm(12)[None] * 7).logits, base)
    # ... and a one-layer NoPE model's last prediction is a set function of the prefix.
    perm = torch.cat((torch.randperm(11, generator=torch.Generator().manual_seed(0)),
                      torch.tensor([11])))
    torch.testing.assert_close(model(x[:, perm]).logits[:, -1], base[:, -1], rtol=0, atol=1e-12)
    # Negative control: RoPE sees the order.
    rope = small_model("rope", num_layers=1)
    assert (rope(x[:, perm]).logits[:, -1] - rope(x).logits[:, -1]).abs().max() > 1e-6


def test_randpe_positions_in_training_and_plain_at_evaluation():
    model = small_model("randpe", randpe_max_len=1000)
    x = tokens()
    rope = small_model("rope")
    rope.load_state_dict(model.state_dict())
    torch.testing.assert_close(model.eval()(x).logits, rope(x).logits, rtol=0, atol=0)
    model.train()
    torch.manual_seed(0)
    pos = model.pe.layer0_positions(3, 24, 0, torch.device("cpu"))
    assert pos.shape == (3, 24)
    assert bool((pos[:, 1:] > pos[:, :-1]).all()) and int(pos.min()) >= 0 and int(pos.max()) < 1000
    assert not torch.equal(pos[0], torch.arange(24)) and not torch.equal(pos[0], pos[1])
    assert (model(x).logits - rope(x).logits).abs().max() > 1e-6


@pytest.mark.parametrize("pe", ["t5", "fire"])
def test_relative_bias_depends_only_on_distance(pe):
    model = small_model(pe, fire_init_L=512.0)
    q = torch.arange(10, 30)[None]
    ctx = model.pe.context(q, q, torch.float64)
    shifted = model.pe.context(q + 100, q + 100, torch.float64)  # stays below FIRE's L = 512
    torch.testing.assert_close(ctx.bias, shifted.bias)
    # Entries on one diagonal (same i−j) are equal; different distances differ.
    diag = torch.diagonal(ctx.bias[0], offset=-3, dim1=-2, dim2=-1)
    torch.testing.assert_close(diag, diag[:, :1].expand_as(diag))
    assert (ctx.bias[0, :, 15, 14] - ctx.bias[0, :, 15, 2]).abs().max() > 0


def test_fire_normaliser_uses_query_position_beyond_threshold():
    model = small_model("fire", fire_init_L=8.0)
    q = torch.arange(40)[None]
    bias = model.pe.context(q, q, torch.float64).bias[0]
    # Beyond L the normaliser ψ(i) grows, so equal distances at larger i give other values.
    assert (bias[:, 30, 28] - bias[:, 20, 18]).abs().max() > 0
    c = model.pe.c.abs().item()
    ratio = math.log(c * 2 + 1) / math.log(c * 30 + 1)
    want = model.pe.mlp(torch.tensor([[ratio]], dtype=torch.float64))[0]
    torch.testing.assert_close(bias[:, 30, 28], want)


def test_t5_buckets():
    d = torch.tensor([0, 1, 15, 16, 17, 64, 127, 128, 1000, -5])
    b = causal_bucket(d, 32, 128)
    assert b[:3].tolist() == [0, 1, 15] and b[3] == 16 and int(b[-2]) == 31 and int(b[-1]) == 0
    assert bool((b[:-1][1:] >= b[:-1][:-1]).all())


@pytest.mark.parametrize("pe", ["t5", "fire", "alibi", "xpos", "randpe", "rope", "nope"])
def test_baselines_are_causal(pe):
    model = small_model(pe)
    x = tokens(batch=1, length=16)
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 3) % 97
    torch.testing.assert_close(model(x).logits[:, :9], model(y).logits[:, :9], rtol=0, atol=0)
    assert (model(x).logits[:, 9] - model(y).logits[:, 9]).abs().max() > 0


def test_xpos_matches_its_formula():
    model = small_model("xpos", xpos_scale_base=64.0)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    d = cfg.head_dim
    q, k = (torch.randn(1, 1, 12, d, generator=gen, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(12)[None]
    ctx = model.pe.context(pos, pos, torch.float64)
    from tape_train.model.pe.base import apply_rotary

    logits = apply_rotary(q, *ctx.q_tables) @ apply_rotary(k, *ctx.k_tables).transpose(-1, -2)
    zeta = xpos_zeta(d).double()
    omega = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    want = torch.empty(12, 12, dtype=torch.float64)
    for n in range(12):
        for m in range(12):
            qs, ks = q[0, 0, n] * zeta ** (n / 64), k[0, 0, m] * zeta ** (-m / 64)
            total = 0.0
            for beta in range(d // 2):  # ⟨ρ(ωn)q_β, ρ(ωm)k_β⟩ = q_βᵀ ρ(ω(m−n)) k_β
                a = omega[beta] * (m - n)
                qb, kb = qs[[beta, beta + d // 2]], ks[[beta, beta + d // 2]]
                rot = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]],
                                   dtype=torch.float64)
                total += qb @ rot @ kb
            want[n, m] = total
    torch.testing.assert_close(logits[0, 0], want)
    assert float(zeta.min()) > 0.28 and float(zeta.max()) < 1.0
