"""Launch configurations of the fused TAPE attention kernels, per GPU generation and head dim.

The tables are explicit (no generated search space) so that the ahead-of-time test in
``tests/test_kernel_aot.py`` compiles exactly what autotuning may pick on a real GPU, and
checks each entry for register spills and shared-memory fit. This module imports nothing
from Triton: it is plain data, importable on any machine.

Block-shape rules the kernels rely on (checked by :func:`validate_config`):
- forward and dq kernels loop over key blocks inside a query block: ``BLOCK_M % BLOCK_N == 0``
  so the causal diagonal starts on a key-block boundary;
- the dk/dv kernel loops over query blocks inside a key block: ``BLOCK_N % BLOCK_M == 0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KERNELS = ("fwd", "bwd_dkv", "bwd_dq")
HEAD_DIMS = (32, 64, 128)
#: Compute capabilities with a tuned table; other GPUs use the nearest lower one.
ARCHS = (80, 90)
#: Shared memory per thread block that a kernel may request (bytes): the opt-in maximum.
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
_LABEL = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)")


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: tile sizes (tokens) and Triton's warps / pipeline stages."""

    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int

    def label(self) -> str:
        """``128x64w8s3``: BLOCK_M × BLOCK_N, warps, stages (the table's notation)."""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"

    @classmethod
    def parse(cls, label: str) -> "KernelConfig":
        match = _LABEL.fullmatch(label.strip())
        if match is None:
            raise ValueError(f"launch config {label!r}: expected BLOCK_MxBLOCK_Nw<warps>s<stages>, "
                             "e.g. 128x64w8s3")
        return cls(*(int(g) for g in match.groups()))


@dataclass(frozen=True)
class TapeKernelConfigs:
    """One pinned configuration per kernel (skips autotuning)."""

    fwd: KernelConfig
    bwd_dkv: KernelConfig
    bwd_dq: KernelConfig


def validate_config(kernel: str, cfg: KernelConfig) -> None:
    """Raise ValueError if ``cfg`` breaks the tiling rules of ``kernel``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    for name in ("block_m", "block_n"):
        value = getattr(cfg, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{kernel} config {cfg}: {name}={value} must be a power of 2 >= 16")
    if kernel in ("fwd", "bwd_dq") and cfg.block_m % cfg.block_n:
        raise ValueError(f"{kernel} config {cfg}: block_m must be a multiple of block_n")
    if kernel == "bwd_dkv" and cfg.block_n % cfg.block_m:
        raise ValueError(f"{kernel} config {cfg}: block_n must be a multiple of block_m")


# How the entries were chosen. sm_90, D=64 and D=128: measured on an H100 80GB HBM3
# (`python benchmarks/gpu_report.py --sections sweep --sweep-extra`, bf16, causal, N=4096,
# 32k tokens, Triton 3.6; docs/gpu/nvidia-h100-80gb-hbm3/): the three fastest correct configs
# of each kernel, fastest first. The winners spill registers (the dk/dv 64x128 tile at D=64
# spills ~1.5 KB per thread yet runs 2.3x faster than the spill-free 32x64 tile), so spill
# counts are no guide on Hopper. Everything else (sm_80, sm_90 D=32) is still chosen by static
# analysis: spill-free shapes from `python -m tape_train.kernels.aot` (the forward keeps three
# D-wide fp32 accumulators [O | Ê⁰ | Ê¹] per query row, the dk/dv kernel four per key row, so
# tiles are smaller than FlashAttention-2's for the same head dim), untimed.
#
# These rows are for 16-bit inputs (bf16, fp16). 32-bit inputs double every tile's bytes: the
# 16-bit winners then exceed shared memory, and with IEEE fp32 dots (no TF32) Triton unrolls
# each tile product into FMAs, so a large tile takes minutes to compile (the dk/dv 64x128 tile
# at D=64: ~150 s and 215 KB of spills per thread). FP32_TABLE holds small tiles that fit
# sm_80 / sm_90 shared memory at 4 bytes per element (AOT-checked, not timed).
#
# arch  D    kernel   candidates BLOCK_MxBLOCK_N w<warps> s<stages>, preferred first
TABLE = """
80    32   fwd      128x64w8s3  64x64w4s3   128x32w4s4
80    32   bwd_dkv  32x64w4s2   16x64w4s3
80    32   bwd_dq   128x32w8s2  64x32w4s2   64x16w4s3
80    64   fwd      128x16w8s2  64x32w4s3   64x16w4s2
80    64   bwd_dkv  16x16w4s2
80    64   bwd_dq   64x16w8s2   64x16w4s2   32x16w4s2
80    128  fwd      32x32w4s2   32x16w4s2
80    128  bwd_dkv  16x32w8s2   16x16w4s2   16x16w4s1
80    128  bwd_dq   32x32w8s2   32x16w8s2   16x16w4s2
90    32   fwd      128x64w4s3  128x128w8s3 64x64w4s4
90    32   bwd_dkv  32x128w8s3  32x64w4s3   16x64w8s2
90    32   bwd_dq   128x32w8s3  128x64w8s2  64x32w4s3
90    64   fwd      128x128w8s2 128x128w8s3 128x64w8s3
90    64   bwd_dkv  64x128w8s2  64x128w8s3  32x64w4s3
90    64   bwd_dq   64x64w4s3   128x64w4s2  128x32w4s3
90    128  fwd      128x64w8s2  64x64w8s3   128x32w8s2
90    128  bwd_dkv  32x64w8s2   32x64w8s3   32x128w8s2
90    128  bwd_dq   128x64w8s2  64x32w4s2   128x32w8s2
"""

# 32-bit inputs (see above): sm_90 takes the largest spill-light tiles that fit 227 KiB in
# both dk/dv variants; sm_80 uses its 16-bit rows (all fit at 4 bytes per element).
FP32_TABLE = """
90    32   fwd      128x64w4s3  64x64w4s4
90    32   bwd_dkv  32x64w4s3   16x64w8s2
90    32   bwd_dq   128x32w8s3  64x32w4s3
90    64   fwd      128x64w8s3  64x64w4s3
90    64   bwd_dkv  32x64w8s2   16x64w8s2
90    64   bwd_dq   128x32w8s2  64x32w4s2
90    128  fwd      64x32w8s3   64x32w8s2
90    128  bwd_dkv  32x32w8s2   16x32w8s2
90    128  bwd_dq   64x16w8s2
"""


def parse_table(text: str) -> dict[int, dict[int, dict[str, tuple[KernelConfig, ...]]]]:
    """``{arch: {head_dim: {kernel: configs}}}`` from rows ``arch D kernel label...``."""
    table: dict = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) < 4:
            raise ValueError(f"config table line {lineno}: expected 'arch D kernel config...', "
                             f"got {line.strip()!r}")
        arch, head_dim, kernel = int(fields[0]), int(fields[1]), fields[2]
        per_kernel = table.setdefault(arch, {}).setdefault(head_dim, {})
        if kernel in per_kernel:
            raise ValueError(f"config table line {lineno}: {arch} {head_dim} {kernel} repeated")
        per_kernel[kernel] = tuple(KernelConfig.parse(label) for label in fields[3:])
    return table


AUTOTUNE_CONFIGS = parse_table(TABLE)  # 16-bit inputs
AUTOTUNE_CONFIGS_FP32 = {80: AUTOTUNE_CONFIGS[80], **parse_table(FP32_TABLE)}  # 32-bit inputs

#: Small tiles for Triton's CPU interpreter (tests): several blocks and a masked tail at N≈40.
INTERPRETER_CONFIGS = TapeKernelConfigs(fwd=KernelConfig.parse("32x16w1s1"),
                                        bwd_dkv=KernelConfig.parse("16x32w1s1"),
                                        bwd_dq=KernelConfig.parse("32x16w1s1"))


def arch_for_capability(major: int, minor: int) -> int:
    """Pick the config table for a GPU: the largest tuned arch not newer than it."""
    cc = 10 * major + minor
    usable = [a for a in ARCHS if a <= cc]
    if not usable:
        raise ValueError(f"fused TAPE attention needs compute capability >= 8.0, got {major}.{minor}")
    return max(usable)


def tables_by_element_size() -> dict[int, dict]:
    """``{bytes per input element: parsed table}``: 2 for bf16/fp16, 4 for fp32."""
    return {2: AUTOTUNE_CONFIGS, 4: AUTOTUNE_CONFIGS_FP32}


def autotune_configs(arch: int, head_dim: int, kernel: str,
                     elem_bytes: int = 2) -> tuple[KernelConfig, ...]:
    """The autotuning candidates of ``kernel`` for an arch (80/90), a head dim and the inputs'
    element size (2: bf16/fp16, 4: fp32)."""
    tables = tables_by_element_size()
    if elem_bytes not in tables:
        raise ValueError(f"fused TAPE attention takes 2- or 4-byte inputs, got {elem_bytes}-byte")
    try:
        return tables[elem_bytes][arch][head_dim][kernel]
    except KeyError:
        raise ValueError(
            f"no {kernel} configs for arch {arch}, head dim {head_dim}; "
            f"tuned: archs {ARCHS}, head dims {HEAD_DIMS}"
        ) from None


def _validate_tables() -> None:
    for per_dim in (*AUTOTUNE_CONFIGS.values(), *AUTOTUNE_CONFIGS_FP32.values()):
        for per_kernel in per_dim.values():
            for kernel, cfgs in per_kernel.items():
                for cfg in cfgs:
                    validate_config(kernel, cfg)
    for kernel in KERNELS:
        validate_config(kernel, getattr(INTERPRETER_CONFIGS, kernel))


_validate_tables()
