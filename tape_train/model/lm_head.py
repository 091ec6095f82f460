"""The output projection and the training loss, computed in token chunks so that the (tokens ×
vocabulary) logits never exist whole.

With plain autograd, ``F.cross_entropy(lm_head(h).float(), labels)`` keeps the logits in the
run dtype, an fp32 copy and the fp32 log-softmax for the backward: at 32 k tokens and a 32 k
vocabulary 2 + 4 + 4 GiB, the largest tensors of a 350m step. Here the loss of each chunk of
tokens is formed from its logits and discarded; when gradients are wanted the chunk's
gradients are formed in the same pass (softmax − one-hot, two GEMMs: the three GEMMs of the
plain path, none recomputed), so the backward only scales them. What stays for the backward:
∂h (tokens × hidden, in h's dtype) and ∂W (vocabulary × hidden, fp32).

Values match the plain path to rounding: logits are the same GEMM in the same dtype,
log-sum-exp in fp32; ∂W sums per-chunk GEMMs in fp32 (``tests/test_model_layers.py``
compares with ``F.cross_entropy`` in fp64 and bf16).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
# Logit elements per chunk (fp32: 256 MiB): a 32 000 vocabulary gives 2097-token GEMMs.
LOGITS_CHUNK_ELEMENTS = 1 << 26


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab_size``."""
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)


def _acc_dtype(h: torch.Tensor) -> torch.dtype:
    return torch.float64 if h.dtype == torch.float64 else torch.float32


def _chunk_loss(h_c, weight, labels_c):
    """One chunk: h_c (t, C), labels_c (t,) → (softmax (t, V) in fp32, summed NLL over labels
    ≠ IGNORE_INDEX, valid mask (t,), clamped targets (t,)). One exp pass over the logits,
    which become the softmax in place."""
    logits = F.linear(h_c, weight).to(_acc_dtype(h_c))          # (t, V)
    valid = labels_c != IGNORE_INDEX
    target = torch.where(valid, labels_c, 0)
    picked = logits.gather(1, target[:, None])[:, 0]
    peak = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(peak).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    lse = (peak + total.log())[:, 0]
    nll = torch.where(valid, lse - picked, 0.0).sum()
    return probs.div_(total), nll, valid, target


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Σ over labels ≠ IGNORE_INDEX of −log softmax(h·Wᵀ)[label], in fp32 (fp64 for fp64).

    h (T, C), weight (V, C), labels (T,) → 0-dim. Gradients formed in the forward.
    """

    @staticmethod
    def forward(ctx, h, weight, labels, chunk):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _acc_dtype(h)
        total = torch.zeros((), dtype=acc, device=h.device)
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
        rows = torch.arange(min(chunk, h.shape[0]), device=h.device)
        for start in range(0, h.shape[0], chunk):
            h_c, labels_c = h[start:start + chunk], labels[start:start + chunk]
            grad, nll, valid, target = _chunk_loss(h_c, weight, labels_c)
            total += nll
            if not (want_h or want_w):
                continue
            # ∂nll/∂logits = softmax − one-hot on the counted tokens, 0 elsewhere (in place).
            grad[rows[:len(target)], target] -= 1.0
            grad.mul_(valid[:, None])
            grad = grad.to(h.dtype)
            if want_h:
                torch.mm(grad, weight, out=dh[start:start + chunk])
            if want_w:
                dw += torch.mm(grad.t(), h_c).to(acc)
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        d_h = (dh.to(grad.dtype) * grad).to(dh.dtype) if dh is not None else None
        d_w = (dw * grad).to(ctx.weight_dtype) if dw is not None else None
        return d_h, d_w, None, None


def chunked_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              chunk: int | None = None) -> torch.Tensor:
    """Summed token NLL of the logits h·Wᵀ without forming them whole.

    h (…, C), weight (V, C), labels (…) with IGNORE_INDEX for tokens not counted; returns a
    0-dim fp32 tensor (fp64 for fp64 h). ``chunk``: tokens per chunk (default by V).
    """
    chunk = chunk or chunk_tokens(weight.shape[0])
    h2, labels1 = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(h2, weight, labels1, chunk)
    total = torch.zeros((), dtype=_acc_dtype(h), device=h.device)
    for start in range(0, h2.shape[0], chunk):
        total += _chunk_loss(h2[start:start + chunk], weight, labels1[start:start + chunk])[1]
    return total


class LMHead(nn.Module):
    """Vocabulary projection (no bias). ``forward(h)`` → logits (…, V);
    ``forward(h, labels)`` → summed NLL over labels ≠ IGNORE_INDEX (0-dim fp32), chunked.

    One module for both, so that ZeRO-3 gathers ``weight`` around either (it gathers a
    module's parameters when the module is called).
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        # nn.Linear's own initialisation: the model re-initialises every weight, but drawing
        # the same random numbers here as the nn.Linear this replaced keeps a seed's weights.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        # Tokens per loss chunk; None: by the vocabulary (``chunk_tokens``). The preflight's
        # meta-device trace sets one chunk for all tokens: the same saved tensors (∂h, ∂W),
        # without a loop over chunks that grows with the batch.
        self.loss_chunk: int | None = None

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return F.linear(h, self.weight)
        return chunked_cross_entropy_sum(h, self.weight, labels, self.loss_chunk)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"
