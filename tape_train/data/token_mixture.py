"""Weighted mixtures of token sources (``data.format: tokens``): the source of global sample
``i`` and its index among that source's samples, computed from ``i`` alone.

Global samples are grouped in *mixture blocks* of ``B`` consecutive indices (``B = 4096``).
``C_s(k)``, the number of samples of source ``s`` before block ``k``, is the largest-remainder
(Hamilton) apportionment of ``k·B`` samples by the weights, in exact rational arithmetic (ties
go to the lower source index). So ``|C_s(k) − k·B·p_s| < 1`` at every ``k``, with ``p_s`` the
normalised weight: the rounding remainders carry over from block to block instead of being
lost, and the long-run shares are the weights exactly. Block ``k`` holds
``q_s(k) = C_s(k+1) − C_s(k)`` samples of source ``s``, within 2 of ``B·p_s`` and never
negative while every ``p_s ≥ 1/B`` (``C_s(k)`` is ``floor(k·B·p_s)`` or one more, so
``q_s(k) > B·p_s − 2 ≥ −1``).

Within block ``k``, slot ``t`` (sample ``k·B + t``) takes position ``π_k(t)`` of the list
``[s=0] × q_0, [s=1] × q_1, …``, where ``π_k`` is a ``feistel_permutation`` of ``[0, B)``
keyed by ``(seed, k)`` (the identity with ``shuffle: false``, which puts each block's samples
in source order). Its source is the ``s`` whose range holds that position, and it is that
source's sample ``j = C_s(k) + π_k(t) − Q_s(k)`` with ``Q_s(k) = q_0 + … + q_{s−1}``: the
samples of source ``s`` are numbered ``0, 1, 2, …`` without gaps or repeats. Cost per sample:
one Feistel evaluation and an ``O(S log S)`` apportionment per block, independent of ``i``.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np

from tape_train.data.tokens import feistel_permutation

MIXTURE_BLOCK = 4096
_SLOT_TAG = 0x4D58


def integer_weights(weights: list[float]) -> list[int]:
    """The weights as the smallest integers in the same ratio, read as the decimals they print
    as (``0.1, 0.3`` → ``1, 3``): exact, so every machine apportions identically."""
    fractions = [Fraction(repr(float(w))) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    common = math.gcd(*ints)
    return [i // common for i in ints]


class SampleMixture:
    """Source and per-source index of global sample indices, for integer ``weights`` (each
    at least ``1/block`` of their sum)."""

    def __init__(self, weights: list[int], seed: int, shuffle: bool = True,
                 block: int = MIXTURE_BLOCK):
        self.weights = [int(w) for w in weights]
        self.total = sum(self.weights)
        if min(self.weights) <= 0 or any(w * block < self.total for w in self.weights):
            raise ValueError(f"SampleMixture: every weight must be > 0 and at least 1/{block} of "
                             f"the total, got {self.weights}")
        self.seed, self.shuffle, self.block = int(seed), shuffle, block
        self._before = functools.lru_cache(maxsize=8)(self._apportion)

    def ratio(self) -> str:
        return ":".join(str(w) for w in self.weights)

    def _apportion(self, k: int) -> tuple[int, ...]:
        """``C(k)``: samples of each source among the first ``k·B`` (largest remainder)."""
        n = k * self.block
        parts = [divmod(n * w, self.total) for w in self.weights]
        counts = [floor for floor, _ in parts]
        extra = n - sum(counts)
        by_remainder = sorted(range(len(parts)), key=lambda s: (-parts[s][1], s))
        for s in by_remainder[:extra]:
            counts[s] += 1
        return tuple(counts)

    def before(self, k: int) -> tuple[int, ...]:
        """Samples of each source before mixture block ``k``."""
        return self._before(int(k))

    def locate(self, samples) -> tuple[np.ndarray, np.ndarray]:
        """``(source, index within the source)`` of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64).reshape(-1)
        sources = np.empty_like(samples)
        indices = np.empty_like(samples)
        blocks, slots = samples // self.block, samples % self.block
        for k in np.unique(blocks):
            sel = blocks == k
            start, end = self.before(int(k)), self.before(int(k) + 1)
            quotas = np.subtract(end, start)
            first = np.concatenate([[0], np.cumsum(quotas)[:-1]])  # Q_s(k)
            position = feistel_permutation(slots[sel], self.block, [self.seed, _SLOT_TAG, int(k)]) \
                if self.shuffle else slots[sel]
            source = np.searchsorted(first, position, side="right") - 1
            sources[sel] = source
            indices[sel] = np.asarray(start, dtype=np.int64)[source] + position - first[source]
        return sources, indices

    def counts(self, samples: int) -> list[int]:
        """Samples of each source among the first ``samples`` global samples (at most one
        block's Feistel evaluations: for logging and epoch counts)."""
        k, within = divmod(int(samples), self.block)
        out = list(self.before(k))
        if within:
            sources, _ = self.locate(np.arange(k * self.block, k * self.block + within))
            for s, n in zip(*np.unique(sources, return_counts=True)):
                out[int(s)] += int(n)
        return out
