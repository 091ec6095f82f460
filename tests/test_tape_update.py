"""TAPE's state update as one autograd node (tape_train/model/pe/tape_update.py) against
autograd through the plain form: values, every gradient, fp64 gradcheck, and what it keeps."""

import pytest
import torch

from tape_train.model import load_model_config
from tape_train.model.pe.tape import TapeStateUpdate
from tape_train.model.pe.tape_update import TapeUpdateFunction
from tape_train.train.memory import saved_for_backward


def _update(mode: str, dtype=torch.float64) -> TapeStateUpdate:
    cfg = load_model_config("tiny", pe="tape", tape_post_attn=mode)
    upd = TapeStateUpdate(cfg).to(dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in upd.parameters():       # W_up, W_pa are zero at init: nothing would be mixed
            p.normal_(std=0.3)
    return upd


def _inputs(upd, b=3, n=7, broadcast=False, dtype=torch.float64):
    m, d, c = upd.cfg.num_heads, upd.cfg.head_dim, upd.cfg.hidden_size
    if broadcast:   # layer 0: RoPE tables, batch 1 and one row shared by every head, no grad
        state = tuple(torch.randn(1, 1, n, d, dtype=dtype).expand(1, m, n, d) for _ in range(2))
    else:
        state = tuple(torch.randn(b, m, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    e_hat = tuple(torch.randn(b, m, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    y = torch.randn(b, n, c, dtype=dtype, requires_grad=True)
    return state, e_hat, y


def _plain(upd, state, e_hat, y):
    return upd.plain_update(state, e_hat, y)


def _values_and_grads(fn, upd, state, e_hat, y, weights):
    out = fn(upd, state, e_hat, y)
    leaves = [t for t in (*state, *e_hat, y, *upd.parameters()) if t.requires_grad]
    grads = torch.autograd.grad(out, leaves, weights)
    return [o.detach() for o in out], grads


@pytest.mark.parametrize("mode", ["headmix", "rowsum"])
@pytest.mark.parametrize("broadcast", [False, True])
def test_update_node_equals_the_plain_form(mode, broadcast):
    upd = _update(mode)
    state, e_hat, y = _inputs(upd, broadcast=broadcast)
    weights = [torch.randn(3, upd.cfg.num_heads, 7, upd.cfg.head_dim, dtype=torch.float64)
               for _ in range(2)]
    fused = _values_and_grads(lambda u, *a: u(*a), upd, state, e_hat, y, weights)
    plain = _values_and_grads(_plain, upd, state, e_hat, y, weights)
    for a, b in zip(fused[0] + list(fused[1]), plain[0] + list(plain[1])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Negative control: the other post-attention form gives other values and gradients.
    other = _update("rowsum" if mode == "headmix" else "headmix")
    other.load_state_dict(upd.state_dict())
    wrong = _values_and_grads(_plain, other, state, e_hat, y, weights)
    assert not torch.allclose(wrong[0][0], fused[0][0])
    assert not torch.allclose(wrong[1][-4], fused[1][-4])        # ∂W_pa


@pytest.mark.parametrize("mode", ["headmix", "rowsum"])
def test_update_node_gradcheck_fp64(mode):
    # Small enough for finite differences of every input element (b 2, M 3, N 3, D 4, P 5).
    b, m, n, d, p = 2, 3, 3, 4, 5
    torch.manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    inputs = (*(leaf(b, m, n, d) for _ in range(4)), leaf(b, n, p), leaf(m, m), leaf(p, m),
              leaf(m, p))
    assert torch.autograd.gradcheck(
        lambda *a: TapeUpdateFunction.apply(*a, mode == "headmix"), inputs)


def test_update_node_one_table_unused_and_views_of_a_joined_output():
    """Ê as views of one [v | Ê⁰ | Ê¹] output (SDPA, blocked) and a loss reading only E⁰."""
    upd = _update("headmix")
    state, _, y = _inputs(upd)
    m, d = upd.cfg.num_heads, upd.cfg.head_dim
    joined = torch.randn(3, m, 7, 3 * d, dtype=torch.float64, requires_grad=True)
    e_hat = (joined[..., d:2 * d], joined[..., 2 * d:])
    assert not e_hat[0].is_contiguous()
    out = upd(state, e_hat, y)
    ref = _plain(upd, state, e_hat, y)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out[0].sum(), (joined, *state, y), allow_unused=True)
    want = torch.autograd.grad(ref[0].sum(), (joined, *state, y), allow_unused=True)
    assert want[2] is None                       # E¹ does not reach E''⁰
    for a, b, x in zip(got, want, (joined, *state, y)):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(x),
                                   b if b is not None else torch.zeros_like(x),
                                   rtol=1e-12, atol=1e-12)


def test_update_node_in_bf16_is_as_close_to_fp64_as_the_plain_form():
    upd64 = _update("headmix")
    state, e_hat, y = _inputs(upd64, b=2, n=64)
    ref = _plain(upd64, state, e_hat, y)
    upd = _update("headmix", torch.bfloat16)
    low = [tuple(t.detach().bfloat16() for t in ts) for ts in (state, e_hat)]
    fused = upd(low[0], low[1], y.detach().bfloat16())
    plain = _plain(upd, low[0], low[1], y.detach().bfloat16())
    for f, p, r in zip(fused, plain, ref):
        err_fused = (f.double() - r).abs().max().item()
        err_plain = (p.double() - r).abs().max().item()
        assert err_fused <= 1.5 * err_plain + 1e-3, (err_fused, err_plain)


def test_update_node_keeps_no_copy_of_the_state():
    """Beside E, Ê and y (kept by the attention core and the MLP anyway) the node keeps K and
    the gate; the plain form also keeps E' and its token-major copy, per table."""
    upd = _update("headmix", torch.float32)
    state, e_hat, y = _inputs(upd, b=2, n=64, dtype=torch.float32)
    alive = (*state, *e_hat, y, *upd.parameters())
    e_bytes = e_hat[0].numel() * e_hat[0].element_size()
    _, fused = saved_for_backward(lambda: upd(state, e_hat, y), exclude=alive)
    _, plain = saved_for_backward(lambda: _plain(upd, state, e_hat, y), exclude=alive)
    assert fused < e_bytes / 2
    assert plain >= fused + 2 * e_bytes          # negative control: the plain form keeps E'


def test_plain_form_without_grad():
    """Inference (no grad) runs the plain form: contiguous outputs, equal values."""
    upd = _update("headmix")
    state, e_hat, y = _inputs(upd)
    with torch.no_grad():
        out = upd(state, e_hat, y)
        ref = _plain(upd, state, e_hat, y)
    assert all(o.is_contiguous() for o in out)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
