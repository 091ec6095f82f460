"""Weight-name mapping between our RoPE/NoPE decoder and Hugging Face ``LlamaForCausalLM``.

Used by the RoPE parity test and by export. ``transformers`` is imported lazily: it is a
test/export dependency, not a training one.
"""

from __future__ import annotations

import re

import torch

from tape_train.model.config import ModelConfig

# ours → Hugging Face, per decoder layer
_LAYER_NAMES = {
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def llama_encodings() -> list[str]:
    """The ``model.pe`` values whose decoder is exactly a Hugging Face Llama."""
    from tape_train.model.pe import ENCODINGS

    return [n for n, s in ENCODINGS.items() if s.hf_architecture == "LlamaForCausalLM"]


def llama_config_dict(cfg: ModelConfig) -> dict:
    """config.json of the ``LlamaForCausalLM`` of the same shape (encodings whose decoder is a Llama: RoPE)."""
    if cfg.encoding.hf_architecture != "LlamaForCausalLM":
        raise ValueError(f"pe={cfg.pe!r} has no Hugging Face Llama equivalent; encodings that "
                         f"have one: {llama_encodings()}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std,
    }


def hf_llama_config(cfg: ModelConfig):
    """The ``transformers.LlamaConfig`` of the same shape (RoPE only)."""
    from transformers import LlamaConfig

    data = llama_config_dict(cfg)
    for key in ("architectures", "model_type"):
        data.pop(key)
    return LlamaConfig(**data)


def to_hf_llama_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our state dict to ``LlamaForCausalLM``'s names (tensors are shared, not copied)."""
    out = {}
    for name, tensor in state.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = tensor
            continue
        match = _LAYER_RE.fullmatch(name)
        if match is None or match.group(2) not in _LAYER_NAMES:
            raise KeyError(f"parameter {name!r} has no Llama equivalent")
        out[f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"] = tensor
    return out


def from_hf_llama_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_llama_state_dict`."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    out = {}
    for name, tensor in state.items():
        if name in top:
            out[top[name]] = tensor
            continue
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match is None or match.group(2) not in layer:
            raise KeyError(f"Hugging Face parameter {name!r} has no equivalent here")
        out[f"layers.{match.group(1)}.{layer[match.group(2)]}"] = tensor
    return out
