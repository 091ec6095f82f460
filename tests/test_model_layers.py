"""RMSNorm and SwiGLU keep less for the backward than autograd would, with the same values and
gradients as the plain formulas (fp64: to rounding; bf16: forward bit-identical)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tape_train.model.layers import RMSNorm, SwiGLU, _RMSNormFunction, silu_mul
from tape_train.model.lm_head import IGNORE_INDEX, chunked_cross_entropy_sum
from tape_train.train.memory import saved_for_backward


def plain_rms_norm(x, w, eps):
    """The formula as autograd sees it (what the module did before it saved less)."""
    xf = x.float() if x.dtype != torch.float64 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def saved_bytes(fn, x, *params) -> int:
    """Bytes autograd keeps for the backward of fn(x), x and ``params`` (alive anyway) not
    counted."""
    return saved_for_backward(lambda: fn(x), exclude=(x, *params))[1]


def test_rms_norm_gradients_match_autograd_in_fp64():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: _RMSNormFunction.apply(a, b, 1e-5), (x, w))
    norm = RMSNorm(16, 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(w)
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    ours = torch.autograd.grad(norm(x), (x, norm.weight), g)
    ref = torch.autograd.grad(plain_rms_norm(x, norm.weight, 1e-5), (x, norm.weight), g)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Negative control: the comparison notices a gradient without the term through rms(x).
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert not torch.allclose(rstd * g * w.detach(), ref[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_low_precision_forward_identical_and_gradients_close(dtype):
    torch.manual_seed(1)
    x64 = torch.randn(4, 7, 32, dtype=torch.float64) * 3
    w64 = 1 + 0.1 * torch.randn(32, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    norm = RMSNorm(32, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w64)
    y = norm(x)
    y_plain = plain_rms_norm(x, norm.weight, 1e-6)
    assert torch.equal(y, y_plain)  # bit-identical forward
    g64 = torch.randn(4, 7, 32, dtype=torch.float64)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), g64.to(dtype))
    # fp64 reference on the same (rounded) inputs.
    xr = x.detach().double().requires_grad_()
    wr = norm.weight.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(plain_rms_norm(xr, wr, 1e-6), (xr, wr), g64.to(dtype).double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(dx.double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), rw, rtol=tol, atol=tol * 10)


def test_rms_norm_saves_input_and_statistic_only():
    x = torch.randn(8, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(256, 1e-5).to(torch.bfloat16)
    ours = saved_bytes(norm, x, norm.weight)
    plain = saved_bytes(lambda a: plain_rms_norm(a, norm.weight, 1e-5), x, norm.weight)
    x_bytes = x.numel() * x.element_size()
    # The module saves x itself (an input: not counted) and the (…, 1) fp32 statistic.
    assert ours == 8 * 64 * 4
    # Negative control: autograd's formula keeps an fp32 copy of x (2× its bf16 bytes) and the
    # normalised x in bf16.
    assert plain >= 3 * x_bytes


def test_rms_norm_without_grad_is_the_same_formula():
    x = torch.randn(2, 3, 8)
    norm = RMSNorm(8, 1e-5)
    with torch.no_grad():
        assert torch.equal(norm(x), plain_rms_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32])
def test_silu_mul_matches_autograd(dtype):
    torch.manual_seed(2)
    gate = (torch.randn(3, 9, 24, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    up = torch.randn(3, 9, 24, dtype=torch.float64).to(dtype).requires_grad_()
    g = torch.randn(3, 9, 24, dtype=torch.float64).to(dtype)
    out = silu_mul(gate, up)
    ref = F.silu(gate) * up
    assert torch.equal(out, ref)
    ours = torch.autograd.grad(out, (gate, up), g)
    theirs = torch.autograd.grad(ref, (gate, up), g)
    for a, b in zip(ours, theirs):  # the same ops in the same order: bit-identical
        assert torch.equal(a, b)
    if dtype == torch.float64:
        torch.autograd.gradcheck(silu_mul, (gate, up))
        # Negative control: swapping the roles of gate and up is noticed.
        assert not torch.allclose(ours[0], torch.autograd.grad(F.silu(up) * gate, up, g)[0])


def test_swiglu_saves_less_than_plain_formula():
    torch.manual_seed(3)
    mlp = SwiGLU(64, 176).to(torch.bfloat16)
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    params = tuple(mlp.parameters())
    ours = saved_bytes(mlp, x, *params)
    plain = saved_bytes(lambda a: mlp.down_proj(F.silu(mlp.gate_proj(a)) * mlp.up_proj(a)),
                        x, *params)
    width = 4 * 32 * 176 * 2  # one (…, F) bf16 tensor
    assert plain - ours == width  # silu(gate) is recomputed, not kept
    y = mlp(x)
    y_plain = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(y, y_plain)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, *params), g),
                    torch.autograd.grad(y_plain, (x, *params), g)):
        assert torch.equal(a, b)


def plain_loss_sum(h, weight, labels):
    return F.cross_entropy(F.linear(h, weight).float().flatten(0, -2), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _head_case(dtype, tokens=(3, 37), hidden=16, vocab=50, seed=4):
    torch.manual_seed(seed)
    h = torch.randn(*tokens, hidden, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, tokens)
    labels[0, :5] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    return h, w, labels


@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
def test_chunked_loss_matches_cross_entropy_in_fp64(chunk):
    h, w, labels = _head_case(torch.float64)
    ours = chunked_cross_entropy_sum(h, w, labels, chunk=chunk)
    ref = F.cross_entropy(F.linear(h, w).flatten(0, -2), labels.flatten(),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    g = torch.tensor(0.37, dtype=torch.float64)   # the trainer's 1/tokens scaling
    for a, b in zip(torch.autograd.grad(ours, (h, w), g), torch.autograd.grad(ref, (h, w), g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Ignored tokens get no gradient; negative control: a counted one does.
    dh = torch.autograd.grad(chunked_cross_entropy_sum(h, w, labels, chunk=chunk), h)[0]
    assert dh[0, :5].abs().max() == 0 and dh[2, -1].abs().max() == 0
    assert dh[1].abs().max() > 0
    with torch.no_grad():  # the no-grad path sums the same chunks
        torch.testing.assert_close(chunked_cross_entropy_sum(h, w, labels, chunk=chunk), ref,
                                   rtol=1e-12, atol=1e-12)


def test_chunked_loss_negative_control_wrong_target_is_noticed():
    h, w, labels = _head_case(torch.float64)
    shifted = torch.where(labels == IGNORE_INDEX, labels, (labels + 1) % w.shape[0])
    ref = plain_loss_sum(h, w, labels)
    assert (chunked_cross_entropy_sum(h, w, shifted, chunk=7) - ref).abs() > 1e-3


def test_chunked_loss_bf16_close_to_fp64_like_the_plain_path():
    h, w, labels = _head_case(torch.bfloat16, tokens=(4, 300), hidden=64, vocab=500)
    ours = chunked_cross_entropy_sum(h, w, labels, chunk=64)
    plain = plain_loss_sum(h, w, labels)
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    ref = F.cross_entropy(F.linear(h64, w64).flatten(0, -2), labels.flatten(),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    assert ours.dtype == torch.float32
    # The same bf16 logits as the plain path: the sums agree to fp32 rounding.
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-3)
    g = torch.tensor(1 / 1000)
    ours_g = torch.autograd.grad(ours, (h, w), g)
    plain_g = torch.autograd.grad(plain, (h, w), g)
    ref_g = torch.autograd.grad(ref, (h64, w64), g.double())
    for a, p, r in zip(ours_g, plain_g, ref_g):
        assert a.dtype == torch.bfloat16
        err_ours = (a.double() - r).abs().max() / r.abs().max()
        err_plain = (p.double() - r).abs().max() / r.abs().max()
        assert err_ours <= 2 * err_plain + 1e-3, (err_ours, err_plain)


def test_chunked_loss_keeps_no_logits_for_the_backward():
    h, w, labels = _head_case(torch.bfloat16, tokens=(8, 256), hidden=32, vocab=4000)
    ours = saved_bytes(lambda a: chunked_cross_entropy_sum(a, w, labels, chunk=128), h, w)
    plain = saved_bytes(lambda a: plain_loss_sum(a, w, labels), h, w)
    logits_fp32 = 8 * 256 * 4000 * 4
    # ∂h (bf16, h's size) and ∂W (fp32, W's size) only.
    assert ours == h.numel() * 2 + w.numel() * 4
    assert plain >= logits_fp32  # negative control: the plain path keeps the fp32 log-softmax


def test_model_loss_uses_the_chunked_head_and_matches_plain_logits():
    from tape_train.model import ModelConfig, TransformerLM

    cfg = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64, tape_position_size=8, max_seq_len=64, pe="tape",
                      attn_backend="eager")
    torch.manual_seed(5)
    model = TransformerLM(cfg).double()
    x = torch.randint(0, 97, (2, 20))
    out = model(x, labels=x)
    assert out.logits is None
    full = model(x, labels=x, return_logits=True)
    ref = F.cross_entropy(full.logits.flatten(0, 1), x.flatten(), reduction="sum")
    torch.testing.assert_close(out.loss_sum, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.loss_sum, list(model.parameters()))
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_tape_head_mixing_keeps_no_copy_of_a_contiguous_state():
    from tape_train.model import load_model_config
    from tape_train.model.pe.tape import TapeStateUpdate

    cfg = load_model_config("tiny", pe="tape")
    upd = TapeStateUpdate(cfg).double()
    with torch.no_grad():
        upd.w_pa.normal_()
    m, d = cfg.num_heads, cfg.head_dim
    e = torch.randn(2, m, 16, d, dtype=torch.float64, requires_grad=True)
    e_hat = torch.randn(2, m, 16, d, dtype=torch.float64, requires_grad=True)
    out, kept = saved_for_backward(lambda: upd.after_attention(e, e_hat),
                                   exclude=(e, e_hat, upd.w_pa))
    assert kept == 0  # Ê (the fused kernel's own output) is saved in place
    ref = e + torch.einsum("mk,bknd->bmnd", upd.w_pa, e_hat)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (e, e_hat, upd.w_pa), g),
                    torch.autograd.grad(ref, (e, e_hat, upd.w_pa), g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Negative control: the einsum form keeps a permuted copy of Ê.
    _, einsum_kept = saved_for_backward(
        lambda: e + torch.einsum("mk,bknd->bmnd", upd.w_pa, e_hat), exclude=(e, e_hat, upd.w_pa))
    assert einsum_kept >= e_hat.numel() * e_hat.element_size()
