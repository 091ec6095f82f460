"""Pre-tokenised loader: a weighted mixture of sources against the single stream (never
pass/fail).

Both loaders (``data.format: tokens``) run side by side in one process on one core
(``torch.set_num_threads(1)``), in interleaved repeats: each repeat builds the loader fresh
and calls ``next()`` for ``--seconds`` of CPU time; the rate is tokens delivered per CPU-second
of this process (robust to other jobs on a shared machine), and the median over repeats is
reported. Also measured: the shares of the samples the mixture delivered (against the
normalised weights) and the cost of locating one sample (mixture slot + per-source block) by
itself, far into the stream. Usage::

    python benchmarks/token_mixture.py --tokenizer MODEL --single DIR \\
        --mix A:5 B:3 C:2 [--seq-len 512] [--batch 4] [--seconds 3] [--repeats 5]

``DIR``, ``A``, ``B``, ``C`` are directories of ``tape-data prepare --tokenize``; a ``:WEIGHT``
suffix sets a source's weight (default 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tape_train.data import DataConfig, build_train_loader, load_tokenizer  # noqa: E402


def source_spec(text: str) -> dict:
    """``DIR`` or ``DIR:WEIGHT`` -> a ``data.sources`` entry."""
    path, sep, weight = text.rpartition(":")
    if not sep or not weight.replace(".", "", 1).isdigit():
        return {"path": text}
    return {"path": path, "weight": float(weight)}


def rate(cfg: DataConfig, tok, args) -> tuple[float, object]:
    """Tokens per CPU-second of ``next()`` on a fresh loader, and the loader."""
    loader = build_train_loader(cfg, tok, seq_len=args.seq_len, micro_batch_size=args.batch,
                                dp_rank=args.rank, dp_size=args.ranks, seed=0)
    next(loader)  # open the shard files
    tokens, started = 0, time.process_time()
    while time.process_time() - started < args.seconds:
        tokens += next(loader)["input_ids"].numel()
    return tokens / (time.process_time() - started), loader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--single", required=True, help="prepared directory: the one stream")
    parser.add_argument("--mix", nargs="+", required=True, help="DIR[:WEIGHT] of each source")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0, help="CPU seconds per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(args.tokenizer)
    configs = {
        "single": DataConfig(sources=[args.single], tokenizer=args.tokenizer, format="tokens"),
        "mixture": DataConfig(sources=[source_spec(s) for s in args.mix],
                              tokenizer=args.tokenizer, format="tokens"),
    }
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        for name, cfg in configs.items():
            value, loader = rate(cfg, tok, args)
            rates[name].append(value)
            if name == "mixture" and repeat == args.repeats - 1:
                delivered = loader.samples
                weights = np.array([s.weight for s in cfg.sources])
                sources, _ = loader.locate(np.arange(delivered))
                shares = np.bincount(sources, minlength=len(weights)) / delivered
                far = np.arange(10**12, 10**12 + 4096)
                started = time.process_time()
                loader.locate(far)
                locate_us = (time.process_time() - started) / len(far) * 1e6
            loader.close()
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{name} {rates[name][-1] / 1e6:.2f} M tok/s" for name in configs), flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    result = {"seq_len": args.seq_len, "batch": args.batch, "rank": args.rank,
              "ranks": args.ranks, "tokens_per_cpu_s": medians, "repeats": rates,
              "mixture_over_single": medians["mixture"] / medians["single"],
              "samples_delivered": int(delivered), "weights": weights.tolist(),
              "target_shares": (weights / weights.sum()).tolist(), "shares": shares.tolist(),
              "locate_us_per_sample": locate_us}
    print(f"single {medians['single'] / 1e6:.2f} M tok/s, mixture "
          f"{medians['mixture'] / 1e6:.2f} M tok/s ({result['mixture_over_single']:.2f}×); "
          f"shares over {delivered} samples " + " / ".join(f"{s:.4f}" for s in shares) +
          " (target " + " / ".join(f"{s:.4f}" for s in result["target_shares"]) +
          f"); locating one sample at 10^12: {locate_us:.1f} µs")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
