"""The one FLOP model of the project: parameter counts and training FLOPs per token.

Counted analytically (the DeepSpeed profiler is wrong under ZeRO-3). Conventions:
- A matmul of an (m × k) by a (k × n) matrix costs 2·m·k·n FLOPs; training = forward +
  backward = 3× the forward for every weight matmul (the usual 6·params per token).
- Attention core in the spec's units: U = one causal N×N×C product = N²·C FLOPs per sequence
  per layer, i.e. N·C per token. ``recompute=False`` (model FLOPs, used for MFU) counts what
  an attention that stores P would do: RoPE-family 2U forward + 4U backward = 6U, TAPE 4U + 8U
  = 12U (the value is 3D wide). ``recompute=True`` counts FlashAttention-2 style kernels that
  recompute P in the backward (spec §4 table: 7U vs 13U; three separate calls: 21U).
- TAPE's positional updates (W_pa mixing, K_n formation and application, W_x) are counted;
  elementwise work (modulation, norms, softmax) is not, by convention.
"""

from __future__ import annotations

import argparse

from tape_train.model.config import POSITIONAL_ENCODINGS, ModelConfig, load_model_config


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group (must equal the model's ``numel`` sums)."""
    c, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    m, mkv, p = cfg.num_heads, cfg.num_kv_heads, cfg.tape_position_size
    attention = c * m * d + 2 * c * mkv * d + m * d * c
    mlp = 3 * c * f
    norms = 2 * c
    # TAPE's last block has no positional update (its E would be discarded).
    tape_layers = cfg.num_layers - 1 if cfg.pe == "tape" else 0
    tape = m * m + 2 * p * m + c * p
    per_layer = attention + mlp + norms
    shared_pe = {
        "fire": (1 * cfg.fire_hidden + cfg.fire_hidden) + (cfg.fire_hidden * m + m) + 2,
        "t5": cfg.t5_num_buckets * m,
    }.get(cfg.pe, 0)
    embedding = cfg.vocab_size * c
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * c
    total = embedding + head + cfg.num_layers * per_layer + tape_layers * tape + c + shared_pe
    return {
        "total": total,
        "embedding": embedding,
        "lm_head": head,
        "non_embedding": total - embedding - head,
        "positional": tape_layers * tape + shared_pe,
    }


def attention_units(pe: str, recompute: bool = False, separate_calls: bool = False) -> int:
    """Training cost of the attention core per layer in units U (see module docstring)."""
    if pe != "tape":
        return 7 if recompute else 6
    if separate_calls:
        return 21  # three FlashAttention-2 calls, each 7U
    return 13 if recompute else 12


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: bool = False) -> float:
    """Forward FLOPs per token (weight matmuls + causal attention core + TAPE updates)."""
    return training_flops_per_token(cfg, seq_len, recompute) / 3.0


def training_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: bool = False,
                             separate_calls: bool = False) -> float:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len``.

    This is the number MFU divides by: MFU = tokens/s · this / peak FLOP/s.
    """
    c, d = cfg.hidden_size, cfg.head_dim
    m, mkv, p, f = cfg.num_heads, cfg.num_kv_heads, cfg.tape_position_size, cfg.intermediate_size
    weights = c * m * d + 2 * c * mkv * d + m * d * c + 3 * c * f
    per_layer = 6.0 * weights
    # Attention core: U per token = N·C (causal half of 2·N²·C per sequence, over N tokens).
    unit = seq_len * c
    total = cfg.num_layers * (per_layer + attention_units("rope", recompute) * unit)
    if cfg.pe == "tape":
        # Every block but the last attends with the 3D-wide value and updates E.
        state_layers = cfg.num_layers - 1
        extra_attention = (attention_units("tape", recompute, separate_calls)
                           - attention_units("rope", recompute)) * unit
        w_x = 2 * c * p
        w_pa = 2 * (2 * m * m * d)           # two tables, (M×M)·(M×D) per token
        k_form = 2 * m * m * p               # K_n = W_dn·diag(g)·W_up
        k_apply = 2 * (2 * m * m * d)        # two tables
        total += state_layers * (extra_attention + 3.0 * (w_x + w_pa + k_form + k_apply))
    return total + 6.0 * c * cfg.vocab_size


def describe(cfg: ModelConfig, seq_len: int) -> str:
    counts = count_parameters(cfg)
    flops = training_flops_per_token(cfg, seq_len)
    return (f"{cfg.name:>6} pe={cfg.pe:<6} params {counts['total'] / 1e6:9.2f}M "
            f"(non-embedding {counts['non_embedding'] / 1e6:8.2f}M, positional "
            f"{counts['positional'] / 1e3:8.1f}k)  train FLOPs/token @N={seq_len}: "
            f"{flops / 1e9:8.3f} GFLOP")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tape-model info",
                                     description="Parameter counts and training FLOPs per token.")
    parser.add_argument("sizes", nargs="*", default=["tiny", "125m", "350m", "1b", "7b"],
                        help="named sizes (configs/model/*.yaml) or YAML paths")
    parser.add_argument("--pe", nargs="*", default=["tape", "rope"], choices=POSITIONAL_ENCODINGS)
    parser.add_argument("--seq-len", type=int, nargs="*", default=[1024])
    args = parser.parse_args(argv)
    for size in args.sizes:
        for seq_len in args.seq_len:
            flops = {}
            for pe in args.pe:
                cfg = load_model_config(size, pe=pe)
                flops[pe] = training_flops_per_token(cfg, seq_len)
                print(describe(cfg, seq_len))
            if "tape" in flops and "rope" in flops:
                print(f"{'':>6} TAPE/RoPE training FLOPs at N={seq_len}: "
                      f"{flops['tape'] / flops['rope']:.3f}")
    return 0
