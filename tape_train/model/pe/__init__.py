"""Positional encodings, one small module each (spec §2 and §5), and their registry.

``ENCODINGS`` is the one place an encoding is declared: its :class:`EncodingSpec` names the
``PositionalEncoding`` subclass that implements it and states its capabilities. This package
imports no torch until a class is asked for, so the config can validate against it.

Adding an encoding: write ``pe/<name>.py`` with a ``PositionalEncoding`` subclass, add one
``EncodingSpec`` here, add its tests (docs/model.md walks through it).
"""

from __future__ import annotations

from tape_train.model.pe.spec import EncodingSpec


def _tape_state_params(cfg) -> int:
    m, p = cfg.num_heads, cfg.tape_position_size
    return m * m + 2 * p * m + cfg.hidden_size * p          # W_pa, W_up + W_dn, W_x


def _tape_state_flops(cfg) -> float:
    m, p, d = cfg.num_heads, cfg.tape_position_size, cfg.head_dim
    w_x = 2 * cfg.hidden_size * p
    # Two tables, (M×M)·(M×D) per token; `rowsum` scales each head by one number instead (an
    # elementwise product: not counted).
    w_pa = 2 * (2 * m * m * d) if cfg.tape_post_attn == "headmix" else 0
    k_form = 2 * m * m * p               # K_n = W_dn·diag(g)·W_up
    k_apply = 2 * (2 * m * m * d)        # two tables
    return w_x + w_pa + k_form + k_apply


def _fire_params(cfg) -> int:
    h, m = cfg.fire_hidden, cfg.num_heads
    return (h + h) + (h * m + m) + 2                         # MLP 1→h→M, c and L


def _fire_micro_batch_flops(cfg, seq_len: int) -> float:
    # The MLP 1→h→M on every (i, j) of the N×N distances, full square (not the causal half),
    # once per micro-batch: the positions are (1, N), shared by its sequences.
    return 2.0 * seq_len * seq_len * cfg.fire_hidden * (1 + cfg.num_heads)


ENCODINGS: dict[str, EncodingSpec] = {spec.name: spec for spec in (
    EncodingSpec("tape", "tape_train.model.pe.tape:TapeEncoding",
                 "TAPE: a per-head positional state E updated by every block (spec §2)",
                 rotary=True, carries_state=True, value_width=3, gqa=False,
                 random_positions="tape_train_offset",
                 state_params=_tape_state_params, state_flops=_tape_state_flops),
    EncodingSpec("rope", "tape_train.model.pe.rope:RoPE", "rotary position embedding",
                 rotary=True, hf_architecture="LlamaForCausalLM"),
    EncodingSpec("nope", "tape_train.model.pe.nope:NoPE", "no positional signal"),
    EncodingSpec("alibi", "tape_train.model.pe.alibi:ALiBi", "linear distance bias per head",
                 dense_bias=True, flash_bias=True),
    EncodingSpec("randpe", "tape_train.model.pe.rope:RandPE",
                 "RoPE at randomly sampled training positions", rotary=True,
                 random_positions=True),
    EncodingSpec("fire", "tape_train.model.pe.fire:FIRE", "learned MLP bias of log distance",
                 dense_bias=True, shared_params=_fire_params,
                 micro_batch_flops=_fire_micro_batch_flops),
    EncodingSpec("xpos", "tape_train.model.pe.xpos:XPos", "RoPE with a length decay",
                 rotary=True),
    EncodingSpec("t5", "tape_train.model.pe.t5:T5Bias", "bucketed relative bias table",
                 dense_bias=True, shared_params=lambda cfg: cfg.t5_num_buckets * cfg.num_heads),
)}


def encoding_spec(name: str) -> EncodingSpec:
    """The spec of ``model.pe=name`` (``KeyError`` for an unknown name; the config has
    already rejected those with a clear message)."""
    return ENCODINGS[name]


def build_positional_encoding(cfg):
    """The model-level ``PositionalEncoding`` module of ``cfg.pe`` (imports torch)."""
    return ENCODINGS[cfg.pe].load()(cfg)


_LAZY = {"PositionalEncoding": "base", "PositionContext": "base", "TapeStateUpdate": "tape"}


def __getattr__(name: str):
    # Torch-backed names on first use only, so ``import tape_train.model.pe`` stays torch-free.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENCODINGS", "EncodingSpec", "PositionContext", "PositionalEncoding",
           "TapeStateUpdate", "build_positional_encoding", "encoding_spec"]
