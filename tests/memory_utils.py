"""Peak memory of a real training run on CPU, measured inside the run's process.

``measure_rank(overrides, steps, run_dir)`` is the body of one rank (under
``distributed.run_distributed_test``): it sets up the trainer and runs ``steps`` steps, and
returns its resident memory growth since torch, DeepSpeed and the process group were up: the
kernel's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident
size at the reset. Used by tests/test_preflight_memory.py and benchmarks/memory_estimate.py.
"""

from __future__ import annotations


def rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure_rank(overrides: list[str], steps: int, run_dir: str) -> dict:
    """One rank: set up the trainer, run ``steps`` steps, return the peak growth (bytes)."""
    import deepspeed  # noqa: F401 - imported before the baseline: runtime, not the run
    import torch  # noqa: F401

    from tape_train.config import load_run_config
    from tape_train.train import distributed as tdist
    from tape_train.train.loop import Trainer

    cfg = load_run_config(None, [*overrides, f"train.run_dir={run_dir}",
                                 f"train.max_steps={steps}"])
    tdist.init_distributed("cpu")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current resident size
    baseline = rss_bytes()
    trainer = Trainer(cfg)
    trainer.setup()
    for _ in range(steps):
        trainer.train_step()
    peak = high_water_bytes()
    trainer.close()
    return {"baseline": baseline, "peak": peak, "growth": peak - baseline}
