"""Which floating-point precision a run computes in: ``auto`` follows the hardware.

``auto`` resolves to

- ``bf16`` on a CUDA device with native bf16 (compute capability >= 8.0), else ``fp32``;
- on a CPU, ``bf16`` only where a bf16 GEMM is actually faster than an fp32 one: the CPU must
  advertise AVX512-BF16 or AMX-BF16 *and* a short measurement (256² GEMMs, well under a
  second, cached per machine by ``tape_train.machine_cache``) must find bf16 at least
  ``BF16_MIN_SPEEDUP`` times as fast as fp32. The measurement sees what torch/oneDNN really
  use, so ISA limits (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) are honoured.
  ``fp32`` otherwise: without native support a bf16 GEMM is ~100x slower than fp32.

An explicit ``bf16`` is honoured everywhere but warns, with the measured slowdown, where it is
slow. ``choose_dtype`` is the pure decision (tests fake the facts); ``resolve_dtype`` gathers
the facts of a device and calls it. The trainer, evaluation, export/generation and the
benchmarks all resolve through here.

``deterministic_algorithms(True)`` switches on what makes a GPU run bit-reproducible
(``train.deterministic``); it returns the function that restores the previous settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DTYPE_NAMES = ("auto", "bf16", "fp32")
BF16_MIN_SPEEDUP = 1.2
_PROBE_SIZE = 256
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class PrecisionChoice:
    """A resolved precision: ``dtype`` is ``bf16`` or ``fp32``; ``reason`` is for the log."""

    dtype: str
    reason: str
    warning: str | None = None

    @property
    def torch_dtype(self):
        import torch

        return torch.bfloat16 if self.dtype == "bf16" else torch.float32

    def log_line(self, requested: str) -> str:
        return f"precision: {self.dtype} (requested {requested}; {self.reason})"


def choose_dtype(requested: str, *, device_type: str, native_bf16: bool,
                 bf16_speedup: float | None = None, native_detail: str = "") -> PrecisionChoice:
    """The precision for ``requested`` (``auto``/``bf16``/``fp32``) on a device.

    Args:
        device_type: ``cpu`` or ``cuda``.
        native_bf16: the device has bf16 matrix hardware (CUDA sm80+; CPU AVX512-BF16/AMX).
        bf16_speedup: measured bf16 ÷ fp32 GEMM throughput (CPU; None: not measured).
        native_detail: what ``native_bf16`` was decided from, for the reason.
    """
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {requested!r}")
    if requested == "fp32":
        return PrecisionChoice("fp32", "fp32 requested")
    if device_type == "cuda":
        if native_bf16:
            return PrecisionChoice("bf16", f"CUDA device with native bf16{native_detail}")
        if requested == "bf16":
            return PrecisionChoice("bf16", "bf16 requested", warning=(
                f"bf16 requested on a CUDA device without native bf16{native_detail}: it is "
                f"emulated and slow; dtype=auto or fp32 would use fp32"))
        return PrecisionChoice("fp32", f"CUDA device without native bf16{native_detail}")
    measured = (f"; a bf16 GEMM measured {bf16_speedup:.2f}x fp32 here"
                if bf16_speedup is not None else "")
    fast = native_bf16 and bf16_speedup is not None and bf16_speedup >= BF16_MIN_SPEEDUP
    if requested == "bf16":
        if bf16_speedup is not None and bf16_speedup < 1.0:
            return PrecisionChoice("bf16", "bf16 requested", warning=(
                f"bf16 requested on a CPU where a bf16 GEMM runs {1 / bf16_speedup:.0f}x slower "
                f"than fp32 (measured, {native_detail or 'no native bf16'}): training will be "
                f"that much slower; dtype=auto would use fp32"))
        return PrecisionChoice("bf16", "bf16 requested" + measured)
    if fast:
        return PrecisionChoice("bf16", f"CPU with native bf16 ({native_detail}){measured}")
    if not native_bf16:
        return PrecisionChoice("fp32", f"CPU without native bf16 ({native_detail}){measured}")
    return PrecisionChoice("fp32", f"CPU bf16 not faster than fp32 ({native_detail}){measured}, "
                                   f"needs >= {BF16_MIN_SPEEDUP}x")


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU advertises bf16 matrix instructions and torch may use them."""
    import torch

    from tape_train.machine_cache import cpu_info

    _, flags = cpu_info()
    found = [f for f in _NATIVE_BF16_FLAGS if f in flags]
    aten = torch.backends.cpu.get_cpu_capability()
    if not found:
        return False, f"no {'/'.join(_NATIVE_BF16_FLAGS)} in the CPU flags, ATen {aten}"
    return True, f"{'+'.join(found)}, ATen {aten}"


def measure_cpu_bf16_speedup(budget_s: float = 0.5) -> float:
    """bf16 ÷ fp32 throughput of a 256² GEMM on one core of this CPU.

    fp32 and bf16 products alternate (both see the same machine load) and the best time of
    each counts: at least 3 and at most 32 pairs, stopping once ``budget_s`` is spent (a
    native pair takes ~0.2 ms, an emulated bf16 product ~15 ms). One thread: the ratio is a
    property of the core, and one thread is far less disturbed by a busy machine.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        pairs = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=gen).to(dtype)
            b = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=gen).to(dtype)
            torch.mm(a, b)  # warm-up: picks (and JIT-compiles) the kernel; not timed
            pairs[dtype] = (a, b)
        best = {dtype: float("inf") for dtype in pairs}
        deadline = time.perf_counter() + budget_s
        for i in range(32):
            for dtype, (a, b) in pairs.items():
                start = time.perf_counter()
                torch.mm(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
            if i >= 2 and time.perf_counter() > deadline:
                break
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


def cpu_bf16_speedup() -> float:
    """``measure_cpu_bf16_speedup`` once per machine (cached; not kept from a busy machine)."""
    from tape_train.machine_cache import busy_cpu, cached

    return cached("bf16_speedup", str(_PROBE_SIZE), measure_cpu_bf16_speedup,
                  keep=busy_cpu() is None)[0]


def resolve_dtype(requested: str, device_type: str = "cpu") -> PrecisionChoice:
    """``choose_dtype`` with the facts of this machine's ``device_type`` (``cpu``/``cuda``)."""
    if requested == "fp32":
        return choose_dtype(requested, device_type=device_type, native_bf16=False)
    if device_type == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability()
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return choose_dtype(requested, device_type="cuda", native_bf16=native,
                            native_detail=f", sm{major}{minor}")
    native, detail = cpu_native_bf16()
    speedup = cpu_bf16_speedup()
    return choose_dtype(requested, device_type="cpu", native_bf16=native, bf16_speedup=speedup,
                        native_detail=detail)


CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for reproducible results (CUDA >= 10.2)


def deterministic_algorithms(enabled: bool):
    """Bit-reproducible kernels for the rest of the process when ``enabled``: PyTorch's
    deterministic implementations (``warn_only``: an op that has none warns once, naming
    itself, instead of failing a long run), cuBLAS's fixed workspace (set before the first
    cuBLAS call; a value the user exported is kept), cuDNN without autotuning. The fused TAPE
    kernel and the ``flash`` backend read ``torch.are_deterministic_algorithms_enabled()``.
    Returns a function that restores the previous settings (tests run trainers in-process)."""
    import os

    import torch

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:4]
        if before[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[4]

    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return restore
