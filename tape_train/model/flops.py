"""The one FLOP model of the project: parameter counts and training FLOPs per token.

Counted analytically (the DeepSpeed profiler is wrong under ZeRO-3). Conventions:
- A matmul of an (m × k) by a (k × n) matrix costs 2·m·k·n FLOPs; training = forward +
  backward = 3× the forward for every weight matmul (the usual 6·params per token).
- Attention core in the spec's units: U = one causal N×N×C product = N²·C FLOPs per sequence
  per layer, i.e. N·C per token. ``recompute=False`` (model FLOPs, used for MFU) counts what
  an attention that stores P would do: with a value w head dims wide, QKᵀ 1U + PV wU forward
  and twice that backward, so RoPE-family (w = 1) 6U, TAPE (w = 3, [v | E⁰ | E¹]) 4U + 8U =
  12U. ``recompute=True`` counts FlashAttention-2 style kernels that recompute P in the
  backward (+1U; spec §4 table: 7U vs 13U; w separate calls: 7wU = 21U).
- Each encoding's own parameters and per-block state-update FLOPs come from its
  ``EncodingSpec`` (TAPE: W_pa mixing — not with ``tape_post_attn: rowsum``, a per-head
  scale —, K_n formation and application, W_x); elementwise work (modulation, norms, softmax,
  the loss) is not counted, by convention; nor is what activation checkpointing recomputes,
  nor the W_pa product TAPE's update recomputes in its backward instead of keeping E'
  (``state_update_recompute_flops``; model FLOPs, not hardware FLOPs).
- Work an encoding does once per micro-batch, shared by its b sequences, is counted per token
  as its share, so the count per token takes the micro-batch size: FIRE's bias MLP
  (1 → h → M over the N×N distances, ``EncodingSpec.micro_batch_flops``) costs
  6·N²·h·(M+1) training FLOPs per micro-batch, 6·N·h·(M+1)/b per token (125m, N=1024, b=1:
  0.3 % of the total). Every caller passes the micro-batch its tokens are computed in
  (``train.micro_batch_size`` for a run).
- ``tests/test_flop_count.py`` checks all of it against ``FlopCounterMode`` on one real step.
"""

from __future__ import annotations

import argparse
import sys

from tape_train.model.config import POSITIONAL_ENCODINGS, ModelConfig, load_model_config
from tape_train.model.pe import encoding_spec


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group (must equal the model's ``numel`` sums)."""
    c, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    m, mkv = cfg.num_heads, cfg.num_kv_heads
    spec = cfg.encoding
    attention = c * m * d + 2 * c * mkv * d + m * d * c
    mlp = 3 * c * f
    norms = 2 * c
    per_layer = attention + mlp + norms
    # The last block has no state update (its E would be discarded): state_layers = L − 1.
    positional = (spec.state_layers(cfg.num_layers) * spec.state_params(cfg)
                  + spec.shared_params(cfg))
    embedding = cfg.vocab_size * c
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * c
    total = embedding + head + cfg.num_layers * per_layer + positional + c
    return {
        "total": total,
        "embedding": embedding,
        "lm_head": head,
        "non_embedding": total - embedding - head,
        "positional": positional,
    }


def attention_units(pe: str, recompute: bool = False, separate_calls: bool = False,
                    value_width: int | None = None) -> int:
    """Training cost of the attention core per layer in units U (see module docstring).

    ``value_width`` overrides the encoding's (1 for a block that attends with the plain value).
    """
    w = encoding_spec(pe).value_width if value_width is None else value_width
    if separate_calls and w > 1:
        return 7 * w  # one FlashAttention-2 call per head-dim-wide slice of the value, each 7U
    forward = 1 + w                                   # QKᵀ, then P·V over a w·D-wide value
    return 3 * forward + (1 if recompute else 0)      # backward = 2 × forward (+ QKᵀ again)


def state_update_recompute_flops(cfg: ModelConfig) -> float:
    """FLOPs per token and state-carrying block that TAPE's update does again in its backward
    (``tape_train.model.pe.tape_update``: E' = E + W_pa·Ê for both tables, rather than keeping
    E'): hardware FLOPs a real step counts, not model FLOPs (MFU leaves them out)."""
    if not cfg.encoding.carries_state or cfg.tape_post_attn != "headmix":
        return 0.0
    return 2 * (2 * cfg.num_heads ** 2 * cfg.head_dim)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: bool = False, *,
                            micro_batch: int) -> float:
    """Forward FLOPs per token (weight matmuls + causal attention core + TAPE updates + the
    token's share of per-micro-batch work such as FIRE's MLP)."""
    return training_flops_per_token(cfg, seq_len, recompute, micro_batch=micro_batch) / 3.0


def training_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: bool = False,
                             separate_calls: bool = False, *, micro_batch: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len`` with
    ``micro_batch`` sequences per forward/backward (``train.micro_batch_size``).

    This is the number MFU multiplies tokens/s by: MFU = tokens/s · this / peak FLOP/s.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1 sequence, got {micro_batch!r}")
    c, d = cfg.hidden_size, cfg.head_dim
    m, mkv, f = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    spec = cfg.encoding
    weights = c * m * d + 2 * c * mkv * d + m * d * c + 3 * c * f
    per_layer = 6.0 * weights
    # Attention core: U per token = N·C (causal half of 2·N²·C per sequence, over N tokens).
    unit = seq_len * c
    plain = attention_units(cfg.pe, recompute, value_width=1)
    total = cfg.num_layers * (per_layer + plain * unit)
    state_layers = spec.state_layers(cfg.num_layers)
    if state_layers:
        # Every block but the last attends with the encoding's wide value and updates E.
        extra_attention = (attention_units(cfg.pe, recompute, separate_calls) - plain) * unit
        total += state_layers * (extra_attention + 3.0 * spec.state_flops(cfg))
    # Done once per micro-batch of b·N tokens (FIRE's MLP): each token's share.
    shared = 3.0 * spec.micro_batch_flops(cfg, seq_len) / (micro_batch * seq_len)
    return total + shared + 6.0 * c * cfg.vocab_size


def describe(cfg: ModelConfig, seq_len: int, micro_batch: int = 1) -> str:
    counts = count_parameters(cfg)
    flops = training_flops_per_token(cfg, seq_len, micro_batch=micro_batch)
    # The micro-batch is named only where it changes the count (FIRE's per-micro-batch MLP).
    batch = f", b={micro_batch}" if cfg.encoding.micro_batch_flops(cfg, seq_len) else ""
    return (f"{cfg.name:>6} pe={cfg.pe:<6} params {counts['total'] / 1e6:9.2f}M "
            f"(non-embedding {counts['non_embedding'] / 1e6:8.2f}M, positional "
            f"{counts['positional'] / 1e3:8.1f}k)  train FLOPs/token @N={seq_len}{batch}: "
            f"{flops / 1e9:8.3f} GFLOP")


DEFAULT_ENCODINGS = ("tape", "rope")  # what `tape-model info` compares unless --pe says


def _positive(what: str):
    def parse(value: str) -> int:
        if not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"expected a positive number of {what}, got "
                                             f"{value!r}")
        return int(value)
    return parse



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tape-model info",
                                     description="Parameter counts and training FLOPs per token.")
    parser.add_argument("sizes", nargs="*", default=["tiny", "125m", "350m", "1b", "7b"],
                        help="named sizes (configs/model/*.yaml) or YAML paths (default: "
                             "tiny 125m 350m 1b 7b)")
    parser.add_argument("--pe", nargs="+", default=None, choices=POSITIONAL_ENCODINGS,
                        help="positional encodings to compare (default: "
                             f"{' '.join(DEFAULT_ENCODINGS)}; a YAML file's own pe is not used)")
    parser.add_argument("--seq-len", type=_positive("tokens"), nargs="+", default=[1024],
                        help="sequence lengths of the FLOP count (default: 1024)")
    parser.add_argument("--micro-batch", type=_positive("sequences"), default=1,
                        help="sequences per forward/backward (train.micro_batch_size): FIRE's "
                             "bias MLP is computed once per micro-batch, so its share per token "
                             "depends on it (default: 1)")
    args = parser.parse_args(argv)
    for size in args.sizes:
        for seq_len in args.seq_len:
            flops = {}
            for pe in args.pe or DEFAULT_ENCODINGS:
                try:
                    cfg = load_model_config(size, pe=pe)
                except (OSError, ValueError) as exc:  # a missing or invalid size: one line
                    message = str(exc)
                    if size not in message:  # a shape the encoding refuses: which file, which pe
                        message = f"{size} with pe={pe}: {message}"
                        if args.pe is None:
                            message += (f" (pe={pe} is one of the defaults: name the encodings "
                                        "to compare with --pe)")
                    print(f"tape-model: error: {message}", file=sys.stderr)
                    return 1
                flops[pe] = training_flops_per_token(cfg, seq_len, micro_batch=args.micro_batch)
                print(describe(cfg, seq_len, args.micro_batch))
            if "tape" in flops and "rope" in flops:
                print(f"{'':>6} TAPE/RoPE training FLOPs at N={seq_len}: "
                      f"{flops['tape'] / flops['rope']:.3f}")
    return 0
