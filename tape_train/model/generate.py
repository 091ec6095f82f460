"""Autoregressive generation with the KV cache: greedy, temperature, top-k, top-p."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tape_train.model.cache import KVCache


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None,
                   top_p: float | None, name: Callable[[str], str] = str) -> None:
    """Raise ``ValueError`` naming the first invalid sampling setting (``name`` spells a
    parameter the way the caller's user wrote it, e.g. ``--top-p``)."""
    if max_new_tokens < 0:
        raise ValueError(f"{name('max_new_tokens')} must be >= 0, got {max_new_tokens}")
    if not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"{name('temperature')} must be a finite number >= 0 (0 = greedy), "
                         f"got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"{name('top_k')} must be >= 0 (0 = off), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"{name('top_p')} must be in (0, 1] (1 = off), got {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """Next token ids (b,) from last-position logits (b, V). temperature 0 = greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             generator: torch.Generator | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None,
             vocab_size: int | None = None) -> torch.Tensor:
    """Prompt (b, N) → (b, N + generated). Prefill once, then one token per step.

    ``on_token`` receives each step's (b,) new ids (for streaming to a console). Generation
    stops early when every row has produced ``eos_id``. ``vocab_size``: sample only ids below
    it, the tokenizer's pieces (an embedding larger than the tokenizer has rows that no text
    decodes to; a model that was barely trained samples them).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    was_training = model.training
    model.eval()
    cache = KVCache(model.cfg.num_layers)
    out = model(input_ids, cache=cache)
    tokens = [input_ids]
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        nxt = sample_next(out.logits[:, -1, :vocab_size], temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = nxt.masked_fill(finished, eos_id)
            finished |= nxt == eos_id
        tokens.append(nxt[:, None])
        if on_token is not None:
            on_token(nxt)
        if eos_id is not None and bool(finished.all()):
            break
        out = model(nxt[:, None], cache=cache)
    model.train(was_training)
    return torch.cat(tokens, dim=1)
