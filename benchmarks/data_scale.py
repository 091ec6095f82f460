"""Data loading at scale: one process simulating rank r of n (never pass/fail).

For n in 1, 8, 64, 512, 4096 and each data path, a fresh child process builds the loader of
rank ``n - 1`` of ``n`` on a local multi-shard prepared corpus and measures:

* **bytes read** per epoch of the rank's share, in steady state: epoch 0 runs first,
  unmeasured (lazy imports, start-up); then whole epochs are measured — enough for >= 200
  batches, or those that end within ``--max-seconds`` — and the count is divided by the
  epochs passed. The counter is the kernel's ``rchar`` in ``/proc/self/io``: every byte
  returned by read/pread syscalls of the process, page-cache hits included, so it is what the
  process *asked the OS for*, independent of what happened to be cached (``read_bytes`` counts
  only what reached the block device: ~0 on a warm cache, and it needs root to drop caches,
  which would disturb everything else on a shared machine). The corpus readers use read/pread,
  not mmap, so nothing escapes ``rchar``.
* **tokens/s per rank** delivered over those epochs (wall clock, one thread, prefetch off);
* **resume latency** at 1 %, 50 % and 99 % of the measured span: a new loader is built,
  restored from the state saved there, and the first batch is produced (and checked equal to
  the batch the uninterrupted run got there), plus the bytes read for it.

Paths: ``text`` (``data.format: text``, ``sharding: documents``; this code), ``text-today``
(the same on the code of ``--baseline-src``, e.g. the tree before shard-level reading:
``git archive <commit> tape_train | tar -x -C /tmp/base``) and ``tokens``
(``data.format: tokens``, the same directory prepared with ``--tokenize``). Usage::

    python benchmarks/data_scale.py --data DIR --tokenizer MODEL [--baseline-src /tmp/base]
                                    [--ranks 1 8 64 512 4096] [--seq-len 512] [--batch 4]

The corpus is ``DIR``'s training split (``tape-data prepare --demo --tokenize ...``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def _digest(batch) -> str:
    return hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]


def child(args: argparse.Namespace) -> dict:
    """Measure one (path, n) in this process; returns the figures as a dict."""
    sys.path.insert(0, args.src)
    import torch

    torch.set_num_threads(1)
    import pyarrow.parquet  # noqa: F401  (imports read files: keep them out of the counter)
    import zstandard  # noqa: F401

    from tape_train.data import DataConfig, build_train_loader, load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    extra = {"format": "tokens"} if args.path == "tokens" else {}
    cfg = DataConfig(sources=[args.data], tokenizer=args.tokenizer, prefetch=0, **extra)
    n, rank = args.n, args.n - 1
    kw = dict(seq_len=args.seq_len, micro_batch_size=args.batch, dp_rank=rank, dp_size=n,
              seed=0)
    loader = build_train_loader(cfg, tok, **kw)
    warmup = 0
    while loader.epochs[0] < 1:  # epoch 0: lazy imports, first-window start-up
        next(loader)
        warmup += 1
    # Measure whole epochs of this rank's share in steady state: enough of them for >= 200
    # batches (at large n one batch can span several epochs of a tiny share), but stop at the
    # first epoch boundary after --max-seconds.
    start_epoch = loader.epochs[0]
    span = max(1, -(-200 // warmup))
    states, digests = [loader.state_dict()], []
    tokens = 0
    read0, t0 = rchar(), time.perf_counter()
    while loader.epochs[0] < start_epoch + span and not (
            loader.epochs[0] > start_epoch and time.perf_counter() - t0 > args.max_seconds):
        batch = next(loader)
        tokens += batch["input_ids"].numel()
        digests.append(_digest(batch))
        states.append(loader.state_dict())
    seconds = time.perf_counter() - t0
    epochs = loader.epochs[0] - start_epoch
    result = {"path": args.path, "n": n, "rank": rank, "batches": len(digests),
              "epochs": epochs, "tokens": tokens, "seconds": seconds,
              "bytes_read_per_epoch": (rchar() - read0) / epochs,
              "tokens_per_s": tokens / seconds, "resume": {}}
    for pct in (1, 50, 99):
        k = min(len(digests) - 1, len(digests) * pct // 100)
        read0, t0 = rchar(), time.perf_counter()
        resumed = build_train_loader(cfg, tok, **kw)
        resumed.load_state_dict(json.loads(json.dumps(states[k])))
        batch = next(resumed)
        latency = time.perf_counter() - t0
        result["resume"][pct] = {"batch": k, "seconds": latency,
                                 "bytes_read": rchar() - read0,
                                 "exact": _digest(batch) == digests[k]}
        resumed.close()
    loader.close()
    return result


def parse_or_run_child(parser: argparse.ArgumentParser, child, hidden: dict):
    """Parse the command line of a benchmark that measures in child processes of itself: adds
    ``--out`` and the hidden ``--child``/``--src`` (the source tree measured) and ``hidden``
    (option: type); in a child, runs ``child(args)``, prints its JSON result and returns
    None."""
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for option, kind in hidden.items():
        parser.add_argument(option, type=kind, help=argparse.SUPPRESS)
    parser.add_argument("--src", default=str(REPO), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:
        return args
    print(json.dumps(child(args)))
    return None


def corpus_bytes(data: Path) -> dict:
    manifest = json.loads((data / "manifest.json").read_text())
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    out = {"text": sum(s["file_bytes"] for s in train),
           "text_shard": max(s["file_bytes"] for s in train), "shards": len(train)}
    if manifest.get("tokens"):
        shards = manifest["tokens"]["shards"]
        out["tokens"] = sum(s["file_bytes"] for s in shards)
        out["tokens_shard"] = max(s["file_bytes"] for s in shards)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="prepared directory (with --tokenize)")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--baseline-src", default=None,
                        help="a source tree whose tape_train is 'today' (text-today rows)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--paths", nargs="+", default=["tokens", "text", "text-today"])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-seconds", type=float, default=15.0,
                        help="end a measurement at the first epoch boundary after this")
    args = parse_or_run_child(parser, child, {"--path": str, "--n": int})
    if args is None:
        return 0
    sizes = corpus_bytes(Path(args.data))
    results = []
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    for path in args.paths:
        if path == "text-today" and not args.baseline_src:
            continue
        src = args.baseline_src if path == "text-today" else str(REPO)
        for n in args.ranks:
            cmd = [sys.executable, __file__, "--child", "--path",
                   "text" if path == "text-today" else path, "--n", str(n), "--src", src,
                   "--data", args.data, "--tokenizer", args.tokenizer,
                   "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                   "--max-seconds", str(args.max_seconds)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={
                **env, "PYTHONPATH": src})
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            result["path"] = path
            kind = "tokens" if path == "tokens" else "text"
            result["target_bytes"] = 1.2 * sizes[kind] / n + sizes[f"{kind}_shard"]
            results.append(result)
            r = result["resume"]
            print(f"{path:10s} n={n:5d} read {result['bytes_read_per_epoch'] / 1e6:9.3f} MB/epoch "
                  f"(target ≤ {result['target_bytes'] / 1e6:7.3f}) "
                  f"{result['tokens_per_s'] / 1e3:9.1f} k tok/s over {result['epochs']} epoch(s); "
                  f"resume 1/50/99 %: " + " / ".join(
                      f"{r[p]['seconds'] * 1e3:.0f} ms {r[p]['bytes_read'] / 1e6:.2f} MB"
                      f"{'' if r[p]['exact'] else ' NOT EXACT'}" for p in ("1", "50", "99")),
                  flush=True)
    print(json.dumps({"corpus": sizes, "seq_len": args.seq_len, "batch": args.batch}))
    if args.out:
        Path(args.out).write_text(json.dumps({"corpus": sizes, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
