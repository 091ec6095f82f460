"""Data pipeline throughput, measured side by side in one run (never pass/fail).

Three rates on the same text, on one core (``torch.set_num_threads(1)``, prefetch off so the
pipeline's own work is timed):

1. raw sentencepiece ``encode`` of every document (the floor: tokenisation alone);
2. the full pipeline: read JSONL.zst → parse → shuffle windows → tokenise → wrap BOS/EOS →
   pack into ``seq_len + 1`` blocks → int64 tensors (``build_train_loader``);
3. training consumption of the ``tiny`` model (forward + backward + AdamW step) at the same
   ``seq_len``, in tokens/s — what the loader must outpace.

Rates are tokens per CPU-second of this process (robust to a shared machine). Prints the
pipeline's overhead over raw ``encode`` (target ≤ 20 %) and its margin over
training (target ≥ 10×). Usage::

    python benchmarks/data_throughput.py [--data data/demo] [--tokenizer data/demo/tokenizer.model]
                                         [--megabytes 8] [--seq-len 256] [--repeats 3]

Without --data/--tokenizer it uses real text shipped with Python and trains an 8k tokenizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tape_train.data import DataConfig, build_train_loader, load_tokenizer  # noqa: E402
from tape_train.data.formats import SkipLog, read_documents, resolve_local_shards  # noqa: E402
from tape_train.data.config import SourceConfig  # noqa: E402
from tape_train.data.tokenizer import TokenizerTrainSpec, train_tokenizer  # noqa: E402
from tape_train.data.testing import real_text_documents, write_jsonl  # noqa: E402


def load_texts(data: str | None, megabytes: float) -> list[str]:
    if data:
        source = SourceConfig(path=data, key="--data")
        texts, total = [], 0
        for shard in resolve_local_shards(source):
            for _, text in read_documents(shard, 0, "text", False, SkipLog()):
                texts.append(text)
                total += len(text.encode())
                if total >= megabytes * 1e6:
                    return texts
        return texts
    base = real_text_documents()
    texts, total, i = [], 0, 0
    while total < megabytes * 1e6:  # repeat the stdlib text, tagged so no two are identical
        text = f"[{i}] {base[i % len(base)]}"
        texts.append(text)
        total += len(text.encode())
        i += 1
    return texts


# CPU time of this process, not wall time: the machine may be shared, and with prefetch off
# and one torch thread all the work is on this thread, so CPU seconds are what a core spends.
clock = time.process_time


def raw_encode_rate(tok, texts) -> tuple[float, int]:
    start = clock()
    n = sum(len(tok.encode(t)) + 2 for t in texts)  # +2: BOS/EOS the pipeline adds
    return n / (clock() - start), n


def pipeline_rate(cfg: DataConfig, tok, seq_len: int, batch: int, n_tokens: int) -> float:
    loader = build_train_loader(cfg, tok, seq_len=seq_len, micro_batch_size=batch)
    per_batch = batch * (seq_len + 1)
    n_batches = max(1, n_tokens // per_batch)
    start = clock()
    for _ in range(n_batches):
        next(loader)
    elapsed = clock() - start
    loader.close()
    return n_batches * per_batch / elapsed


def training_rate(vocab_size: int, seq_len: int, batch: int, steps: int) -> float | None:
    try:
        from tape_train.model import TransformerLM, load_model_config
    except ImportError as exc:
        print(f"(tiny model not importable: {exc}; training rate not measured)")
        return None
    torch.manual_seed(0)
    model = TransformerLM(load_model_config("tiny", vocab_size=vocab_size,
                                            max_seq_len=max(seq_len, 256)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, vocab_size, (batch, seq_len))

    def step() -> None:
        out = model(x, labels=x)
        (out.loss_sum / out.num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    start = clock()
    for _ in range(steps):
        step()
    return steps * batch * seq_len / (clock() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="prepared directory or files (default: stdlib text)")
    parser.add_argument("--tokenizer", help=".model file (default: train 8k BPE on the text)")
    parser.add_argument("--megabytes", type=float, default=8.0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    texts = load_texts(args.data, args.megabytes)
    n_bytes = sum(len(t.encode()) for t in texts)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
        else:
            tok = train_tokenizer(texts, tmp / "bench",
                                  TokenizerTrainSpec(vocab_size=8000, num_threads=1))
        corpus = write_jsonl(tmp / "corpus" / "bench.jsonl", texts)
        import zstandard
        zst = corpus.with_suffix(".jsonl.zst")
        zst.write_bytes(zstandard.ZstdCompressor(level=3).compress(corpus.read_bytes()))
        corpus.unlink()
        cfg = DataConfig(sources=[str(zst)], prefetch=0, shuffle_buffer=1024)
        raw, pipe = [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both alike
            rate, n_tokens = raw_encode_rate(tok, texts)
            raw.append(rate)
            pipe.append(pipeline_rate(cfg, tok, args.seq_len, args.batch, n_tokens))
    raw_rate, pipe_rate = statistics.median(raw), statistics.median(pipe)
    pair_overheads = [r / p - 1.0 for r, p in zip(raw, pipe)]
    train = training_rate(tok.vocab_size, args.seq_len, args.batch, args.train_steps)
    # Median of the paired ratios: each pair ran back to back, so a drift of the machine's
    # speed between repetitions cancels (the ratio of the two medians does not).
    overhead = statistics.median(pair_overheads)
    print(f"text: {len(texts)} documents, {n_bytes / 1e6:.1f} MB; tokenizer vocab "
          f"{tok.vocab_size}; seq_len {args.seq_len}; batch {args.batch}; 1 thread")
    print(f"raw sentencepiece encode : {raw_rate / 1e3:9.1f} k tokens/s per core "
          f"({n_bytes / (n_tokens / raw_rate) / 1e6:.2f} MB/s)")
    print(f"full pipeline (no prefetch): {pipe_rate / 1e3:7.1f} k tokens/s per core")
    print(f"pipeline overhead over raw encode: {100 * overhead:+.1f} %  (median of the "
          f"back-to-back pairs; target <= 20 %; "
          f"per repeat: {', '.join(f'{100 * o:+.1f}' for o in pair_overheads)})")
    result = {"raw_tokens_per_s": raw_rate, "pipeline_tokens_per_s": pipe_rate,
              "overhead": overhead, "raw_runs": raw, "pipeline_runs": pipe}
    if train is not None:
        print(f"tiny model training      : {train / 1e3:9.2f} k tokens/s (1 thread)")
        print(f"pipeline / training      : {pipe_rate / train:9.1f} x  (target >= 10 x)")
        result.update(train_tokens_per_s=train, pipeline_over_training=pipe_rate / train)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
