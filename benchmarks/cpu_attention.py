"""Attention-core speed on CPU: TAPE's one-softmax attention on each backend vs RoPE's call.

    python benchmarks/cpu_attention.py                    # fp32 and bf16, N = 512, 1024, 2048
    python benchmarks/cpu_attention.py --dtypes bfloat16 --seq-lens 2048 --reps 5

Forward+backward of the attention core alone (no projections, no modulation), 12 heads,
D = 64, a fixed number of tokens per call (batch = tokens // N), q/k/v laid out as the model
makes them (token-major projections viewed head-major). Variants, measured side by side
(interleaved repetitions, best of):
- ``rope_sdpa``: PyTorch SDPA with D-wide q, k, v (what RoPE runs on CPU in fp32);
- ``rope_blocked``: the same on the blocked backend (what ``auto`` picks for RoPE in bf16);
- ``tape_padded_sdpa``: TAPE through SDPA, q̃/k̃ zero-padded to the 3D-wide value
  (``attn_backend=sdpa``);
- ``tape_blocked``: TAPE on the blocked backend (``auto`` on CPU).
Printed as time relative to ``rope_sdpa``; the FLOP model says TAPE costs 2× RoPE (12U vs 6U).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tape_train.model.attention import sdpa_attention
from tape_train.model.blocked_attention import blocked_attention
from tape_train.host_memory import keep_freed_memory


def _inputs(batch, n, heads, d, dv, dtype, gen):
    def make(width):
        t = torch.randn(batch, n, heads, width, generator=gen).to(dtype)
        return t.transpose(1, 2).requires_grad_()
    return make(d), make(d), make(dv)


def _fwd_bwd(fn, q, k, v) -> float:
    start = time.perf_counter()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def measure(dtype, n, tokens, heads, d, reps) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    batch = max(1, tokens // n)
    plain = _inputs(batch, n, heads, d, d, dtype, gen)
    wide = _inputs(batch, n, heads, d, 3 * d, dtype, gen)
    variants = {
        "rope_sdpa": (sdpa_attention, plain),
        "rope_blocked": (blocked_attention, plain),
        "tape_padded_sdpa": (sdpa_attention, wide),
        "tape_blocked": (blocked_attention, wide),
    }
    best = {name: float("inf") for name in variants}
    for rep in range(reps + 1):  # the first round warms up
        for name, (fn, args) in variants.items():
            t = _fwd_bwd(fn, *args)
            if rep:
                best[name] = min(best[name], t)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[512, 1024, 2048])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per call")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    keep_freed_memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.heads} heads, "
          f"D={args.head_dim}, {args.tokens} tokens per call; time relative to rope_sdpa")
    names = ("rope_sdpa", "rope_blocked", "tape_padded_sdpa", "tape_blocked")
    print(f"{'dtype':<9} {'N':>5} {'rope_sdpa ms':>13} " + " ".join(f"{n:>17}" for n in names[1:]))
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for n in args.seq_lens:
            best = measure(dtype, n, args.tokens, args.heads, args.head_dim, args.reps)
            base = best["rope_sdpa"]
            print(f"{dtype_name:<9} {n:>5} {1e3 * base:13.1f} "
                  + " ".join(f"{best[name] / base:16.2f}x" for name in names[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
