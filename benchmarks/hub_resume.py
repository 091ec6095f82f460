"""Hub streams: what a resume inside a file costs, per format and code tree (never pass/fail).

A local corpus stands in for the Hub (no network needed): ``--files`` Parquet files of
``--row-groups`` row groups × ``--rows`` rows of real text, and the same rows as as many
``.jsonl.gz`` files, streamed through ``datasets`` exactly as a Hub source is
(``{hub: parquet|json, data_files: ...}``). For each code tree (this one, and
``--baseline-src``: e.g. the tree before row-group shards,
``git archive <commit> tape_train | tar -x -C /tmp/base``) and format, a fresh child process:

1. builds the text loader of rank 0 of 1 (shuffle off, so the stream is the files' rows in
   order under either sharding; windows of ``--window`` documents; prefetch off) and reads
   its document stream without tokenising to three positions, keeping the stream state
   there. A resume re-reads the window holding its position from the window's start, so each
   position is one document into the window that starts nearest 1 / 50 / 99 % of the
   *second* file;
2. for each position, ``--repeats`` times: builds a new loader, loads that state and produces
   the first batch. Timed (wall clock) and counted in bytes read (``rchar`` of
   ``/proc/self/io``, see ``data_scale.py``: everything the process asked the OS for, page
   cache hits included). The batch is checked against the documents that follow the
   position, tokenised and packed. Building the loader alone (open the dataset, split it
   into shards: with row-group shards this reads every file's footer) is reported apart.

Usage::

    python benchmarks/hub_resume.py [--baseline-src /tmp/base] [--files 4] [--row-groups 8]
                                    [--rows 1000] [--window 256] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from data_scale import parse_or_run_child, rchar  # noqa: E402

POSITIONS = (1, 50, 99)  # percent of the second file


def corpus_rows(count: int) -> list[str]:
    """``count`` distinct documents of real text (numbered paragraphs of the stdlib)."""
    sys.path.insert(0, str(REPO))
    from tape_train.data.testing import real_text_documents

    base = real_text_documents()
    return [f"[{i}] {base[i % len(base)]}" for i in range(count)]


def write_corpus_files(directory: Path, files: int, row_groups: int, rows: int) -> dict:
    """The Parquet and JSONL.gz files; returns their data_files globs and sizes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    per_file = row_groups * rows
    texts = corpus_rows(files * per_file)
    for sub in ("parquet", "json"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    for f in range(files):
        part = texts[f * per_file:(f + 1) * per_file]
        pq.write_table(pa.table({"text": part, "id": list(range(len(part)))}),
                       directory / "parquet" / f"part-{f:03d}.parquet", row_group_size=rows)
        with gzip.open(directory / "json" / f"part-{f:03d}.jsonl.gz", "wt",
                       encoding="utf-8") as fh:
            fh.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(part))
    sizes = {kind: sum(p.stat().st_size for p in (directory / kind).iterdir())
             for kind in ("parquet", "json")}
    return {"parquet": str(directory / "parquet" / "*.parquet"),
            "json": str(directory / "json" / "*.jsonl.gz"), "bytes": sizes,
            "text_bytes": sum(len(t.encode()) for t in texts), "rows_per_file": per_file}


def child(args: argparse.Namespace) -> dict:
    sys.path.insert(0, args.src)
    import torch

    torch.set_num_threads(1)
    from tape_train.data import DataConfig, build_train_loader, load_tokenizer
    from tape_train.data.packing import wrap_document

    tok = load_tokenizer(args.tokenizer)
    cfg = DataConfig(sources=[{"hub": args.format, "data_files": args.data_files}],
                     tokenizer=args.tokenizer, shuffle=False, shuffle_buffer=args.window,
                     prefetch=0)
    kw = dict(seq_len=args.seq_len, micro_batch_size=args.batch, dp_rank=0, dp_size=1, seed=0)
    block = args.seq_len + 1
    # The stream state at each position, and the documents that follow it (no tokenising).
    reader = build_train_loader(cfg, tok, **kw)
    stream, targets = reader._stream, {}
    rows, window = args.rows_per_file, args.window
    for pct in POSITIONS:
        # A resume re-reads the window holding the position from the window's start: put
        # that start at ~pct % of the second file (inside it), the position one document on.
        w = round(rows * (1 + pct / 100) / window)
        w = min(max(w, -(-rows // window)), (2 * rows - 1) // window)
        g = w * window + 1
        while stream.g < g:
            stream.next_document()
        state = json.loads(json.dumps(stream.state()))
        tokens: list[int] = []  # the documents from the position on, as the batch packs them
        while len(tokens) < args.batch * block:
            tokens += wrap_document(tok.encode(stream.next_document()), tok.bos_id, tok.eos_id)
        saved = reader.state_dict()
        saved["position"] = {"stream": state, "offset": 0, "blocks": 0}
        targets[pct] = (json.loads(json.dumps(saved)),
                        [tokens[i * block:i * block + args.seq_len] for i in range(args.batch)])
    result = {"format": args.format, "src": args.src, "build": [], "resume": {}}
    for pct, (saved, rows) in targets.items():
        runs = []
        for _ in range(args.repeats):
            read0, t0 = rchar(), time.perf_counter()
            loader = build_train_loader(cfg, tok, **kw)
            built, read_built = time.perf_counter() - t0, rchar() - read0
            loader.load_state_dict(saved)
            batch = next(loader)
            runs.append({"seconds": time.perf_counter() - t0, "bytes_read": rchar() - read0,
                         "exact": batch["input_ids"].tolist() == rows})
            result["build"].append({"seconds": built, "bytes_read": read_built})
            loader.close()
        result["resume"][pct] = {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "bytes_read": statistics.median(r["bytes_read"] for r in runs),
            "exact": all(r["exact"] for r in runs),
            "window_start_record": saved["position"]["stream"]["g"] - 1 - args.rows_per_file}
    result["shards"] = len(reader._stream.cursors[0].all_shards)
    reader.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", default=None,
                        help="a source tree whose tape_train is 'before' (its rows first)")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--row-groups", type=int, default=8, help="row groups per file")
    parser.add_argument("--rows", type=int, default=1000, help="rows per row group")
    parser.add_argument("--window", type=int, default=256,
                        help="data.shuffle_buffer: a resume also re-reads one window of this "
                             "many documents from its start, in any format")
    parser.add_argument("--formats", nargs="+", default=["parquet", "json"])
    parser.add_argument("--tokenizer", default=None,
                        help="sentencepiece model (default: a small one trained on the fly)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=None, help="where the corpus is written (temp dir)")
    args = parse_or_run_child(parser, child, {"--format": str, "--data-files": str,
                                              "--rows-per-file": int})
    if args is None:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        corpus = write_corpus_files(work / "corpus", args.files, args.row_groups, args.rows)
        tokenizer = args.tokenizer
        if tokenizer is None:
            from tape_train.data.testing import train_small_tokenizer

            tokenizer = train_small_tokenizer(work / "tok").path
        print(f"corpus: {args.files} files × {args.row_groups} row groups × {args.rows} rows, "
              f"{corpus['text_bytes'] / 1e6:.1f} MB of text; Parquet "
              f"{corpus['bytes']['parquet'] / 1e6:.1f} MB, JSONL.gz "
              f"{corpus['bytes']['json'] / 1e6:.1f} MB", flush=True)
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1"}
        results = []
        trees = ([("before", args.baseline_src)] if args.baseline_src else []) + \
            [("after", str(REPO))]
        for fmt in args.formats:
            for label, src in trees:
                cmd = [sys.executable, __file__, "--child", "--format", fmt, "--data-files",
                       corpus[fmt], "--rows-per-file", str(corpus["rows_per_file"]),
                       "--src", src, "--tokenizer", tokenizer, "--seq-len", str(args.seq_len),
                       "--batch", str(args.batch), "--repeats", str(args.repeats),
                       "--window", str(args.window)]
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      env={**env, "PYTHONPATH": src})
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                result["code"] = label
                results.append(result)
                build = statistics.median(b["seconds"] for b in result["build"])
                build_mb = statistics.median(b["bytes_read"] for b in result["build"]) / 1e6
                r = result["resume"]
                print(f"{fmt:8s} {label:6s} {result['shards']:4d} shards; build {build * 1e3:.0f} "
                      f"ms {build_mb:.2f} MB; resume at records " + "/".join(
                          str(r[p]["window_start_record"]) for p in map(str, POSITIONS))
                      + f" of {corpus['rows_per_file']} in a file: " + " / ".join(
                          f"{r[p]['seconds'] * 1e3:.0f} ms {r[p]['bytes_read'] / 1e6:.2f} MB"
                          f"{'' if r[p]['exact'] else ' NOT EXACT'}"
                          for p in map(str, POSITIONS)), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"corpus": corpus, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
