"""A clean-room fp64 NumPy model of the TAPE LM, for tests/test_model_cleanroom.py.

Written from the spec (../shared/TAPE.md §1-§2) and the user-facing docs only (docs/model.md,
"What an export holds"), without reading tape_train/model: it takes an export's weights (names
and layouts as stored in model.safetensors) and its config.json, and uses no torch.
"""

from __future__ import annotations

import numpy as np

# config.json of `tape-export --hf` spells the same fields the Hugging Face way
HF_KEYS = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
           "rms_norm_eps": "norm_eps", "rotary_theta": "rope_theta",
           "tie_word_embeddings": "tie_embeddings"}


def native_config(config: dict) -> dict:
    """The fields the reference reads, from either export's config.json."""
    return {HF_KEYS.get(k, k): v for k, v in config.items()}


def rms_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x):
    return x / (1.0 + np.exp(-x))


def rotate_half(x):
    """rot(x) = [−x[B:], x[:B]] (spec §1)."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def layer0_state(positions, heads, head_dim, theta):
    """E⁰[m, n, j] = cos(n·ω_{j mod B}), E¹ = sin(…), ω_β = θ^(−2β/D); the same for every
    head."""
    omega = theta ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * np.tile(omega, 2)[None, :]
    return (np.repeat(np.cos(angle)[None], heads, axis=0),
            np.repeat(np.sin(angle)[None], heads, axis=0))             # each (M, N, D)


def causal_softmax(logits):
    n = logits.shape[-1]
    logits = np.where(np.tril(np.ones((n, n), dtype=bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def forward(weights: dict, config: dict, ids, positions=None) -> np.ndarray:
    """Logits (N, V) of one sequence ``ids`` (N,). ``weights``: export name → array;
    ``positions``: the layer-0 positions, 0..N−1 unless given."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    cfg = native_config(config)
    heads, eps = cfg["num_heads"], cfg["norm_eps"]
    n = len(ids)
    dim = cfg["hidden_size"] // heads
    e0, e1 = layer0_state(np.arange(n) if positions is None else positions, heads, dim,
                          cfg["rope_theta"])
    x = w["embed.weight"][np.asarray(ids)]                             # (N, C)

    def split_heads(t):                                               # (N, C) → (M, N, D)
        return t.reshape(n, heads, dim).transpose(1, 0, 2)

    for i in range(cfg["num_layers"]):
        p = f"layers.{i}."
        linear = lambda t, name: t @ w[p + name].T                    # noqa: E731 (out, in)
        carries_state = p + "pos_update.w_pa" in w                    # all blocks but the last
        # attention sublayer: one softmax over q̃·k̃ᵀ/√D gives O = A·v and Ê = A·E
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q, k, v = (split_heads(linear(h, f"attn.{c}_proj.weight")) for c in "qkv")
        q_mod = q * e0 + rotate_half(q) * e1
        k_mod = k * e0 + rotate_half(k) * e1
        attn = causal_softmax(q_mod @ k_mod.transpose(0, 2, 1) / np.sqrt(dim))
        out = (attn @ v).transpose(1, 0, 2).reshape(n, heads * dim)
        x = x + linear(out, "attn.o_proj.weight")
        if carries_state:                                             # E_m += Σ_k W_pa[m, k]·Ê_k
            w_pa = w[p + "pos_update.w_pa"]
            if cfg["tape_post_attn"] == "rowsum":
                w_pa = np.diag(w_pa.sum(axis=1))
            e0 = e0 + np.einsum("mk,knd->mnd", w_pa, attn @ e0)
            e1 = e1 + np.einsum("mk,knd->mnd", w_pa, attn @ e1)
        # MLP sublayer: SwiGLU, then the gate g = silu(y·W_x) from its output
        h2 = rms_norm(x, w[p + "mlp_norm.weight"], eps)
        y = linear(silu(linear(h2, "mlp.gate_proj.weight")) * linear(h2, "mlp.up_proj.weight"),
                   "mlp.down_proj.weight")
        if carries_state:                                             # E_n += K_n·E_n
            g = silu(linear(y, "pos_update.w_x.weight"))              # (N, P)
            k_n = np.einsum("mp,np,pk->nmk", w[p + "pos_update.w_dn"], g,
                            w[p + "pos_update.w_up"])                 # (N, M, M)
            e0 = e0 + np.einsum("nmk,knd->mnd", k_n, e0)
            e1 = e1 + np.einsum("nmk,knd->mnd", k_n, e1)
        x = x + y
    head = w["embed.weight"] if cfg["tie_embeddings"] else w["lm_head.weight"]
    return rms_norm(x, w["norm.weight"], eps) @ head.T
