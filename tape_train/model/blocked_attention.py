"""Causal attention in query blocks on plain GEMMs: the CPU counterpart of the fused kernel.

``blocked_attention(q, k, v)`` computes softmax(q·kᵀ·scale + causal mask)·v with the logits
at the key width D and the value at any width Dv — TAPE's [v | E⁰ | E¹] is 3D wide — which
PyTorch's CPU flash kernel cannot do (it needs Dv = D; padding q and k to 3D triples the
QKᵀ work). Like FlashAttention it keeps only the output and the log-sum-exp for backward and
recomputes the probabilities there, so memory stays O(N) per row:

    forward   per query block i:  S = q_i·k_{≤i}ᵀ, P = softmax(S), o_i = P·v_{≤i}, lse_i
    backward  per query block i:  P = exp(S − lse_i); dv += Pᵀ·do_i; dP = do_i·vᵀ;
              dS = P ⊙ (dP − Δ_i)·scale with Δ = rowsum(do ⊙ o); dq_i = dS·k; dk += dSᵀ·q_i

Keys after a block's last query are skipped (causal), so the GEMM work is what the FLOP
model counts up to the diagonal blocks. Statistics and accumulation are fp32 (fp64 for fp64
inputs): on CPUs the fp32 GEMMs of the blocks are also faster than bf16 ones, which is why
``auto`` prefers this path for bf16 as well (measurements in docs/model.md).
Shapes: q, k (b, H, N, D); v (b, H, N, Dv); GQA (fewer k/v heads) by repeating k and v.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128                 # queries per block
LOGITS_BUDGET = 1 << 23     # logits elements per block (fp32: 32 MiB); bounds the head chunk


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None = None, block: int = BLOCK) -> torch.Tensor:
    """Causal attention with Nq = Nk = N; returns (b, H, N, Dv) in v's dtype."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"blocked attention needs as many queries as keys "
                         f"(got {q.shape[2]} and {k.shape[2]}); decoding uses sdpa")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _BlockedAttention.apply(q, k, v, scale, block)


def _rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b, H, N, X) in any layout → contiguous (b·H, N, X) in ``dtype``, one pass at most."""
    if t.dtype == dtype and t.is_contiguous():
        return t.view(-1, *t.shape[-2:])
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    out.copy_(t)
    return out.view(-1, *t.shape[-2:])


def _chunks(bh: int, n: int, block: int):
    """(head slice, query start, query end) in the order the loops visit them."""
    heads = max(1, LOGITS_BUDGET // (block * n))
    for h0 in range(0, bh, heads):
        hs = slice(h0, min(bh, h0 + heads))
        for i in range(0, n, block):
            yield hs, i, min(n, i + block)


def _future_mask(block: int, like: torch.Tensor) -> torch.Tensor:
    """(block, block) additive mask: −inf above the diagonal, 0 elsewhere."""
    return torch.full((block, block), float("-inf"), dtype=like.dtype,
                      device=like.device).triu_(1)


def _causal_logits(qr, kr, hs: slice, i: int, e: int, scale: float,
                   future: torch.Tensor) -> torch.Tensor:
    """Scaled logits of queries i:e against keys :e, (heads, e − i, e), masked above the
    diagonal (only the last e − i columns can be in the future). An in-place add of the
    dense mask: measured faster than masked_fill_ on the strided diagonal tile."""
    s = torch.bmm(qr[hs, i:e], kr[hs, :e].transpose(1, 2)).mul_(scale)
    s[:, :, i:].add_(future[:e - i, :e - i])
    return s


class _BlockedAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, scale, block):
        acc = torch.promote_types(v.dtype, torch.float32)
        n = q.shape[2]
        qr, kr, vr = _rows(q, acc), _rows(k, acc), _rows(v, acc)
        bh, dv = vr.shape[0], vr.shape[-1]
        out = torch.empty(bh, n, dv, dtype=acc, device=q.device)
        lse = torch.empty(bh, n, 1, dtype=acc, device=q.device)
        future = _future_mask(block, qr)
        for hs, i, e in _chunks(bh, n, block):
            s = _causal_logits(qr, kr, hs, i, e, scale, future)
            row_max = s.amax(dim=-1, keepdim=True)
            p = s.sub_(row_max).exp_()
            total = p.sum(dim=-1, keepdim=True)
            torch.bmm(p, vr[hs, :e], out=out[hs, i:e])
            out[hs, i:e].div_(total)
            torch.add(row_max, total.log_(), out=lse[hs, i:e])
        o = out.view(v.shape[:-1] + (dv,)).to(v.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.block = scale, block
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse = ctx.saved_tensors
        scale, block = ctx.scale, ctx.block
        acc = lse.dtype
        n = q.shape[2]
        qr, kr, vr = _rows(q, acc), _rows(k, acc), _rows(v, acc)
        do = _rows(grad, acc)
        delta = (do * _rows(o, acc)).sum(dim=-1, keepdim=True)          # (bh, N, 1)
        dq = torch.empty_like(qr)
        dk = torch.zeros_like(kr)
        dv = torch.zeros_like(vr)
        future = _future_mask(block, qr)
        for hs, i, e in _chunks(qr.shape[0], n, block):
            p = _causal_logits(qr, kr, hs, i, e, scale, future).sub_(lse[hs, i:e]).exp_()
            dv[hs, :e].baddbmm_(p.transpose(1, 2), do[hs, i:e])
            ds = torch.bmm(do[hs, i:e], vr[hs, :e].transpose(1, 2))
            ds.sub_(delta[hs, i:e]).mul_(p).mul_(scale)
            torch.bmm(ds, kr[hs, :e], out=dq[hs, i:e])
            dk[hs, :e].baddbmm_(ds.transpose(1, 2), qr[hs, i:e])
        return (dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype),
                dv.view(v.shape).to(v.dtype), None, None)
