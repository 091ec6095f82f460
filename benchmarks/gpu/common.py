"""Shared pieces of the GPU report: the time budget, timing, relative errors, device facts."""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch


class OutOfTime(Exception):
    """A section's time budget ran out; what was measured so far is kept."""


@dataclass
class Budget:
    """Seconds a section may spend, never past the global deadline (``time.monotonic``)."""

    seconds: float
    deadline: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return min(self.start + self.seconds, self.deadline) - time.monotonic()

    def check(self, what: str) -> None:
        """Raise ``OutOfTime`` before starting ``what`` when no time is left."""
        if self.left() <= 0:
            raise OutOfTime(f"time budget spent before {what}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()``: CUDA events around each call on a GPU, else wall time."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ in fp64; inf when ``got`` holds a non-finite value."""
    got, ref = got.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    denom = float(ref.norm())
    return float((got - ref).norm()) / (denom if denom > 0 else 1.0)


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the report's folder name)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def device_facts(device: torch.device) -> dict:
    """Name, versions and (on a GPU) capability, memory and datasheet dense bf16 peak."""
    import triton

    facts = {"device": str(device), "torch": torch.__version__, "triton": triton.__version__,
             "python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    try:
        import deepspeed

        facts["deepspeed"] = deepspeed.__version__
    except ImportError:
        facts["deepspeed"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(name=props.name, capability=f"{props.major}.{props.minor}",
                     sm_count=props.multi_processor_count,
                     memory_gib=round(props.total_memory / 2**30, 1),
                     cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        # The trainer's table (tape_train.train.peak), so the report's MFU is the run's.
        from tape_train.train.peak import gpu_table_peak

        facts["bf16_peak_tflops"] = gpu_table_peak(props.name, torch.bfloat16, tf32=False)
    else:
        facts.update(name=f"CPU ({facts['cpu']})", bf16_peak_tflops=None)
    return facts


def measure_matmul_tflops(device: torch.device, size: int, reps: int) -> float:
    """bf16 square-GEMM TFLOP/s (random data, median of ``reps``): the achievable ceiling."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    ms = time_ms(lambda: a @ b, device, warmup=3, reps=reps)
    return 2 * size**3 / (ms * 1e-3) / 1e12
