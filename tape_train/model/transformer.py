"""The decoder: Llama blocks whose positional encoding is chosen by ``ModelConfig.pe``.

For an encoding that carries a state (``spec.carries_state``: TAPE's E = (E⁰, E¹), spec §2)
every block but the last also updates it; for every other encoding the block is a plain
Llama block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tape_train.model.attention import Attention
from tape_train.model.cache import KVCache
from tape_train.model.config import ModelConfig
from tape_train.model.layers import RMSNorm, SwiGLU
from tape_train.model.lm_head import IGNORE_INDEX, LMHead
from tape_train.model.pe import build_positional_encoding
# Where positional-encoding parameters live: the shared encoding module (``pe.*``: FIRE's MLP,
# T5's table) and each block's state update (``layers.<i>.pos_update.*``: TAPE's W_pa, W_x,
# W_up, W_dn). Spec §6: no weight decay on them.
SHARED_PE_MODULE, STATE_UPDATE_MODULE = "pe", "pos_update"


def is_positional_parameter(name: str) -> bool:
    """Whether parameter ``name`` (as ``TransformerLM.named_parameters`` spells it) belongs
    to the positional encoding."""
    parts = name.split(".")
    return parts[0] == SHARED_PE_MODULE or STATE_UPDATE_MODULE in parts


@dataclass
class ModelOutput:
    """logits (b, N, V), None where the call had labels and did not ask for them (the loss is
    then computed in token chunks without them: ``tape_train.model.lm_head``); with labels:
    ``loss_sum`` (sum of token NLL over labels ≠ −100, fp32) and ``num_tokens`` (count of
    those labels). ``states``: per-layer input (E⁰, E¹) when requested (state-carrying
    encodings only; the last block's input state is the last entry)."""

    logits: torch.Tensor | None
    loss_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    states: list | None = None

    @property
    def loss(self) -> torch.Tensor:
        """Token-mean loss of this call (the trainer normalises globally instead)."""
        return self.loss_sum / self.num_tokens.clamp(min=1)


class DecoderBlock(nn.Module):
    """One Llama block. ``carries_state`` blocks also update the encoding's state E with their
    own ``pos_update`` module (``pe.state_update()``); the last block does not (its E would be
    discarded, spec §2), so it has no positional parameters and attends with the plain value."""

    def __init__(self, cfg: ModelConfig, pe, carries_state: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, pe)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.pos_update = pe.state_update() if carries_state else None

    def forward(self, x, ctx, cache=None, state=None):
        """x (b, N, C); state (E⁰, E¹) each (b|1, M, N, D), or None for stateless encodings.

        Returns (x, state): the new state, or None after the last block.
        """
        attn_out, e_hat = self.attn(self.attn_norm(x), ctx, cache, state,
                                    need_e_hat=self.pos_update is not None)
        x = x + attn_out
        y = self.mlp(self.mlp_norm(x))
        if self.pos_update is not None:
            state = self.pos_update(state, e_hat, y)
        else:
            state = None
        return x + y, state


class TransformerLM(nn.Module):
    """Decoder-only language model.

    ``forward(input_ids (b, N), labels=None, positions=None, cache=None) -> ModelOutput``;
    with ``labels`` the logits are returned only if ``return_logits`` (the loss never needs
    them whole).
    ``positions``: layer-0 positions (b|1, N); default ``cache.length + arange(N)`` (RandPE
    and TAPE's ``train_offset`` sample them in training mode).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pe = build_positional_encoding(cfg)
        state_layers = self.pe.spec.state_layers(cfg.num_layers)
        self.layers = nn.ModuleList(
            DecoderBlock(cfg, self.pe, carries_state=i < state_layers)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Spec §2: every Linear/Embedding weight N(0, init_std); then each positional module
        its own init (TAPE's W_up, W_pa zero)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, LMHead)):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.pe.reset_parameters()
        for layer in self.layers:
            if layer.pos_update is not None:
                layer.pos_update.reset_parameters()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache: KVCache | None = None,
                return_states: bool = False, return_logits: bool = False) -> ModelOutput:
        b, n = input_ids.shape
        offset = 0 if cache is None else cache.length
        if positions is None:
            positions = self.pe.layer0_positions(b, n, offset, input_ids.device)
        k_pos = positions
        if cache is not None:
            k_pos = positions if cache.positions is None else torch.cat(
                (cache.positions.expand(positions.shape[0], -1), positions), dim=-1)
            cache.positions = k_pos
        x = self.embed(input_ids)
        ctx = self.pe.context(positions, k_pos, x.dtype)
        state = self.pe.initial_state(positions, x.dtype)
        states = [] if return_states else None
        for i, layer in enumerate(self.layers):
            if states is not None:
                states.append(state)
            x, state = layer(x, ctx, None if cache is None else cache.layers[i], state)
        h = self.norm(x)
        logits = self.lm_head(h) if labels is None or return_logits else None
        out = ModelOutput(logits=logits, states=states)
        if labels is not None:
            out.loss_sum = self.lm_head(h, labels)
            out.num_tokens = (labels != IGNORE_INDEX).sum()
        return out

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed.weight.numel()
            if not self.cfg.tie_embeddings:
                total -= self.lm_head.weight.numel()
        return total

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """KV-cache decoding; see :func:`tape_train.model.generate.generate`."""
        from tape_train.model.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)
