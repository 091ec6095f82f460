"""TAPE against an independent fp64 reference of the authors' layer (spec §2), per layer.

The reference below is written from the spec's equations, not from ``tape_train.model``: it
reads only the model's *weights* and uses its own formulation — the 2×2 block matrices T of
§1 for the modulation, an explicit causal softmax, the authors' "up-project E to P channels,
gate, down-project" MLP update and an explicit per-head loop for W_pa. A wrong axis, a
transposed mixing matrix, a gate from the wrong tensor or the two E updates in the other order
each give a different X or E at some layer, so these tests fail for them (docs/mutation.md).

Also here: the train offset is really applied (and a no-op), T6 and T9 on the model's own code
paths (its modulation, every CPU attention backend, the attention module).
"""

from __future__ import annotations

import math

import pytest
import torch

from model_utils import SMALL, tokens
from tape_train.kernels.reference import tape_attention_reference
from tape_train.model import ModelConfig, TransformerLM
from tape_train.model.attention import AttentionCore

LAYERS = 4          # three blocks carry and update E; the last one attends with it only
CPU_BACKENDS = ("eager", "sdpa", "blocked")


def live_tape_model(post_attn: str, backend: str = "eager", seed: int = 0,
                    **overrides) -> TransformerLM:
    """fp64 model whose every TAPE weight is random and large enough to matter: W_pa, W_up
    (zero at init), W_dn and W_x (so the gate g = silu(y·W_x) is far from its small-init
    regime and the contextual part K_n is live)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**SMALL, "num_layers": LAYERS, "tape_post_attn": post_attn,
                         "attn_backend": backend, **overrides})
    model = TransformerLM(cfg).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.layers:
            if layer.pos_update is None:
                continue
            for name, param in layer.pos_update.named_parameters():
                std = 0.5 if name == "w_x.weight" else 0.3
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)
    return model.eval()


# ------------------------------------------------------------------ the independent reference
def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _silu(x):
    return x / (1 + torch.exp(-x))


def _block_matrices(e0, e1):
    """Spec §1: T = [[E⁰[β], −E¹[β]], [E¹[β+B], E⁰[β+B]]], shape (..., B, 2, 2)."""
    half = e0.shape[-1] // 2
    top = torch.stack((e0[..., :half], -e1[..., :half]), -1)
    bottom = torch.stack((e1[..., half:], e0[..., half:]), -1)
    return torch.stack((top, bottom), -2)


def _apply_blocks(t, x):
    """T acting on the pairs (x[β], x[β+B]): x (..., D) → (..., D)."""
    half = x.shape[-1] // 2
    pairs = torch.stack((x[..., :half], x[..., half:]), -1)           # (..., B, 2)
    out = (t * pairs[..., None, :]).sum(-1)                           # Σ_j T[i, j]·x_j
    return torch.cat((out[..., 0], out[..., 1]), -1)


def _attention(q, k, v, e0, e1):
    """One softmax A over q̃·k̃ᵀ/√D (causal); returns A·v, A·E⁰, A·E¹. Shapes (b, M, N, ·)."""
    t = _block_matrices(e0, e1)
    qt, kt = _apply_blocks(t, q), _apply_blocks(t, k)
    n, d = q.shape[2], q.shape[3]
    logits = torch.einsum("bmid,bmjd->bmij", qt, kt) / math.sqrt(d)
    future = torch.arange(n)[None, :] > torch.arange(n)[:, None]
    weights = torch.exp(logits - logits.max(-1, keepdim=True).values).masked_fill(future, 0.0)
    attn = weights / weights.sum(-1, keepdim=True)
    return tuple(torch.einsum("bmij,bmjd->bmid", attn, x) for x in (v, e0, e1))


def reference_forward(model: TransformerLM, ids: torch.Tensor, weights: dict | None = None):
    """The authors' TAPE decoder in fp64 from the spec. Returns (logits, per-block X outputs,
    per-block input states (E⁰, E¹)); E enters every block, the last block's is not updated.
    ``weights``: the model's state as name → tensor (default: a detached fp64 copy); leaves
    that require grad get the reference's gradients."""
    cfg = model.cfg
    sd = weights if weights is not None else {k: v.double() for k, v in model.state_dict().items()}
    b, n = ids.shape
    m, d, eps = cfg.num_heads, cfg.head_dim, cfg.norm_eps
    half = d // 2
    omega = cfg.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * omega            # (N, B)
    angle = torch.cat((angle, angle), -1)                                    # j ↦ ω_{j mod B}
    e0 = angle.cos().expand(b, m, n, d).clone()
    e1 = angle.sin().expand(b, m, n, d).clone()
    x = sd["embed.weight"][ids]
    xs, states = [], []

    def heads(t):
        return t.view(b, n, m, d).transpose(1, 2)

    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        states.append((e0.clone(), e1.clone()))
        h = _rms(x, sd[p + "attn_norm.weight"], eps)
        q, k, v = (heads(h @ sd[p + f"attn.{w}_proj.weight"].T) for w in "qkv")
        o, e0_hat, e1_hat = _attention(q, k, v, e0, e1)
        x = x + o.transpose(1, 2).reshape(b, n, m * d) @ sd[p + "attn.o_proj.weight"].T
        h2 = _rms(x, sd[p + "mlp_norm.weight"], eps)
        y = (_silu(h2 @ sd[p + "mlp.gate_proj.weight"].T) * (h2 @ sd[p + "mlp.up_proj.weight"].T)
             ) @ sd[p + "mlp.down_proj.weight"].T
        if i < cfg.num_layers - 1:
            w_pa = sd[p + "pos_update.w_pa"]
            new = []
            for e, e_hat in ((e0, e0_hat), (e1, e1_hat)):
                upd = torch.zeros_like(e)
                for row in range(m):                                  # per output head
                    if cfg.tape_post_attn == "rowsum":                # released code: s_m·Ê_m
                        upd[:, row] = w_pa[row].sum() * e_hat[:, row]
                    else:                                             # Σ_k W_pa[m, k]·Ê_k
                        for col in range(m):
                            upd[:, row] += w_pa[row, col] * e_hat[:, col]
                new.append(e + upd)
            e0, e1 = new
            g = _silu(y @ sd[p + "pos_update.w_x.weight"].T)               # (b, N, P), from y
            w_up, w_dn = sd[p + "pos_update.w_up"], sd[p + "pos_update.w_dn"]
            new = []
            for e in (e0, e1):                                       # authors' unfused form
                up = torch.einsum("pm,bmnd->bpnd", w_up, e) * g.transpose(1, 2)[..., None]
                new.append(e + torch.einsum("mp,bpnd->bmnd", w_dn, up))
            e0, e1 = new
        x = x + y
        xs.append(x)
    logits = _rms(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
    return logits, xs, states


def _model_forward(model, ids):
    xs = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: xs.append(out[0]))
             for layer in model.layers]
    try:
        out = model(ids, return_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    return out, xs


# ------------------------------------------------------------------ per-layer comparison
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("post_attn", ["headmix", "rowsum"])
def test_every_layer_matches_the_independent_reference(post_attn, backend):
    model = live_tape_model(post_attn, backend)
    ids = tokens(batch=2, length=20)
    out, xs = _model_forward(model, ids)
    weights = {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}
    ref_logits, ref_xs, ref_states = reference_forward(model, ids, weights)
    assert len(out.states) == len(ref_states) == LAYERS
    for i, ((e0, e1), (r0, r1)) in enumerate(zip(out.states, ref_states)):
        torch.testing.assert_close(e0.expand_as(r0), r0, rtol=0, atol=1e-10, msg=f"E⁰ in {i}")
        torch.testing.assert_close(e1.expand_as(r1), r1, rtol=0, atol=1e-10, msg=f"E¹ in {i}")
    for i, (x, r) in enumerate(zip(xs, ref_xs)):
        torch.testing.assert_close(x, r, rtol=0, atol=1e-10, msg=f"X after block {i}")
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=1e-10)
    # Every parameter's gradient (the model's own autograd functions: modulation, RMSNorm,
    # SwiGLU, the backend) equals autograd through the reference's plain formulas.
    probe = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64)
    (out.logits * probe).sum().backward()
    (ref_logits * probe).sum().backward()
    for name, param in model.named_parameters():
        want = weights[name].grad
        torch.testing.assert_close(param.grad, want, rtol=0,
                                   atol=1e-10 * max(1.0, want.abs().max().item()), msg=name)
    # The comparison is meaningful: E really is contextual at every carrying layer (far from
    # the layer-0 tables, and different between the two sequences of the batch).
    for r0, _ in ref_states[1:]:
        assert (r0 - ref_states[0][0]).abs().max() > 0.05
        assert (r0[0] - r0[1]).abs().max() > 1e-3


def test_the_reference_tells_the_variants_apart():
    """Negative control: headmix and rowsum (same weights) differ at every carrying layer,
    so matching the reference identifies the variant."""
    headmix, rowsum = live_tape_model("headmix"), live_tape_model("rowsum")
    ids = tokens(batch=2, length=20)
    _, _, states_h = reference_forward(headmix, ids)
    _, _, states_r = reference_forward(rowsum, ids)
    for (h0, _), (r0, _) in zip(states_h[1:], states_r[1:]):
        assert (h0 - r0).abs().max() > 1e-2
    out = headmix(ids, return_states=True)
    assert (out.states[1][0] - states_r[1][0]).abs().max() > 1e-2


def test_kernel_reference_matches_the_independent_attention():
    gen = torch.Generator().manual_seed(12)
    q, k, v, e0, e1 = (torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64)
                       for _ in range(5))
    for got, want in zip(tape_attention_reference(q, k, v, e0, e1), _attention(q, k, v, e0, e1)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # Decoding: the last 3 queries against all 9 keys, with their own positions' E.
    got = tape_attention_reference(q[:, :, 6:], k, v, e0[:, :, 6:], e1[:, :, 6:], e0, e1)
    for g, want in zip(got, _attention(q, k, v, e0, e1)):
        torch.testing.assert_close(g, want[:, :, 6:], rtol=0, atol=1e-12)


# ------------------------------------------------------------------ the train offset
def test_train_offset_shifts_the_state_and_changes_nothing_else():
    model = live_tape_model("headmix", tape_train_offset=True)
    ids = tokens(batch=2, length=16)
    n = ids.shape[1]
    positions = torch.arange(n, dtype=torch.float64)
    want = model(ids).logits                                   # eval: no shift

    def layer0_shift(out) -> int:
        """The k of layer 0's state: E¹ of head 0, channel 0 is sin((n + k)·ω₀), ω₀ = 1."""
        e1 = out.states[0][1][0, 0, :, 0]
        found = [k for k in range(2 * n + 1)
                 if torch.allclose(e1, torch.sin(positions + k), rtol=0, atol=1e-12)]
        assert len(found) == 1, "layer-0 state is not a RoPE table shifted by k ∈ [0, 2N]"
        return found[0]

    model.train()
    shifts = []
    for seed in range(6):
        torch.manual_seed(seed)
        out = model(ids, return_states=True)
        torch.testing.assert_close(out.logits, want, rtol=0, atol=1e-9)   # T2: a no-op
        shifts.append(layer0_shift(out))
    assert len(set(shifts)) > 1, shifts                        # applied, and drawn at random
    # Negative control: without the flag, training mode uses positions 0..N−1.
    model.cfg.tape_train_offset = False
    assert layer0_shift(model(ids, return_states=True)) == 0


# ------------------------------------------------------------------ T6 / T9 on our code paths
def _captured_attention(model, layer, ids):
    """The normed input h of block ``layer``'s attention, its input state and its output."""
    seen = {}

    def hook(mod, args, out):
        seen["h"], seen["state"], seen["out"] = args[0], args[3], out

    handle = model.layers[layer].attn.register_forward_hook(hook)
    try:
        model(ids)
    finally:
        handle.remove()
    return seen["h"], seen["state"], seen["out"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_t6_model_attention_is_the_blockwise_bilinear_form(backend):
    """T6 through the model's attention module (projections, modulation, backend, Ê) at a
    layer whose E is contextual: logits = Σ_β q_βᵀ T_iᵀ T_j k_β."""
    model = live_tape_model("headmix", backend)
    attn = model.layers[2].attn
    ids = tokens(batch=1, length=14)
    h, (e0, e1), (out, e_hat) = _captured_attention(model, 2, ids)
    b, n = ids.shape
    m, d = model.cfg.num_heads, model.cfg.head_dim
    q, k, v = (getattr(attn, f"{w}_proj")(h).view(b, n, m, d).transpose(1, 2) for w in "qkv")
    e0, e1 = e0.expand(b, m, n, d), e1.expand(b, m, n, d)
    t = _block_matrices(e0, e1)                                  # (b, M, N, B, 2, 2)
    qb = torch.stack((q[..., : d // 2], q[..., d // 2:]), -1)    # (b, M, N, B, 2)
    kb = torch.stack((k[..., : d // 2], k[..., d // 2:]), -1)

    def attend(logits):
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        a = (logits / math.sqrt(d)).masked_fill(future, float("-inf")).softmax(-1)
        o = (a @ v).transpose(1, 2).reshape(b, n, m * d)
        return attn.o_proj(o), (a @ e0, a @ e1)

    want_out, want_hat = attend(torch.einsum("hmibx,hmibyx,hmjbyz,hmjbz->hmij", qb, t, t, kb))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    for got, want in zip(e_hat, want_hat):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # Negative control: T_i T_jᵀ instead of T_iᵀ T_j.
    wrong_out, _ = attend(torch.einsum("hmibx,hmibxy,hmjbzy,hmjbz->hmij", qb, t, t, kb))
    assert (wrong_out - out).abs().max() > 1e-4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_t9_model_backends_keep_the_gradient_through_e_hat(backend):
    """T9 on the model's attention core: dL/dq that flows only through Ê = A·E is present and
    equals the plain-torch reference's (the released fused kernel drops it)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, e0, e1 = (torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64,
                                   requires_grad=True) for _ in range(5))
    weights = [torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    from tape_train.model.pe.base import apply_rotary

    def e_hat_loss(e_hats):
        return sum((e * w).sum() for e, w in zip(e_hats, weights))

    out = AttentionCore()(apply_rotary(q, e0, e1), apply_rotary(k, e0, e1),
                          torch.cat((v, e0, e1), -1), backend=backend)
    dq, dk = torch.autograd.grad(e_hat_loss(out.split(8, dim=-1)[1:]), (q, k))
    ref_dq, ref_dk = torch.autograd.grad(e_hat_loss(tape_attention_reference(q, k, v, e0, e1)[1:]),
                                         (q, k))
    assert ref_dq.abs().max() > 1e-3
    torch.testing.assert_close(dq, ref_dq, rtol=0, atol=1e-10)
    torch.testing.assert_close(dk, ref_dk, rtol=0, atol=1e-10)
