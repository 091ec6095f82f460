"""What a positional encoding *is*, declared once and importable without torch.

Every question the rest of the code asks about an encoding — does it carry a per-layer state,
how wide is the attention value, may it use GQA or flash-attn, can it be sequence-parallel,
which training FLOPs does it add, how does it export — is answered by its
:class:`EncodingSpec` (the registry entry in ``tape_train.model.pe``), never by comparing
``cfg.pe`` with a name. The config validates with it before torch is imported; the
``nn.Module`` classes, the FLOP model and ``tape_train.parallel`` read the same object.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


def _no_count(cfg) -> int:
    return 0


def _no_micro_batch_flops(cfg, seq_len: int) -> float:
    return 0.0


@dataclass(frozen=True)
class EncodingSpec:
    """Capabilities of one positional encoding.

    Attributes:
        name: the ``model.pe`` value.
        implementation: ``"module:Class"`` of its ``PositionalEncoding`` subclass (imported
            lazily, so this spec needs no torch).
        summary: one line for ``--help`` and the docs.
        rotary: rotates query/key channel pairs (needs an even head dim; the KV cache stores
            rotated keys).
        carries_state: a positional state E flows through the blocks and every block but the
            last updates it with a per-layer module (``PositionalEncoding.state_update()``);
            under TP that state is cut to the local heads around attention.
        value_width: width of the attention value in head dims (TAPE attends [v | E⁰ | E¹]: 3).
            A value wider than 1 cannot run on flash-attn and is what the fused kernel is for.
        dense_bias: adds a (b, H, Nq, Nk) logit bias. Such a bias is built for the local
            sequence chunk only, so the encoding cannot be sequence-parallel.
        flash_bias: flash-attn computes that bias natively (ALiBi's slopes).
        gqa: fewer key/value heads than query heads are allowed.
        random_positions: training positions are random per process: ``True`` always, or the
            name of the ``ModelConfig`` flag that turns it on. Ranks sharing a sequence (sp/tp)
            would draw different ones, so this forbids sp·tp > 1.
        hf_architecture: the Hugging Face ``transformers`` architecture with identical math
            (``tape-export --hf``), or None (native export only).
        state_params: parameters of one block's state-update module, from the config.
        state_flops: forward FLOPs per token of one block's state update (weight products).
        shared_params: parameters of the model-level encoding module (FIRE's MLP, T5's table).
        micro_batch_flops: forward FLOPs of the model-level encoding module per micro-batch at
            sequence length N, ``(cfg, seq_len)``: work done once and shared by the
            micro-batch's sequences (FIRE's MLP over the N×N distances), so per token it
            depends on the micro-batch size.
    """

    name: str
    implementation: str
    summary: str
    rotary: bool = False
    carries_state: bool = False
    value_width: int = 1
    dense_bias: bool = False
    flash_bias: bool = False
    gqa: bool = True
    random_positions: bool | str = False
    hf_architecture: str | None = None
    state_params: Callable[..., int] = _no_count
    state_flops: Callable[..., float] = _no_count
    shared_params: Callable[..., int] = _no_count
    micro_batch_flops: Callable[..., float] = _no_micro_batch_flops

    @property
    def flash_ok(self) -> bool:
        """flash-attn can run every block of this encoding (the value is plain and any bias
        is one flash-attn computes itself)."""
        return self.value_width == 1 and (not self.dense_bias or self.flash_bias)

    @property
    def sequence_parallel(self) -> bool:
        return not self.dense_bias

    def draws_random_positions(self, cfg) -> bool:
        """Whether training positions are sampled per process under ``cfg`` (a ModelConfig)."""
        if isinstance(self.random_positions, str):
            return bool(getattr(cfg, self.random_positions))
        return self.random_positions

    def state_layers(self, num_layers: int) -> int:
        """Blocks that update the state: all but the last (its updated E would be discarded)."""
        return num_layers - 1 if self.carries_state else 0

    def load(self) -> type:
        """The ``PositionalEncoding`` subclass implementing this encoding (imports torch)."""
        module, _, cls = self.implementation.partition(":")
        return getattr(importlib.import_module(module), cls)
