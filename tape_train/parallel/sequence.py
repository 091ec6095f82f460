"""Sequence parallelism (DeepSpeed-Ulysses) for every encoding whose modulation is per token.

Each SP rank holds a contiguous chunk of n = N/sp tokens of every sequence. The q/k modulation
(RoPE tables, TAPE's E⁰/E¹) is per token, so it happens on the chunk, before the exchange, with
layer-0 positions offset by the chunk start. :class:`ParallelAttentionCore` then swaps the
sequence split for a head split with ONE all-to-all of the packed [q̃ | k̃ | v] (for TAPE
v = [v | E⁰ | E¹], so the state rides with the value and one softmax serves all three outputs),
runs the ordinary causal attention on the full sequence for H/sp heads, and swaps back with one
more all-to-all. The same exchange as ``deepspeed.sequence.layer.DistributedAttention``
(scatter heads, gather sequence), written here on the head-major (b, H, N, D) layout the model
uses so no transposes are added around it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from tape_train.model.attention import join_value, split_like, value_widths
from tape_train.parallel.collectives import (group_size, heads_to_sequence, scatter_heads,
                                             sequence_to_heads)


class ParallelAttentionCore(nn.Module):
    """Drop-in replacement of ``Attention.core`` under SP and/or TP (no parameters).

    forward(q (b, H_l, n, D), k (b, H_kv,l, n, D), v (b, H_kv,l, n, Dv), *, backend, bias,
    alibi_slopes) → (b, H_l, n, Dv), where H_l = heads on this TP rank, n = N/sp; ``v`` may be
    given in parts (TAPE's v, E⁰, E¹), and the output then comes in the same parts.

    * sp > 1: Ulysses exchange around the wrapped core (see module docstring).
    * tp > 1: a dense bias / ALiBi slopes built for all M heads are cut to this TP rank's heads;
      the cut's backward all-gathers, so learned bias parameters (T5, FIRE) get full gradients.
    """

    def __init__(self, inner: nn.Module, sp_group, tp_group) -> None:
        super().__init__()
        self.inner = inner
        self.sp_group = sp_group
        self.tp_group = tp_group

    def forward(self, q, k, v, *, backend: str, bias=None, alibi_slopes=None):
        tp = group_size(self.tp_group)
        if tp > 1:
            if bias is not None and bias.shape[1] == q.shape[1] * tp:  # per-head bias
                bias = scatter_heads(bias, self.tp_group)
            if alibi_slopes is not None and alibi_slopes.shape[0] == q.shape[1] * tp:
                alibi_slopes = alibi_slopes.chunk(tp)[dist.get_rank(self.tp_group)]
        if group_size(self.sp_group) == 1:
            return self.inner(q, k, v, backend=backend, bias=bias, alibi_slopes=alibi_slopes)
        if bias is not None or alibi_slopes is not None:
            raise ValueError("a dense attention bias cannot be sequence-parallel (the grid "
                             "check rejects alibi/t5/fire with parallel.sp > 1)")
        if q.shape[2] != k.shape[2]:
            raise ValueError("KV-cache decoding is not sequence-parallel: generate with "
                             "parallel.sp=1 (the cache would hold only this rank's chunk)")
        # A value in parts (TAPE's v, E⁰, E¹) is exchanged and attended as one [v | E⁰ | E¹]
        # tensor; the output is cut back into the parts.
        widths = value_widths(v)
        v = join_value(v)
        if q.shape[1] == k.shape[1]:
            # One exchange for everything: [q̃ | k̃ | v (| E⁰ | E¹)] share the head split.
            dq, dk = q.shape[-1], k.shape[-1]
            packed = sequence_to_heads(torch.cat((q, k, v), dim=-1), self.sp_group)
            q, k, v = packed.split((dq, dk, v.shape[-1]), dim=-1)
        else:  # GQA: fewer key/value heads, two exchanges
            q = sequence_to_heads(q, self.sp_group)
            dk = k.shape[-1]
            kv = sequence_to_heads(torch.cat((k, v), dim=-1), self.sp_group)
            k, v = kv.split((dk, v.shape[-1]), dim=-1)
        out = self.inner(q, k, v, backend=backend)
        return split_like(heads_to_sequence(out, self.sp_group), widths)


def sequence_chunk(length: int, grid) -> slice:
    """The token range [start, stop) of the full sequence held by this SP rank."""
    if length % grid.sp:
        raise ValueError(f"sequence length {length} is not divisible by parallel.sp={grid.sp}")
    n = length // grid.sp
    return slice(grid.sp_rank * n, (grid.sp_rank + 1) * n)


def shard_batch(batch: dict, grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (input_ids, labels, positions) of a data-parallel batch.

    ``batch``: {"input_ids": (b, N), "labels": (b, N)} as the loader yields it for this DP rank
    (labels already aligned: labels[i] is the target of position i, so both tensors are cut the
    same way and no target crosses a chunk boundary). Returns (b, N/sp) input_ids and labels and
    (1, N/sp) int64 global layer-0 positions (pass them to the model's ``positions=``).
    Identity (plus ``arange`` positions) when sp == 1.
    """
    input_ids, labels = batch["input_ids"], batch["labels"]
    if input_ids.shape != labels.shape:
        raise ValueError(f"batch input_ids {tuple(input_ids.shape)} and labels "
                         f"{tuple(labels.shape)} differ in shape")
    chunk = sequence_chunk(input_ids.shape[1], grid)
    positions = torch.arange(chunk.start, chunk.stop, device=input_ids.device)[None]
    return input_ids[:, chunk], labels[:, chunk], positions


@torch.no_grad()
def sequence_parallel_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                           grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation at a length that need not fit one rank: (loss_sum, num_tokens) of the FULL
    (b, N) sequences, summed over the SP group (identical on every SP/TP rank).

    Every rank of the SP group must call it with the same full sequences (cut here), so the
    activations held per rank are N/sp long. ``model`` is the parallelized module (or a
    DeepSpeed engine's ``.module``).
    """
    ids, lab, pos = shard_batch({"input_ids": input_ids, "labels": labels}, grid)
    out = model(ids, labels=lab, positions=pos)
    totals = torch.stack((out.loss_sum.double(), out.num_tokens.double()))
    sp_group = grid.groups.sp if grid.groups is not None else None
    if group_size(sp_group) > 1:
        dist.all_reduce(totals, group=sp_group)
    return totals[0], totals[1].long()


class SequenceParallelEvalModel:
    """Adapter for evaluation code written against ``model(input_ids, labels=labels)`` on full
    sequences (``tape_train.eval.perplexity``): every rank of an SP group calls it with the same
    (b, N) windows; they are right-padded to a multiple of sp with ignored labels (exact for a
    causal model: no real position attends to a pad), cut over the SP group, and the returned
    ``loss_sum`` / ``num_tokens`` are the SP-summed totals of the full windows.
    """

    def __init__(self, model, grid) -> None:
        self.model, self.grid = model, grid

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        pad = (-input_ids.shape[1]) % self.grid.sp
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
            labels = torch.nn.functional.pad(labels, (0, pad), value=-100)
        loss_sum, num_tokens = sequence_parallel_loss(self.model, input_ids, labels, self.grid)
        return SimpleNamespace(loss_sum=loss_sum, num_tokens=num_tokens, logits=None)

    def eval(self):
        self.model.eval()
        return self

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    @property
    def training(self) -> bool:
        return self.model.training

    def parameters(self):
        return self.model.parameters()
