"""Ahead-of-time compilation of the fused TAPE kernels for sm_80 / sm_90, without a GPU.

Compiles one (kernel, arch, head dim, launch config) with ``triton.compile`` for a
``GPUTarget``, then runs the ``ptxas`` bundled in the Triton wheel with ``-v`` on the PTX to read
registers per thread and spill stores / loads. Shared memory comes from Triton's metadata.

    python -m tape_train.kernels.aot                # every autotune config, both archs
    python -m tape_train.kernels.aot --arch 90 --head-dim 64

Pointer and stride arguments are compiled with Triton's divisibility-by-16 hint, as the JIT
does for the usual layouts (head dims 32/64/128, 16-byte aligned tensors), so the figures are
those of the specialisation that runs in training.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tape_train.kernels.tape_attention_bwd import tape_attention_bwd_dkv_kernel, tape_attention_bwd_dq_kernel
from tape_train.kernels.tape_attention_configs import (
    ARCHS,
    HEAD_DIMS,
    SHARED_MEMORY_LIMIT,
    KernelConfig,
    tables_by_element_size,
)
from tape_train.kernels.tape_attention_fwd import tape_attention_fwd_kernel

# (kernel kind, variant label) -> (jit function, extra constexprs)
VARIANTS = {
    ("fwd", ""): (tape_attention_fwd_kernel, {}),
    ("bwd_dkv", "atomic_dq"): (tape_attention_bwd_dkv_kernel, {"ATOMIC_DQ": True}),
    ("bwd_dkv", "deterministic"): (tape_attention_bwd_dkv_kernel, {"ATOMIC_DQ": False}),
    ("bwd_dq", ""): (tape_attention_bwd_dq_kernel, {}),
}
_INT_ARGS = {"N_HEADS", "N_CTX"}
_FP32_POINTERS = {"LSE", "DELTA", "DE0_PART", "DE1_PART", "DQT"}


@dataclass(frozen=True)
class CompiledStats:
    kernel: str
    variant: str
    arch: int
    head_dim: int
    config: KernelConfig
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared_bytes: int
    compile_seconds: float
    dtype: str = "bf16"

    @property
    def fits(self) -> bool:
        """Launchable: its shared memory within the architecture's opt-in limit. (Spills cost
        speed, not correctness; measured tables accept them.)"""
        return self.shared_bytes <= SHARED_MEMORY_LIMIT[self.arch]

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def row(self) -> str:
        name = self.kernel + (f"[{self.variant}]" if self.variant else "")
        return (f"sm_{self.arch} D={self.head_dim:<3} {self.dtype:<4} {name:<24} {self.config.label():<18} "
                f"regs={self.registers:<3} spill_st={self.spill_stores:<4} spill_ld={self.spill_loads:<4} "
                f"smem={self.shared_bytes / 1024:6.1f}KiB  ({self.compile_seconds:4.1f}s)")


def ptxas_path(arch: int) -> Path:
    """The ptxas Triton itself uses for ``arch`` (the wheel bundles one for < sm_90, a newer one for >=)."""
    from triton.backends.nvidia.compiler import get_ptxas

    path = Path(get_ptxas(arch).path)
    if not path.exists():
        raise FileNotFoundError(f"ptxas for sm_{arch} not found at {path} (expected inside the triton wheel)")
    return path


def _signature(fn, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "sm_scale":
            signature[name] = "fp32"
        elif name in _INT_ARGS:
            signature[name] = "i32"
        elif name.isupper():  # tensors are the other upper-case arguments
            signature[name] = "*fp32" if name in _FP32_POINTERS else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def parse_ptxas(output: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` output."""
    regs = re.search(r"Used (\d+) registers", output)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)
    if regs is None or spills is None:
        raise RuntimeError(f"cannot parse ptxas -v output:\n{output}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_config(kernel: str, variant: str, arch: int, head_dim: int, cfg: KernelConfig,
                   dtype: str = "bf16", causal: bool = True) -> CompiledStats:
    """Compile one configuration for ``sm_{arch}`` and measure it with ``ptxas -v``."""
    fn, extra = VARIANTS[(kernel, variant)]
    constexprs = {"HEAD_DIM": head_dim, "CAUSAL": causal, "PRECISION": "tf32",
                  "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, **extra}
    signature, attrs = _signature(fn, dtype, constexprs)
    start = time.perf_counter()
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
    seconds = time.perf_counter() - start
    gpu_name = "sm_90a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        result = subprocess.run(
            [str(ptxas_path(arch)), "-v", f"--gpu-name={gpu_name}", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        )
    regs, spill_st, spill_ld = parse_ptxas(result.stdout + result.stderr)
    return CompiledStats(kernel, variant, arch, head_dim, cfg, regs, spill_st, spill_ld,
                         compiled.metadata.shared, seconds, dtype)


def tile_cost(kernel: str, variant: str, head_dim: int, cfg: KernelConfig, elem_bytes: int = 2) -> tuple[int, int]:
    """(tensor-core FLOPs, bytes loaded from L2/HBM) of one unmasked BLOCK_M×BLOCK_N tile.

    The bytes are those streamed by the inner loop (the outer block's tiles are loaded once per
    program); fp32 atomics on dq̃ count a read and a write.
    """
    bm, bn, d = cfg.block_m, cfg.block_n, head_dim
    if kernel == "fwd":  # S = q̃k̃ᵀ (2·d) + P·[v|E⁰|E¹] (2·3d); streams k, v, E⁰, E¹
        return 8 * bm * bn * d, 4 * bn * d * elem_bytes
    if kernel == "bwd_dq":  # S, dP = dO_ext·V_extᵀ, dq̃; streams k, v, E⁰, E¹
        return 10 * bm * bn * d, 4 * bn * d * elem_bytes
    # dk/dv: Sᵀ, dV_ext, dPᵀ, dk̃ (+ dq̃); streams q, E⁰, E¹, dO, dÊ⁰, dÊ¹, LSE, Δ (+ dq̃ atomics)
    flops = 16 * bm * bn * d
    loaded = 6 * bm * d * elem_bytes + 8 * bm
    if variant == "atomic_dq":
        flops += 2 * bm * bn * d
        loaded += 2 * 4 * bm * d
    return flops, loaded


def markdown_table(rows: list[CompiledStats]) -> str:
    """The static figures of docs/kernel.md: one row per compiled configuration."""
    lines = [
        "| arch | D | dtype | kernel | BLOCK_M×BLOCK_N, warps, stages | regs/thread | spills (B) "
        "| smem (KiB) | MMA FLOPs/tile | bytes/tile | FLOP/B |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flops, loaded = tile_cost(r.kernel, r.variant, r.head_dim, r.config,
                                  4 if r.dtype == "fp32" else 2)
        name = r.kernel + (f" ({r.variant})" if r.variant else "")
        c = r.config
        lines.append(
            f"| sm_{r.arch} | {r.head_dim} | {r.dtype} | {name} "
            f"| {c.block_m}×{c.block_n}, {c.num_warps}, {c.num_stages} "
            f"| {r.registers} | {r.spills} | {r.shared_bytes / 1024:.1f} "
            f"| {flops / 1e6:.2f} M | {loaded / 1024:.1f} KiB | {flops / loaded:.0f} |"
        )
    return "\n".join(lines)


def all_jobs(archs=ARCHS, head_dims=HEAD_DIMS):
    """Every (kernel, variant, arch, head dim, config, dtype) that autotuning may launch: the
    16-bit table compiled for bf16 inputs, the 32-bit one for fp32."""
    for elem_bytes, table in tables_by_element_size().items():
        dtype = "bf16" if elem_bytes == 2 else "fp32"
        for arch in archs:
            for head_dim in head_dims:
                for (kernel, variant) in VARIANTS:
                    for cfg in table[arch][head_dim][kernel]:
                        yield kernel, variant, arch, head_dim, cfg, dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=ARCHS, action="append")
    parser.add_argument("--head-dim", type=int, choices=HEAD_DIMS, action="append")
    parser.add_argument("--markdown", action="store_true", help="also print the docs/kernel.md table")
    args = parser.parse_args(argv)
    jobs = list(all_jobs(args.arch or ARCHS, args.head_dim or HEAD_DIMS))
    failures, start, rows = 0, time.perf_counter(), []
    for i, job in enumerate(jobs, 1):
        stats = compile_config(*job)
        rows.append(stats)
        failures += not stats.fits
        verdict = ("FAIL (shared memory)" if not stats.fits
                   else f"ok ({stats.spills} B spilled)" if stats.spills else "ok")
        print(f"[{i}/{len(jobs)}] {stats.row()} {verdict}", flush=True)
    print(f"aot: {len(jobs)} configs, {failures} failing, {time.perf_counter() - start:.0f}s total")
    if args.markdown:
        print(markdown_table(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
