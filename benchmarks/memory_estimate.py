"""The dry run's memory estimate against the measured peak of real training runs (CPU, gloo).

    python benchmarks/memory_estimate.py [--cases tiny-z0,tiny-z3,...] [--steps 3] [--out FILE]

Every case trains a few steps on synthetic data in fresh processes (``world`` ranks on gloo);
each rank measures its peak resident memory *growth*: the kernel's high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` once torch, DeepSpeed and the process
group are up) minus the resident memory at that moment (``tests/memory_utils.py``). That is
compared with the estimate's
total without its runtime constant (``tape_train.train.memory``). The printed Markdown table
is the one in docs/training.md ("Preflight"). Nothing is asserted; tests/test_preflight_memory.py
holds a small case to a tolerance. All cases take about 25 min on 2 busy cores; `125m-z3-dp2`
needs about 14 GiB of free RAM.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

GIB = 2**30
# name: (world size, overrides)
CASES = {
    "tiny-z0": (1, ["model.base=tiny", "parallel.zero_stage=0"]),
    "tiny-z1": (1, ["model.base=tiny", "parallel.zero_stage=1"]),
    "tiny-z3": (1, ["model.base=tiny", "parallel.zero_stage=3"]),
    "tiny-z0-bf16": (1, ["model.base=tiny", "parallel.zero_stage=0", "train.dtype=bf16"]),
    "tiny-z3-ac": (1, ["model.base=tiny", "parallel.zero_stage=3",
                       "train.activation_checkpointing=true"]),
    "tiny-z3-dp2": (2, ["model.base=tiny", "parallel.zero_stage=3"]),
    "tiny-z1-tp2": (2, ["model.base=tiny", "parallel.zero_stage=1", "parallel.tp=2"]),
    "tiny-z1-sp2": (2, ["model.base=tiny", "parallel.zero_stage=1", "parallel.sp=2"]),
    "125m-z0": (1, ["model.base=125m", "parallel.zero_stage=0", "train.micro_batch_size=2"]),
    "125m-z1": (1, ["model.base=125m", "parallel.zero_stage=1", "train.micro_batch_size=2"]),
    "125m-z3": (1, ["model.base=125m", "parallel.zero_stage=3", "train.micro_batch_size=2"]),
    "125m-z1-bf16": (1, ["model.base=125m", "parallel.zero_stage=1", "train.dtype=bf16",
                         "train.micro_batch_size=2"]),
    "125m-z3-ac-512": (1, ["model.base=125m", "parallel.zero_stage=3", "train.seq_len=512",
                           "train.micro_batch_size=4", "train.activation_checkpointing=true"]),
    "125m-z1-rope": (1, ["model.base=125m", "model.pe=rope", "parallel.zero_stage=1",
                         "train.micro_batch_size=4"]),
    "125m-z3-dp2": (2, ["model.base=125m", "parallel.zero_stage=3", "train.micro_batch_size=1"]),
}
# The cases CPU_DEEPSPEED_COPIES and CPU_STARTUP_GROWTH_BYTES were fitted to; the others test it.
FITTED = ("tiny-z0", "125m-z0", "125m-z1", "125m-z3")
COMMON = ["train.seq_len=256", "train.micro_batch_size=8", "train.dtype=fp32",
          "train.synthetic_data=true", "eval.interval=0", "logging.tensorboard=false",
          "logging.progress_bar=false", "logging.peak_tflops=1.0", "train.device=cpu",
          "checkpoint.interval=1000000"]


def run_case(name: str, steps: int) -> dict:
    from distributed import run_distributed_test
    from memory_utils import measure_rank

    from tape_train.config import load_run_config
    from tape_train.train.memory import CPU_RUNTIME_BYTES, estimate_memory

    world, overrides = CASES[name]
    overrides = [*COMMON, *overrides]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_distributed_test(measure_rank, world_size=world, args=(overrides, steps, tmp),
                                     timeout=1200)
    cfg = load_run_config(None, overrides)
    est = estimate_memory(cfg, world, device_type="cpu")
    estimate = est.total_bytes - CPU_RUNTIME_BYTES
    growth = max(r["growth"] for r in ranks)
    return {"case": name, "world": world, "overrides": overrides[len(COMMON):],
            "estimate_gib": estimate / GIB, "measured_gib": growth / GIB,
            "ratio": estimate / growth, "baseline_gib": max(r["baseline"] for r in ranks) / GIB,
            "parts_gib": {k: v / GIB for k, v in est.parts.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON lines")
    args = p.parse_args(argv)
    rows = []
    print("| case | ranks | estimate (GiB) | measured growth (GiB) | estimate / measured | |")
    print("|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        row = run_case(name, args.steps)
        rows.append(row)
        print(f"| {name} | {row['world']} | {row['estimate_gib']:.3f} | "
              f"{row['measured_gib']:.3f} | {row['ratio']:.2f} | "
              f"{'fitted' if name in FITTED else 'held out'} |", flush=True)
        if args.out:
            with args.out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
