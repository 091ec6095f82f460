"""Shared pieces of the GPU report: the time budget, timing, relative errors, device facts,
the count of host syncs."""

from __future__ import annotations

import collections
import contextlib
import math
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode


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


# Tensor methods that read a value back to the host: each one waits for the GPU to finish all
# the work queued before it (a pipeline drain) when the tensor lives on a GPU.
HOST_READS = frozenset({"item", "tolist", "cpu", "numpy", "nonzero", "__float__", "__int__",
                        "__bool__", "__index__"})
_OWN_CODE = ("/tape_train/", "/deepspeed/")
_MICRO_BATCH_LOOP = ("forward_backward", "tape_train/train/engine.py")


@dataclass
class HostSyncs:
    """What ``count_host_syncs`` saw, by the line of tape_train or DeepSpeed that caused it:
    ``sites`` all of it, ``mid_step`` what happened while a micro-batch other than the step's
    last one ran (``tape_train.train.engine.forward_backward``): the optimizer step is done in
    the last one, so such a site repeats for every micro-batch."""

    sites: collections.Counter = field(default_factory=collections.Counter)
    mid_step: collections.Counter = field(default_factory=collections.Counter)

    def record(self) -> None:
        frame = sys._getframe(2)  # the op's caller, then outwards
        stack, mid = [], False
        while frame is not None:
            name = frame.f_code.co_filename.replace("\\", "/")
            stack.append(f"{name}:{frame.f_lineno}")
            if frame.f_code.co_name == _MICRO_BATCH_LOOP[0] and name.endswith(_MICRO_BATCH_LOOP[1]):
                batches, i = frame.f_locals.get("micro_batches"), frame.f_locals.get("i")
                mid = mid or (i is not None and batches is not None and i < len(batches) - 1)
            frame = frame.f_back
        site = next((f"{root.strip('/')}/{name.split(root, 1)[1]}"
                     for name in stack for root in _OWN_CODE if root in name), "elsewhere")
        self.sites[site] += 1
        if mid:
            self.mid_step[site] += 1


class _HostReadRecorder(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.syncs.record()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs(device: torch.device):
    """Counts what waits for the device inside the block; yields a ``HostSyncs`` filled as it
    runs.

    CUDA: the synchronising operations torch's sync debug mode reports (a value read back, a
    blocking copy, ``nonzero``...). Elsewhere nothing waits, so the calls that would wait on a
    GPU are counted instead: every read of a tensor value back to the host (``HOST_READS``),
    including reads of host-side tensors that cost nothing on a GPU run."""
    syncs = HostSyncs()
    if device.type != "cuda":
        with _HostReadRecorder(syncs):
            yield syncs
        return
    before, show = torch.cuda.get_sync_debug_mode(), warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):  # called inside the op: the stack is its caller's
            syncs.record()
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():  # restores the filters and showwarning
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(before)
