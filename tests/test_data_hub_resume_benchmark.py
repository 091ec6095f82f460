"""benchmarks/hub_resume.py end to end on a small local Parquet corpus streamed through
`datasets`: every resume it measures is exact, and reads well under one file (row groups)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a child process that imports torch and datasets (~10 s on 2 busy cores)
def test_hub_resume_benchmark_resumes_exactly_within_a_row_group(tmp_path):
    report = tmp_path / "hub.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hub_resume.py"),
                           "--formats", "parquet", "--files", "2", "--row-groups", "8",
                           "--rows", "200", "--window", "32", "--repeats", "1", "--seq-len",
                           "64", "--batch", "2", "--work", str(tmp_path), "--out", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    file_bytes = data["corpus"]["bytes"]["parquet"] / 2
    (result,) = data["results"]
    assert result["shards"] == 16  # one per row group
    for position in result["resume"].values():
        assert position["exact"], position
        # One row group (1/8 of a file) plus footers: file shards read the whole file here.
        assert position["bytes_read"] < 0.5 * file_bytes, (position, file_bytes)
