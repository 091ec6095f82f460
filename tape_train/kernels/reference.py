"""Plain-PyTorch TAPE attention: the reference every backend and kernel is measured against.

Spec §2 (attention sublayer). All tensors are head-major, shape (b, M, N, D) for queries and
(b, M, Nk, D) for keys/values/E; rotate-half layout pairs channel β with β + D/2. The
computation runs in the input dtype, so calling it with fp64 tensors gives the fp64 reference.
"""

from __future__ import annotations

import math

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """rot(x) = [-x[D/2:], x[:D/2]] along the last dim (Llama's rotate-half layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def modulate(x: torch.Tensor, e0: torch.Tensor, e1: torch.Tensor) -> torch.Tensor:
    """x̃ = x ⊙ E⁰ + rot(x) ⊙ E¹ (per token; at layer 0 this is exactly RoPE)."""
    return x * e0 + rotate_half(x) * e1


def tape_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e0_q: torch.Tensor,
    e1_q: torch.Tensor,
    e0_k: torch.Tensor | None = None,
    e1_k: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    premodulated_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal TAPE attention with one softmax shared by the value and both E tables.

    Args:
        q: (b, M, Nq, D) queries, not yet modulated.
        k: (b, M, Nk, D) keys, not yet modulated (or already k̃ if ``premodulated_k``).
        v: (b, M, Nk, Dv) values.
        e0_q, e1_q: (b|1, M, Nq, D) positional state at the query positions.
        e0_k, e1_k: (b|1, M, Nk, D) positional state at the key positions; default: the query
            ones (self-attention over the same tokens). These are also the attended "values".
        causal: queries are the last Nq of the Nk key positions (KV-cache decoding aligns them
            to the end); query i sees keys j ≤ i + (Nk − Nq).
        scale: logit scale, default 1/√D.
        bias: optional additive (b|1, M|1, Nq, Nk) or boolean mask (True = keep).
        premodulated_k: ``k`` is already k̃ (the KV cache stores k̃).

    Returns:
        (O, Ê⁰, Ê¹): (b, M, Nq, Dv), (b, M, Nq, D), (b, M, Nq, D), where Ê^c = A·E^c_k.
    """
    if e0_k is None:
        e0_k, e1_k = e0_q, e1_q
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qt = modulate(q, e0_q, e1_q)
    kt = k if premodulated_k else modulate(k, e0_k, e1_k)
    logits = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    nq, nk = logits.shape[-2], logits.shape[-1]
    if bias is not None:
        if bias.dtype == torch.bool:
            logits = logits.masked_fill(~bias, float("-inf"))
        else:
            logits = logits + bias
    if causal:
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        logits = logits.masked_fill(~keep, float("-inf"))
    attn = torch.softmax(logits, dim=-1)
    b, m = attn.shape[:2]
    o = torch.matmul(attn, v)
    e0_hat = torch.matmul(attn, e0_k.expand(b, m, *e0_k.shape[2:]))
    e1_hat = torch.matmul(attn, e1_k.expand(b, m, *e1_k.shape[2:]))
    return o, e0_hat, e1_hat
