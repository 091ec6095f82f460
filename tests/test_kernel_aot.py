"""Ahead-of-time compilation of the fused TAPE kernels for sm_80 and sm_90, without a GPU.

Each configuration is compiled with ``triton.compile`` for a ``GPUTarget`` and assembled with the
wheel's ``ptxas -v``: it must compile and fit the device's shared memory; the sm_80 entries, chosen
by static analysis, must also spill nothing (the sm_90 ones were chosen by time measured on an
H100, spills and all). The CI subset compiles the preferred D=64 entry of the forward and the
dk/dv kernels for both architectures, and sm_90's preferred 32-bit dk/dv entry with fp32 inputs;
``python -m tape_train.kernels.aot`` compiles every entry of both tables. The per-config registers
and shared memory are printed.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("triton")

from tape_train.kernels.tape_attention_configs import (  # noqa: E402
    AUTOTUNE_CONFIGS,
    AUTOTUNE_CONFIGS_FP32,
    SHARED_MEMORY_LIMIT,
    KernelConfig,
    autotune_configs,
    tables_by_element_size,
    validate_config,
)

pytestmark = [pytest.mark.triton]

# The preferred D=64 entry of the forward and of the dk/dv kernel (atomic dq, the default and the
# most register-bound kernel) for each architecture: 4 cold compiles, ~1-2 min on 2 busy cores.
# The full tables (58 compiles) are checked by `python -m tape_train.kernels.aot`.
CI_SUBSET = [
    (kernel, variant, arch, 64, AUTOTUNE_CONFIGS[arch][64][kernel][0], "bf16")
    for arch in (80, 90)
    for kernel, variant in (("fwd", ""), ("bwd_dkv", "atomic_dq"))
] + [("bwd_dkv", "atomic_dq", 90, 64, AUTOTUNE_CONFIGS_FP32[90][64]["bwd_dkv"][0], "fp32")]


SPILLING_JOB = ("fwd", "", 80, 32, KernelConfig(128, 64, 4, 3), "bf16")
# Negative control of the shared-memory check and the reason for the 32-bit table: sm_90's
# fastest 16-bit dk/dv tile at D=64 needs ~337 KiB with fp32 inputs (limit 227 KiB).
OVERSIZED_JOB = ("bwd_dkv", "atomic_dq", 90, 64, AUTOTUNE_CONFIGS[90][64]["bwd_dkv"][0], "fp32")


def _job_id(job) -> str:
    kernel, variant, arch, head_dim, cfg, dtype = job
    return (f"sm{arch}-d{head_dim}-{dtype}-{kernel}{'-' + variant if variant else ''}"
            f"-{cfg.label()}")


@pytest.fixture(scope="module")
def ci_subset_stats() -> dict:
    """Compile the CI subset on both cores (compilation is single-threaded and CPU-bound)."""
    from tape_train.kernels.aot import compile_config

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_DEFAULT_FP_FUSION", "1")
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
            futures = {_job_id(job): pool.submit(compile_config, *job)
                       for job in (*CI_SUBSET, SPILLING_JOB, OVERSIZED_JOB)}
            return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("job", CI_SUBSET, ids=_job_id)
def test_config_compiles_and_fits(ci_subset_stats, capsys, job):
    stats = ci_subset_stats[_job_id(job)]
    with capsys.disabled():
        print("\n" + stats.row())
    assert stats.fits and stats.shared_bytes <= SHARED_MEMORY_LIMIT[stats.arch], stats.row()
    if stats.arch == 80:  # chosen by static analysis: spill-free by construction
        assert stats.spills == 0, stats.row()
    assert 0 < stats.registers <= 255


@pytest.mark.slow
def test_spill_check_detects_a_spilling_config(ci_subset_stats):
    """Negative control: a tile too large for sm_80's register file (D=32 forward, 128×64 rows
    on 4 warps) must be reported as spilling, so a pass above means something."""
    stats = ci_subset_stats[_job_id(SPILLING_JOB)]
    assert stats.spill_stores > 0 and stats.spills > 0, stats.row()


@pytest.mark.slow
def test_shared_memory_check_rejects_16_bit_winner_with_fp32_inputs(ci_subset_stats):
    """Negative control: the 16-bit table's preferred sm_90 dk/dv tile does not fit with fp32
    inputs, so the fit check above means something and fp32 needs its own table."""
    stats = ci_subset_stats[_job_id(OVERSIZED_JOB)]
    assert not stats.fits and stats.shared_bytes > SHARED_MEMORY_LIMIT[90], stats.row()


def test_parse_ptxas_output():
    from tape_train.kernels.aot import parse_ptxas

    text = (
        "ptxas info    : Function properties for k\n"
        "    8 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 1 barriers, 512 bytes cmem[0]\n"
    )
    assert parse_ptxas(text) == (168, 16, 12)
    with pytest.raises(RuntimeError, match="cannot parse"):
        parse_ptxas("garbage")


def test_config_tables_follow_tiling_rules():
    for table in tables_by_element_size().values():
        assert set(table) == {80, 90}
        for arch, per_dim in table.items():
            assert set(per_dim) == {32, 64, 128}, arch
            for head_dim, per_kernel in per_dim.items():
                assert set(per_kernel) == {"fwd", "bwd_dkv", "bwd_dq"}, (arch, head_dim)
                for kernel, configs in per_kernel.items():
                    assert configs, (arch, head_dim, kernel)
                    for cfg in configs:
                        validate_config(kernel, cfg)
    assert autotune_configs(90, 64, "bwd_dkv", 4) != autotune_configs(90, 64, "bwd_dkv", 2)
    with pytest.raises(ValueError, match="2- or 4-byte"):
        autotune_configs(90, 64, "fwd", elem_bytes=1)
    with pytest.raises(ValueError, match="multiple of block_n"):
        validate_config("fwd", KernelConfig(16, 32, 4, 2))
    with pytest.raises(ValueError, match="multiple of block_m"):
        validate_config("bwd_dkv", KernelConfig(32, 16, 4, 2))
    with pytest.raises(ValueError, match="power of 2"):
        validate_config("fwd", KernelConfig(48, 16, 4, 2))


def test_autotuners_build_for_every_table_entry():
    """The GPU path wraps each kernel in triton.autotune over its table; building it checks the
    key / reset_to_zero names against the kernel signature (no GPU needed, nothing launched)."""
    from tape_train.kernels import tape_attention_launch as launch

    kernels = {
        "fwd": (launch.tape_attention_fwd_kernel, ()),
        "bwd_dkv": (launch.tape_attention_bwd_dkv_kernel, ("DQT",)),
        "bwd_dq": (launch.tape_attention_bwd_dq_kernel, ()),
    }
    for elem_bytes, table in tables_by_element_size().items():
        for arch, per_dim in table.items():
            for head_dim, per_kernel in per_dim.items():
                for kind, (kernel, reset) in kernels.items():
                    tuned = launch._autotuned(kernel, kind, arch, head_dim, reset, elem_bytes)
                    got = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                           for c in tuned.configs]
                    want = [(c.block_m, c.block_n, c.num_warps, c.num_stages)
                            for c in per_kernel[kind]]
                    assert got == want, (elem_bytes, arch, head_dim, kind)
