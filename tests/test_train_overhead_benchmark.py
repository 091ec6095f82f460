"""``benchmarks/train_overhead.py`` end to end on a shrunken model: it runs, reports every
variant, and compares like with like (each variant runs with the ``F.linear`` it would have in
a process of its own; DeepSpeed's ZeRO-3 can swap it process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_overhead_reports_every_variant_like_with_like(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_overhead.py"), "--model", "tiny",
         "--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--stages", "1", "3",
         "--rounds", "1", "--steps", "1", "--warmup", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "zero1", "zero3"}
    assert all(r["step_s"] > 0 and len(r["samples"]) == 1 for r in rows.values())
    assert rows["plain"]["ratio"] == 1.0
    # On CPU the trainer's ZeRO-3 keeps torch's linear (memory_efficient_linear off), so no
    # variant runs DeepSpeed's process-wide replacement.
    assert {n: r["linear"] for n, r in rows.items()} == {
        "plain": "native", "zero1": "native", "zero3": "native"}


def test_cpu_zero_settings_and_cuda_keeps_deepspeeds_defaults():
    from tape_train.config import load_run_config
    from tape_train.train.engine import deepspeed_config

    cfg = load_run_config(None, ["model=tiny", "parallel.zero_stage=3"])
    assert deepspeed_config(cfg, "cpu")["zero_optimization"]["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in deepspeed_config(cfg, "cuda")["zero_optimization"]
    for stage in (1, 2):
        cfg = load_run_config(None, ["model=tiny", f"parallel.zero_stage={stage}"])
        assert deepspeed_config(cfg, "cpu")["zero_optimization"]["contiguous_gradients"] is False
        assert "contiguous_gradients" not in deepspeed_config(cfg, "cuda")["zero_optimization"]
