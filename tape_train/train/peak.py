"""Peak FLOP/s of the device and dtype a run uses: the denominator of MFU.

- CUDA: a table of published dense peaks per GPU model (bf16 tensor cores; TF32 tensor cores
  for fp32 when ``torch.backends.cuda.matmul.allow_tf32`` is on, else plain fp32 FMA).
- CPU: a measured square-GEMM peak in the run's dtype, time-bounded (about 1 s, also where
  the dtype is slow there) and cached per machine, dtype and thread count
  (``tape_train.machine_cache``), so it is the same number after every restart.
- ``logging.peak_tflops`` overrides both.

``device_peak_tflops(device, dtype, configured)`` is the one entry point (the trainer and the
preflight call it).
"""

from __future__ import annotations

import math
import time

import torch

from tape_train.machine_cache import busy_cpu, cached

# Published dense (no sparsity) peaks in TFLOP/s: (bf16 tensor core, tf32 tensor core, fp32).
# Matched by substring of torch.cuda.get_device_name(); the first match wins, so the more
# specific names come first.
GPU_PEAK_TFLOPS: tuple[tuple[str, tuple[float | None, float, float]], ...] = (
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100 NVL", (835.0, 418.0, 60.0)),
    ("GH200", (989.4, 494.7, 66.9)),
    ("H100", (989.4, 494.7, 66.9)),       # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", (989.4, 494.7, 66.9)),
    ("H800", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)),       # SXM4 and PCIe
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A6000", (154.8, 77.4, 38.7)),
    ("A40", (149.7, 74.8, 37.4)),
    ("A10", (125.0, 62.5, 31.2)),
    ("V100", (None, 15.7, 15.7)),          # no bf16 tensor cores
)
CPU_PEAK_BUDGET_S = 1.0


def gemm_tflops(dtype: torch.dtype, size: int, budget_s: float) -> float:
    """Best observed TFLOP/s of a square ``size`` GEMM in ``dtype`` on the CPU, timing repeats
    until ``budget_s`` is spent (at least one warm-up and one timed product)."""
    gen = torch.Generator().manual_seed(0)  # never touch the training RNG streams
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    torch.mm(a, b)
    best, deadline = math.inf, time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        end = time.perf_counter()
        best = min(best, end - start)
        if end >= deadline:
            break
    return 2.0 * size ** 3 / best / 1e12


def measure_gemm_peak_tflops(dtype: torch.dtype, budget_s: float = CPU_PEAK_BUDGET_S) -> float:
    """The CPU GEMM peak in ``dtype`` within about ``budget_s``: the size grows from 256 while
    one product takes under 2 % of the budget (up to 2048), then the best of repeats."""
    size = 256
    while size < 2048:
        start = time.perf_counter()
        gemm_tflops(dtype, size, 0.0)
        if time.perf_counter() - start > 0.04 * budget_s:  # warm-up + one product
            break
        size *= 2
    return gemm_tflops(dtype, size, budget_s)


def measured_cpu_peak(dtype: torch.dtype) -> tuple[float, str, bool]:
    """The cached (else measured now) CPU GEMM peak for ``dtype`` and this thread count, where
    it came from, and whether it may be low. A peak measured while the machine is busier than
    it has cores is used but not cached (the next start measures again) and flagged: it may
    be low, so an MFU against it may be too high."""
    threads = torch.get_num_threads()
    name = str(dtype).replace("torch.", "")
    busy = busy_cpu()
    peak, was_cached = cached("gemm_peak_tflops", f"{name}/{threads}",
                              lambda: measure_gemm_peak_tflops(dtype), keep=busy is None)
    how = "cached measurement" if was_cached else "measured"
    low = bool(busy) and not was_cached
    note = f"; machine busy ({busy}): not cached, may be low" if low else ""
    return peak, f"{how} {name} GEMM peak, {threads} thread{'s' * (threads != 1)}{note}", low


def cpu_peak_tflops(dtype: torch.dtype) -> tuple[float, str]:
    """``measured_cpu_peak`` without the flag: (peak, where it came from)."""
    peak, source, _ = measured_cpu_peak(dtype)
    return peak, source


def cpu_rank_peak_tflops(dtype: torch.dtype, ranks: int) -> tuple[float, str]:
    """The CPU peak per rank of ``ranks`` ranks sharing this machine's cores (a plan): measured
    with the threads each rank of a run started now would take (``cpu_threads.threads_for``:
    the idle cores / ranks; ``OMP_NUM_THREADS`` where the user set it), not this process's
    own thread count (all cores: on a busy machine that GEMM runs tens of times slower), and
    ranks beyond the cores share them."""
    from tape_train.cpu_threads import threads_for, user_threads
    from tape_train.machine_cache import usable_cpus

    cores = usable_cpus()
    before = torch.get_num_threads()
    threads = before if user_threads()[0] else threads_for(ranks).threads
    torch.set_num_threads(threads)
    try:
        peak, source = cpu_peak_tflops(dtype)
    finally:
        torch.set_num_threads(before)
    if threads * ranks > cores:
        peak *= cores / (threads * ranks)
        source += (f"; x {cores}/{threads * ranks}: {ranks} rank(s) of {threads} thread(s) "
                   f"share {cores} core(s)")
    return peak, source


def gpu_table_peak(name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """The table's dense peak of GPU ``name`` for ``dtype`` (None: not listed / not native).
    Any case matches (``--gpu-name h100``), as in the memory table of the dry run's plan."""
    for key, (bf16, tf32_peak, fp32) in GPU_PEAK_TFLOPS:
        if key.lower() in name.lower():
            if dtype == torch.bfloat16:
                return bf16
            return tf32_peak if tf32 else fp32
    return None


def tf32_matmuls(dtype: torch.dtype) -> bool:
    """Whether an fp32 run's matrix products use TF32 tensor cores on a GPU: only where torch
    allows it (``torch.backends.cuda.matmul.allow_tf32``, off by default; the trainer never
    turns it on), so fp32 MFU and plans divide by the plain fp32 peak."""
    return dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def device_peak_tflops(device: torch.device, dtype: torch.dtype, configured: float | None
                       ) -> tuple[float | None, str, bool]:
    """Peak TFLOP/s per rank for MFU, where it came from (None: unknown, no MFU), and whether
    it may be low (a CPU peak measured on a busy machine: MFU against it may be too high)."""
    if configured is not None:
        return configured, "logging.peak_tflops", False
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = tf32_matmuls(dtype)
        peak = gpu_table_peak(name, dtype, tf32)
        if peak is None:
            return (None, f"no table peak for {name!r} in {dtype}: set logging.peak_tflops "
                    "for MFU", False)
        kind = "bf16" if dtype == torch.bfloat16 else ("tf32" if tf32 else "fp32")
        return peak, f"published dense {kind} peak of {name}", False
    return measured_cpu_peak(dtype)


def checked_mfu(achieved_flops: float, peak_tflops: float | None) -> float | None:
    """MFU as a fraction, or None when there is no peak or the result exceeds 100 % (then the
    peak is wrong, and a number above 1 must never be reported as a result)."""
    if not peak_tflops:
        return None
    mfu = achieved_flops / (peak_tflops * 1e12)
    return mfu if mfu <= 1.0 else None
