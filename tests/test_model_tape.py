"""TAPE properties T1–T10 of the spec (§3), each with its negative control where one exists."""

from __future__ import annotations

import math

import pytest
import torch

from model_utils import randomise_tape, small_config, small_model, tokens
from tape_train.kernels.reference import modulate, rotate_half, tape_attention_reference
from tape_train.model import KVCache, TransformerLM
from tape_train.model import attention as attention_mod


def _blocks(e0, e1):
    """E tables (..., D) → 2×2 blocks T (..., B, 2, 2) acting on (x[β], x[β+B])."""
    b = e0.shape[-1] // 2
    row0 = torch.stack((e0[..., :b], -e1[..., :b]), dim=-1)
    row1 = torch.stack((e1[..., b:], e0[..., b:]), dim=-1)
    return torch.stack((row0, row1), dim=-2)


def _tables(t):
    """Inverse of :func:`_blocks`."""
    e0 = torch.cat((t[..., 0, 0], t[..., 1, 1]), dim=-1)
    e1 = torch.cat((-t[..., 0, 1], t[..., 1, 0]), dim=-1)
    return e0, e1


# T1 ---------------------------------------------------------------------------------------
def test_t1_tape_at_init_is_exactly_rope_and_keeps_e():
    torch.manual_seed(0)
    tape = TransformerLM(small_config("tape"))
    rope = TransformerLM(small_config("rope"))
    missing = rope.load_state_dict(tape.state_dict(), strict=False)
    assert all(k.startswith("layers.") and ".pos_update." in k for k in missing.unexpected_keys)
    assert not missing.missing_keys
    x = tokens()
    out = tape(x, return_states=True)
    torch.testing.assert_close(out.logits, rope(x).logits, rtol=0, atol=1e-6)
    e0, e1 = out.states[0]
    for s0, s1 in out.states[1:]:
        torch.testing.assert_close(s0, e0.expand_as(s0), rtol=0, atol=0)
        torch.testing.assert_close(s1, e1.expand_as(s1), rtol=0, atol=0)
    # Negative control: non-zero W_up/W_pa make TAPE differ from RoPE and E change.
    randomise_tape(tape)
    live = tape(x, return_states=True)
    assert (live.logits - rope(x).logits).abs().max() > 1e-3
    assert (live.states[-1][0] - e0).abs().max() > 1e-4


def test_t1_gradients_reach_w_up_and_w_pa_at_step_zero():
    torch.manual_seed(0)
    model = TransformerLM(small_config("tape"))
    x = tokens()
    model(x, labels=x).loss.backward()
    assert model.layers[-1].pos_update is None  # E after the last block is discarded
    for layer in model.layers[:-1]:
        assert layer.pos_update.w_up.grad.abs().sum() > 0
        assert layer.pos_update.w_pa.grad.abs().sum() > 0
        # W_dn and W_x only get gradient once W_up ≠ 0 (spec §2).
        assert layer.pos_update.w_dn.grad.abs().sum() == 0


# T2 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shift", [517, 4096])
def test_t2_global_shift_invariance_fp32(shift):
    model = small_model("tape", dtype=torch.float32)
    x = tokens()
    base = model(x).logits
    shifted = model(x, positions=torch.arange(x.shape[1])[None] + shift).logits
    torch.testing.assert_close(shifted, base, rtol=0, atol=1e-5)
    # Negative control: a change of *relative* positions (spacing 2) changes the logits.
    spread = model(x, positions=2 * torch.arange(x.shape[1])[None]).logits
    assert (spread - base).abs().max() > 1e-3


def test_t2_train_offset_is_a_no_op():
    model = small_model("tape", tape_train_offset=True).train()
    x = tokens()
    torch.manual_seed(3)
    shifted = model(x).logits
    model.eval()
    torch.testing.assert_close(shifted, model(x).logits, rtol=0, atol=1e-9)


# T3 ---------------------------------------------------------------------------------------
def _run_with_initial_state(model, x, transform):
    original = model.pe.initial_state

    def patched(q_pos, dtype):
        e0, e1 = original(q_pos, dtype)
        return transform(e0.expand(x.shape[0], *e0.shape[1:]), e1.expand(x.shape[0], *e1.shape[1:]))

    model.pe.initial_state = patched
    try:
        return model(x, return_states=True)
    finally:
        model.pe.initial_state = original


def _left_multiply(g):
    """Transform applying G (per head, per block: (M, B, 2, 2)) to every token's blocks."""
    def transform(e0, e1):
        t = _blocks(e0, e1)                                   # (b, M, N, B, 2, 2)
        return _tables(torch.einsum("mbij,hmnbjk->hmnbik", g, t))
    return transform


def _orthogonal(num, gen):
    angles = torch.rand(num, generator=gen, dtype=torch.float64) * 2 * math.pi
    c, s = angles.cos(), angles.sin()
    rot = torch.stack((torch.stack((c, -s), -1), torch.stack((s, c), -1)), -2)
    reflect = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    flips = torch.rand(num, generator=gen) < 0.5
    rot[flips] = rot[flips] @ reflect                         # O(2), not only SO(2)
    return rot


def test_t3_o2_equivariance_per_frequency_block():
    model = small_model("tape")
    cfg = model.cfg
    x = tokens()
    gen = torch.Generator().manual_seed(7)
    nb = cfg.head_dim // 2
    g = _orthogonal(nb, gen)[None].expand(cfg.num_heads, nb, 2, 2)
    ref = model(x, return_states=True)
    out = _run_with_initial_state(model, x, _left_multiply(g))
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-10)
    for (e0, e1), (r0, r1) in zip(out.states, ref.states):
        want = _tables(torch.einsum("mbij,hmnbjk->hmnbik", g, _blocks(
            r0.expand_as(e0), r1.expand_as(e1))))
        torch.testing.assert_close(e0, want[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(e1, want[1], rtol=0, atol=1e-10)


def test_t3_negative_controls_break_equivariance():
    model = small_model("tape")
    cfg = model.cfg
    x = tokens()
    gen = torch.Generator().manual_seed(8)
    nb = cfg.head_dim // 2
    ref = model(x).logits
    per_head = _orthogonal(cfg.num_heads * nb, gen).view(cfg.num_heads, nb, 2, 2)
    assert (_run_with_initial_state(model, x, _left_multiply(per_head)).logits - ref).abs().max() > 1e-4
    skew = torch.tensor([[1.3, 0.4], [0.0, 0.8]], dtype=torch.float64)
    non_orth = skew.expand(cfg.num_heads, nb, 2, 2)
    assert (_run_with_initial_state(model, x, _left_multiply(non_orth)).logits - ref).abs().max() > 1e-4


# T4 ---------------------------------------------------------------------------------------
def test_t4_permutation_equivariance_with_permuted_causal_mask(monkeypatch):
    model = small_model("tape")
    x = tokens(batch=1, length=16)
    n = x.shape[1]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    ref = model(x, return_states=True)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    monkeypatch.setattr(attention_mod, "causal_mask", lambda nq, nk, device: mask[perm][:, perm])
    out = model(x[:, perm], positions=torch.arange(n)[perm][None], return_states=True)
    torch.testing.assert_close(out.logits, ref.logits[:, perm], rtol=0, atol=1e-10)
    for (e0, e1), (r0, r1) in zip(out.states[1:], ref.states[1:]):
        torch.testing.assert_close(e0, r0[:, :, perm], rtol=0, atol=1e-10)
        torch.testing.assert_close(e1, r1[:, :, perm], rtol=0, atol=1e-10)
    # Negative control: permuting tokens but keeping the index-order causal mask.
    monkeypatch.setattr(attention_mod, "causal_mask", lambda nq, nk, device: mask)
    wrong = model(x[:, perm], positions=torch.arange(n)[perm][None]).logits
    assert (wrong - ref.logits[:, perm]).abs().max() > 1e-4


# T5 ---------------------------------------------------------------------------------------
def test_t5_causality_of_x_and_e():
    model = small_model("tape")
    x = tokens(batch=1, length=20)
    i = 9
    y = x.clone()
    y[:, i + 1:] = (y[:, i + 1:] + 5) % model.cfg.vocab_size
    a, b = model(x, return_states=True), model(y, return_states=True)
    torch.testing.assert_close(a.logits[:, : i + 1], b.logits[:, : i + 1], rtol=0, atol=0)
    for (a0, a1), (b0, b1) in zip(a.states, b.states):
        torch.testing.assert_close(a0[:, :, : i + 1], b0[:, :, : i + 1], rtol=0, atol=0)
        torch.testing.assert_close(a1[:, :, : i + 1], b1[:, :, : i + 1], rtol=0, atol=0)
    # Negative control: changing token i itself changes position i's logits and E.
    y[:, i] = (y[:, i] + 1) % model.cfg.vocab_size
    c = model(y, return_states=True)
    assert (c.logits[:, i] - a.logits[:, i]).abs().max() > 1e-6
    assert (c.states[-1][0][:, :, i] - a.states[-1][0][:, :, i]).abs().max() > 1e-9


# T6 ---------------------------------------------------------------------------------------
def test_t6_logits_are_the_blockwise_bilinear_form():
    gen = torch.Generator().manual_seed(2)
    b, m, n, d = 1, 2, 5, 8
    q, k, e0, e1 = (torch.randn(b, m, n, d, generator=gen, dtype=torch.float64) for _ in range(4))
    logits = modulate(q, e0, e1) @ modulate(k, e0, e1).transpose(-1, -2)
    t = _blocks(e0, e1)                                        # (b, m, n, B, 2, 2)
    qb = torch.stack((q[..., : d // 2], q[..., d // 2:]), -1)  # (b, m, n, B, 2)
    kb = torch.stack((k[..., : d // 2], k[..., d // 2:]), -1)
    want = torch.einsum("hmibx,hmibyx,hmjbyz,hmjbz->hmij", qb, t, t, kb)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-12)
    # Negative control: T_i T_jᵀ instead of T_iᵀ T_j.
    wrong = torch.einsum("hmibx,hmibxy,hmjbzy,hmjbz->hmij", qb, t, t, kb)
    assert (wrong - logits).abs().max() > 1e-3


# T7 ---------------------------------------------------------------------------------------
def test_t7_kn_rewrite_equals_up_gate_down():
    model = small_model("tape")
    pu = model.layers[0].pos_update
    gen = torch.Generator().manual_seed(3)
    b, n = 2, 7
    m, d = model.cfg.num_heads, model.cfg.head_dim
    state = tuple(torch.randn(b, m, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    y = torch.randn(b, n, model.cfg.hidden_size, generator=gen, dtype=torch.float64)
    fused, unfused = pu.after_mlp(state, y), pu.after_mlp_unfused(state, y)
    for a, u in zip(fused, unfused):
        torch.testing.assert_close(a, u, rtol=0, atol=1e-12)
    # Negative control: K_nᵀ (mixing in the wrong direction) is not the same map.
    k = pu.mixing_matrices(y)
    wrong = state[0] + torch.einsum("bnkm,bknd->bmnd", k, state[0])
    assert (wrong - fused[0]).abs().max() > 1e-4


# T8 ---------------------------------------------------------------------------------------
def _attention_inputs(seed=4, b=1, m=2, n=6, d=8):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, m, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(5)]


def test_t8_gradcheck_all_five_inputs():
    q, k, v, e0, e1 = _attention_inputs()
    assert torch.autograd.gradcheck(lambda *a: tape_attention_reference(*a), (q, k, v, e0, e1))
    # The model's attention paths (eager and SDPA with the 3D-wide value) too, in gradcheck's
    # fast mode (random projections of the Jacobian: any wrong entry shows, at a fraction of
    # the full Jacobian's cost).
    for backend in ("eager", "sdpa"):
        def through_model(q, k, v, e0, e1, backend=backend):
            from tape_train.model.attention import eager_attention, sdpa_attention
            fn = eager_attention if backend == "eager" else sdpa_attention
            out = fn(modulate(q, e0, e1), modulate(k, e0, e1), torch.cat((v, e0, e1), -1))
            return out
        assert torch.autograd.gradcheck(through_model, (q, k, v, e0, e1), fast_mode=True)


def test_t8_model_modulation_autograd_matches_gradcheck():
    from tape_train.model.pe.base import apply_rotary

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    # Tables broadcast over batch (layer 0) or are full (later layers): both reduce correctly.
    for shape in ((1, 3, 5, 8), (2, 3, 5, 8), (1, 1, 5, 8)):
        c = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
        s = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(apply_rotary, (x, c, s))
        torch.testing.assert_close(apply_rotary(x, c, s), modulate(x, c, s))


def test_t8_modulation_backward_formula():
    gen = torch.Generator().manual_seed(5)
    x, e0, e1, g = (torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    x.requires_grad_(True), e0.requires_grad_(True), e1.requires_grad_(True)
    modulate(x, e0, e1).backward(g)
    half = x.shape[-1] // 2
    rot_t = lambda y: torch.cat((y[..., half:], -y[..., :half]), -1)  # noqa: E731  rotᵀ
    torch.testing.assert_close(x.grad, e0 * g + rot_t(e1 * g))
    torch.testing.assert_close(e0.grad, x * g)
    torch.testing.assert_close(e1.grad, rotate_half(x) * g)
    # Negative control: the transpose matters (rot instead of rotᵀ is wrong).
    assert (x.grad - (e0 * g + rotate_half(e1 * g))).abs().max() > 1e-3


# T9 ---------------------------------------------------------------------------------------
def _attention_without_e_hat_gradient(q, k, v, e0, e1):
    """What the released fused kernel's backward computes: A is a constant for Ê = A·E."""
    qt, kt = modulate(q, e0, e1), modulate(k, e0, e1)
    logits = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    attn = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return attn @ v, attn.detach() @ e0, attn.detach() @ e1


def test_t9_gradient_of_q_through_e_hat_is_present():
    q, k, v, e0, e1 = _attention_inputs(seed=6)
    gen = torch.Generator().manual_seed(9)
    weights = [torch.randn(q.shape, generator=gen, dtype=torch.float64) for _ in range(3)]

    def loss_of(outputs, skip_o=False):
        pairs = list(zip(outputs, weights))
        return sum((o * w).sum() for o, w in (pairs[1:] if skip_o else pairs))

    dq, dk = torch.autograd.grad(loss_of(tape_attention_reference(q, k, v, e0, e1)), (q, k))
    # The part of dq that comes only through Ê is non-zero ...
    e_only = torch.autograd.grad(loss_of(tape_attention_reference(q, k, v, e0, e1), True), q)[0]
    assert e_only.abs().max() > 1e-3
    # ... and dropping it (the released kernel) gives measurably different q/k gradients.
    dq_drop, dk_drop = torch.autograd.grad(loss_of(_attention_without_e_hat_gradient(
        q, k, v, e0, e1)), (q, k))
    assert (dq - dq_drop).abs().max() > 1e-3 and (dk - dk_drop).abs().max() > 1e-3
    torch.testing.assert_close(dq - dq_drop, e_only)


# T10 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pe", ["tape", "rope", "nope", "alibi", "randpe", "fire", "xpos", "t5"])
def test_t10_kv_cache_decoding_equals_full_forward(pe):
    model = small_model(pe)
    x = tokens(batch=2, length=18)
    full = model(x).logits
    for backend in ("eager", "sdpa"):
        model.cfg.attn_backend = backend
        cache = KVCache(model.cfg.num_layers)
        pieces = [model(x[:, :7], cache=cache).logits]      # prefill
        pieces += [model(x[:, i:i + 1], cache=cache).logits for i in range(7, 12)]
        pieces.append(model(x[:, 12:], cache=cache).logits)  # chunked continuation
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-9)
    # Negative control: a cache that forgot the prefix is not the full forward.
    fresh = model(x[:, 7:8], cache=KVCache(model.cfg.num_layers)).logits
    assert (fresh[:, 0] - full[:, 7]).abs().max() > 1e-6
