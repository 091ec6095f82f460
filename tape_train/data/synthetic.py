"""Deterministic random-token batches for benchmarks, smoke runs and trainer tests.

``train.synthetic_data: true`` trains on these instead of ``data:`` (no corpus, no tokenizer).
The global batch of a step does not depend on the data-parallel size: global sample ``g`` is
built from a generator seeded with ``(seed, g)``, and step ``s`` uses samples
``[s·B, (s+1)·B)`` with ``B = micro_batch_size · grad_accum_steps · dp_size``; rank ``r``'s
``m``-th micro-batch of the step holds samples ``s·B + (r·grad_accum_steps + m)·b + [0, b)``.
So one process with ``grad_accum_steps = k·a`` sees the same global batch as ``k`` processes
with ``grad_accum_steps = a`` (same token-weighted loss, same update).

``mask_fraction > 0`` replaces a random prefix (up to that fraction) of every row's labels by
−100, so ranks and micro-batches hold *different* numbers of target tokens: the case where a
per-micro-batch mean loss would be wrong.
"""

from __future__ import annotations

import time

import torch

IGNORE_INDEX = -100


def synthetic_sample(index: int, seed: int, vocab_size: int, seq_len: int,
                     mask_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Global sample ``index``: ``(input_ids (L,), labels (L,))`` int64, labels shifted."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    tokens = torch.randint(0, vocab_size, (seq_len + 1,), generator=gen)
    labels = tokens[1:].clone()
    if mask_fraction > 0:
        masked = int(torch.randint(0, int(mask_fraction * seq_len) + 1, (1,), generator=gen))
        labels[:masked] = IGNORE_INDEX
    return tokens[:-1], labels


class SyntheticLoader:
    """Endless resumable iterator of ``{"input_ids", "labels"}`` (b, L) int64 batches."""

    def __init__(self, vocab_size: int, seq_len: int, micro_batch_size: int,
                 grad_accum_steps: int, dp_rank: int, dp_size: int, seed: int,
                 mask_fraction: float = 0.0) -> None:
        self.vocab_size, self.seq_len, self.b = vocab_size, seq_len, micro_batch_size
        self.gas, self.dp_rank, self.dp_size = grad_accum_steps, dp_rank, dp_size
        self.seed, self.mask_fraction = seed, mask_fraction
        self.position = 0  # micro-batches this rank has yielded
        self.wait_seconds = 0.0

    def __iter__(self) -> "SyntheticLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        step, micro = divmod(self.position, self.gas)
        global_batch = self.b * self.gas * self.dp_size
        first = step * global_batch + (self.dp_rank * self.gas + micro) * self.b
        rows = [synthetic_sample(first + i, self.seed, self.vocab_size, self.seq_len,
                                 self.mask_fraction) for i in range(self.b)]
        self.position += 1
        self.wait_seconds += time.perf_counter() - start
        return {"input_ids": torch.stack([r[0] for r in rows]),
                "labels": torch.stack([r[1] for r in rows])}

    def state_dict(self) -> dict:
        """Taken at optimizer-step boundaries: the stream is indexed by (step, global batch),
        so the state does not depend on the rank or the layout."""
        return {"steps": self.position // self.gas, "global_batch": self.b * self.gas * self.dp_size}

    def load_state_dict(self, state: dict, allow_mismatch: bool = False) -> None:
        global_batch = self.b * self.gas * self.dp_size
        if state["global_batch"] != global_batch and not allow_mismatch:
            raise ValueError(f"synthetic loader state is for a global batch of "
                             f"{state['global_batch']} samples, this run's is {global_batch}")
        self.position = int(state["steps"]) * self.gas


def synthetic_eval_documents(vocab_size: int, num_documents: int, length: int, seed: int):
    """Held-out random documents ``(token_ids, n_bytes)``; bytes are counted as one per
    predicted token (the first token of a document is context only, never predicted), so bits
    per byte is bits per token."""
    for i in range(num_documents):
        gen = torch.Generator().manual_seed(seed * 7_919 + 10**9 + i)
        yield torch.randint(0, vocab_size, (length,), generator=gen).tolist(), length - 1


# The scheduled evaluation of a run on synthetic data scores this many random documents.
SYNTHETIC_EVAL_DOCUMENTS = 4


def synthetic_held_out(vocab_size: int, longest: int, seed: int):
    """The held-out set of a run trained on synthetic data: ``SYNTHETIC_EVAL_DOCUMENTS``
    documents of ``2 * longest + 1`` tokens, ``longest`` the longest evaluation length of the
    run's ``eval`` section. The trainer's scheduled evaluation and tape-eval both read it from
    here, so tape-eval on a checkpoint scores the documents the run's log was measured on."""
    return synthetic_eval_documents(vocab_size, SYNTHETIC_EVAL_DOCUMENTS, 2 * longest + 1, seed)
