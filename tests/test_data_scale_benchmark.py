"""benchmarks/data_scale.py end to end on a tiny prepared corpus: every rank reads within the
target, per-epoch reads shrink with n, and every resume it measures is exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tape_train.data import cli as data_cli
from tape_train.data.testing import real_text_documents, train_small_tokenizer, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # four child processes that import torch (~15 s on 2 busy cores)
def test_data_scale_benchmark_runs_and_meets_its_byte_target(tmp_path):
    tok = train_small_tokenizer(tmp_path / "tok")
    texts = [f"[{i}] {t}" for i, t in enumerate(real_text_documents(400))]
    write_jsonl(tmp_path / "in" / "a.jsonl", texts)
    out = tmp_path / "corpus"
    assert data_cli.main(["prepare", "--input", str(tmp_path / "in"), "--out", str(out),
                          "--num-shards", "8", "--tokenize", "--tokenizer", tok.path]) == 0
    report = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data_scale.py"),
                           "--data", str(out), "--tokenizer", tok.path, "--ranks", "1", "4",
                           "--paths", "tokens", "text", "--seq-len", "64", "--batch", "2",
                           "--max-seconds", "1", "--out", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {(r["path"], r["n"]): r for r in json.loads(report.read_text())["results"]}
    assert set(results) == {(p, n) for p in ("tokens", "text") for n in (1, 4)}
    for r in results.values():
        assert 0 < r["bytes_read_per_epoch"] <= r["target_bytes"], r
        assert all(v["exact"] for v in r["resume"].values()), r
    for path in ("tokens", "text"):  # a quarter of the ranks' share: well under half the bytes
        assert results[(path, 4)]["bytes_read_per_epoch"] < \
            0.5 * results[(path, 1)]["bytes_read_per_epoch"]
