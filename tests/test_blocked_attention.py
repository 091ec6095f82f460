"""The blocked CPU attention against the plain fp64 reference: values, gradients, causality,
GQA, head chunking, bf16, and what it keeps for backward."""

from __future__ import annotations

import pytest
import torch

from tape_train.model import blocked_attention as blocked_mod
from tape_train.model.attention import eager_attention
from tape_train.model.blocked_attention import blocked_attention


def _inputs(b=2, h=3, n=37, d=8, dv=24, hkv=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hkv = h if hkv is None else hkv
    q = torch.randn(b, h, n, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _values_and_grads(fn, q, k, v, grad_seed=1):
    out = fn(q, k, v)
    # Drawn in fp32 and then cast: randn's stream for large bf16 tensors differs from fp32's
    # in some torch releases (2.11), and a bf16 run must get the fp32 run's upstream gradient.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed),
                    dtype=torch.promote_types(out.dtype, torch.float32)).to(out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.parametrize("n, dv, block", [(1, 24, 16), (16, 8, 16), (37, 24, 16), (70, 24, 128)])
def test_matches_fp64_reference_values_and_gradients(n, dv, block):
    q, k, v = _inputs(n=n, dv=dv)
    got = _values_and_grads(lambda *t: blocked_attention(*t, block=block), q, k, v)
    ref = _values_and_grads(eager_attention, q, k, v)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=name)


def test_head_chunks_and_strided_inputs(monkeypatch):
    # A logits budget of one block row per chunk forces one head per chunk.
    monkeypatch.setattr(blocked_mod, "LOGITS_BUDGET", 16 * 40)
    q, k, v = _inputs(n=40, h=5)
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # token-major
    got = _values_and_grads(lambda *t: blocked_attention(*t, block=16), qt, k, v)
    ref = _values_and_grads(eager_attention, q, k, v)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_grouped_query_attention():
    q, k, v = _inputs(h=4, hkv=2, dv=8)
    got = _values_and_grads(lambda *t: blocked_attention(*t, block=16), q, k, v)
    ref = _values_and_grads(eager_attention, q, k, v)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_causal_a_key_changes_exactly_the_rows_that_see_it():
    q, k, v = (t.detach() for t in _inputs(n=50))
    base = blocked_attention(q, k, v, block=16)
    j = 23
    k2, v2 = k.clone(), v.clone()
    k2[:, :, j] += 1.0
    v2[:, :, j] -= 2.0
    moved = (blocked_attention(q, k2, v2, block=16) - base).abs().amax(dim=(0, 1, 3))
    assert moved[:j].max() == 0                # earlier queries never see key j
    assert moved[j:].min() > 1e-6              # negative control: every later query does


def test_bf16_is_close_to_the_fp32_reference():
    q, k, v = _inputs(n=200, d=32, dv=96, dtype=torch.float32)
    ref = _values_and_grads(eager_attention, q, k, v)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    got = _values_and_grads(blocked_attention, *low)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.dtype == torch.bfloat16
        err = (a.float() - r).abs().max() / r.abs().max()
        assert err < 2e-2, (name, float(err))


def test_keeps_only_inputs_output_and_lse_for_backward():
    n = 256
    q, k, v = _inputs(b=1, h=2, n=n, d=16, dv=48, dtype=torch.float32)
    for fn, quadratic in ((blocked_attention, False), (eager_attention, True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            fn(q, k, v)
        largest = max(t.numel() for t in saved)
        # The N×N probabilities (2·N² elements) are what a materialising attention keeps.
        assert (largest >= 2 * n * n) == quadratic, (fn.__name__, largest)
