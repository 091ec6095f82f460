"""train.dtype=auto: the precision follows the hardware (faked capabilities both ways, and the
real measurement under an AVX2-only emulation), the per-machine measurement cache, and the MFU
peak guard (a result above 100 % is never reported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tape_train import machine_cache
from tape_train.precision import BF16_MIN_SPEEDUP, choose_dtype

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(machine_cache.CACHE_ENV, str(tmp_path / "cache"))


@pytest.mark.parametrize("native,speedup,expected", [
    (True, 4.0, "bf16"),     # AVX512-BF16 / AMX CPU where bf16 GEMMs are fast
    (False, 0.01, "fp32"),   # AVX2-only CPU: bf16 emulated, ~100x slower
    (True, 0.01, "fp32"),    # flags present but oneDNN limited to AVX2: measurement decides
    (True, 1.0, "fp32"),     # native but no faster than fp32: keep fp32's accuracy
    (False, None, "fp32"),
])
def test_auto_on_cpu_follows_the_measured_bf16_speed(native, speedup, expected):
    choice = choose_dtype("auto", device_type="cpu", native_bf16=native, bf16_speedup=speedup,
                          native_detail="faked")
    assert choice.dtype == expected and choice.warning is None
    assert "faked" in choice.reason and choice.log_line("auto").startswith(
        f"precision: {expected} (requested auto")


def test_auto_on_cuda_follows_native_bf16():
    assert choose_dtype("auto", device_type="cuda", native_bf16=True).dtype == "bf16"
    assert choose_dtype("auto", device_type="cuda", native_bf16=False).dtype == "fp32"


def test_explicit_choices_are_honoured_and_slow_bf16_warns_with_the_slowdown():
    slow = choose_dtype("bf16", device_type="cpu", native_bf16=False, bf16_speedup=0.01)
    assert slow.dtype == "bf16" and "100x slower" in slow.warning
    fast = choose_dtype("bf16", device_type="cpu", native_bf16=True, bf16_speedup=4.0)
    assert fast.dtype == "bf16" and fast.warning is None
    assert choose_dtype("fp32", device_type="cpu", native_bf16=True,
                        bf16_speedup=4.0).dtype == "fp32"
    assert choose_dtype("bf16", device_type="cuda", native_bf16=False).warning
    with pytest.raises(ValueError, match="bf15"):
        choose_dtype("bf15", device_type="cpu", native_bf16=True)


def test_resolve_dtype_uses_the_machine_facts(monkeypatch):
    from tape_train import precision

    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: (True, "amx_bf16"))
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 2 * BF16_MIN_SPEEDUP)
    assert precision.resolve_dtype("auto").dtype == "bf16"
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: (False, "no avx512_bf16"))
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.02)
    assert precision.resolve_dtype("auto").dtype == "fp32"
    assert "50x slower" in precision.resolve_dtype("bf16").warning


def test_avx2_emulation_is_detected_by_the_measurement(tmp_path):
    """With torch and oneDNN limited to AVX2 a bf16 GEMM is emulated (slow on every x86 CPU),
    so ``auto`` must pick fp32 there whatever flags the CPU advertises."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           machine_cache.CACHE_ENV: str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    code = ("from tape_train.precision import resolve_dtype\n"
            "c = resolve_dtype('auto'); print(c.dtype); print(c.reason)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    dtype, reason = out.stdout.splitlines()[:2]
    assert dtype == "fp32", reason
    assert "measured 0.0" in reason  # the emulated bf16 GEMM: ~100x slower than fp32


def test_measurements_are_cached_per_machine_key(monkeypatch):
    calls = []

    def measure():
        calls.append(1)
        return 0.5

    assert machine_cache.cached("x", "k", measure) == (0.5, False)
    assert machine_cache.cached("x", "k", measure) == (0.5, True)
    assert len(calls) == 1
    other = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other)  # another ISA limit: another machine key
    assert machine_cache.cached("x", "k", measure) == (0.5, False)
    assert machine_cache.cached("y", "k", measure, keep=False) == (0.5, False)
    assert machine_cache.cached("y", "k", measure, keep=False) == (0.5, False)  # not kept
    assert len(calls) == 3 + 1


def test_a_failed_write_of_the_cache_keeps_its_table_and_leaves_no_temporary_file(monkeypatch):
    """A full disk while the table is written: the value is still returned, the old table
    stays whole and nothing is left beside it (a .tmp<pid> file stayed before)."""
    import builtins
    import errno

    machine_cache.cached("x", "before", lambda: 0.25)
    path = machine_cache.cache_dir() / "measurements.json"
    before = path.read_bytes()
    real_open = builtins.open

    class FullDisk:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return FullDisk(fh) if "w" in mode and "measurements" in str(file) else fh

    monkeypatch.setattr(builtins, "open", full_open)
    assert machine_cache.cached("x", "after", lambda: 0.5) == (0.5, False)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir() if "measurements" in p.name) \
        == ["measurements.json"]


def _no_home(monkeypatch):
    """No HOME and a user id the password database lacks (a container started with --user)."""
    import pwd

    for name in (machine_cache.CACHE_ENV, "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", unknown)


def test_without_a_home_directory_measurements_are_taken_not_kept(monkeypatch, tmp_path,
                                                                  capsys):
    """Path.home() fails there: measuring still works (every time), and the demo's download
    cache is a one-line error that says what to set, not a traceback."""
    from tape_train.data import cli as data_cli

    _no_home(monkeypatch)
    calls = []
    for _ in range(2):
        assert machine_cache.cached("x", "k", lambda: calls.append(1) or 0.5) == (0.5, False)
    assert len(calls) == 2
    with pytest.raises(machine_cache.NoCacheDir, match=machine_cache.CACHE_ENV):
        machine_cache.cache_dir()
    assert data_cli.main(["prepare", "--demo", "--out", str(tmp_path / "demo")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HOME is unset" in err and machine_cache.CACHE_ENV in err
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # control: a home, so a kept value
    assert machine_cache.cached("x", "k", lambda: 0.5) == (0.5, False)
    assert machine_cache.cached("x", "k", lambda: 9.0) == (0.5, True)


AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("value,flags,fits", [
    ("avx512", AVX2_FLAGS, "avx2"),                      # an AVX-512 node's environment
    ("avx2", frozenset({"sse4_2", "avx"}), "default"),   # an older CPU
    ("avx512", AVX512_FLAGS, None), ("avx2", AVX2_FLAGS, None),  # controls: the CPU has them
    ("default", frozenset({"sse4_2"}), None), ("", AVX2_FLAGS, None),
    ("avx512", frozenset(), None),                       # flags unknown: torch decides
])
def test_an_isa_above_the_cpus_is_refused_before_torch_runs(monkeypatch, capsys, value, flags,
                                                          fits):
    """torch believes ATEN_CPU_CAPABILITY without asking the CPU: avx512 on an AVX2 CPU dies
    with SIGILL at the first vectorised op. The commands that compute refuse it in one line
    naming the variable and a value that works; tape-data and tape-submit do not compute."""
    import sys

    from tape_train import cli
    from tape_train.devices import LaunchError, check_launch_environment

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", value)
    monkeypatch.setattr(machine_cache, "cpu_info", lambda: ("faked", flags))
    error = machine_cache.isa_limit_error()
    if fits is None:
        assert error is None
        check_launch_environment()
        return
    assert f"ATEN_CPU_CAPABILITY={value}" in error and error.endswith(f"set it to {fits}")
    with pytest.raises(LaunchError, match=f"ATEN_CPU_CAPABILITY={value}"):
        check_launch_environment()  # `python -m tape_train.train.cli`, torchrun's workers
    monkeypatch.setattr(sys, "argv", ["tape-eval", "--checkpoint", "runs/none"])
    with pytest.raises(SystemExit) as stop:
        cli.eval_main()
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"tape-eval: error: {error}"]
    monkeypatch.setattr(sys, "argv", ["tape-data", "info", "no-such-dir"])
    with pytest.raises(SystemExit) as stop:
        cli.data_main()
    assert stop.value.code == 1 and "ATEN_CPU_CAPABILITY" not in capsys.readouterr().err


def test_mfu_above_100_percent_is_never_a_result():
    from tape_train.train.peak import checked_mfu

    assert checked_mfu(0.5e12, 1.0) == pytest.approx(0.5)
    assert checked_mfu(1.0e12, 1.0) == pytest.approx(1.0)
    assert checked_mfu(1.5e12, 1.0) is None      # the peak is wrong
    assert checked_mfu(1.0e12, None) is None


def test_gpu_peaks_come_from_the_table_by_model_and_dtype():
    import torch

    from tape_train.train.peak import gpu_table_peak

    assert gpu_table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16, tf32=False) == 989.4
    assert gpu_table_peak("NVIDIA H100 PCIe", torch.bfloat16, tf32=False) == 756.0
    assert gpu_table_peak("NVIDIA H200", torch.float32, tf32=True) == 494.7
    assert gpu_table_peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False) == 19.5
    assert gpu_table_peak("NVIDIA L40S", torch.bfloat16, tf32=False) == 362.0
    assert gpu_table_peak("NVIDIA A10G", torch.bfloat16, tf32=False) == 125.0
    assert gpu_table_peak("Tesla V100-SXM2-16GB", torch.bfloat16, tf32=False) is None
    assert gpu_table_peak("Some Future GPU", torch.bfloat16, tf32=False) is None
    # typed by a user (--gpu-name): any case, as the memory table takes it
    assert gpu_table_peak("h100", torch.bfloat16, tf32=False) == 989.4
    assert gpu_table_peak("nvidia l40s", torch.bfloat16, tf32=False) == 362.0


def test_cpu_peak_measurement_is_time_bounded_and_cached():
    import time

    import torch

    from tape_train.train.peak import cpu_peak_tflops, measure_gemm_peak_tflops

    start = time.perf_counter()
    peak = measure_gemm_peak_tflops(torch.float32, budget_s=0.2)
    assert 0 < peak < 100 and time.perf_counter() - start < 30  # generous: a busy machine
    first, how = cpu_peak_tflops(torch.float32)
    again, how_again = cpu_peak_tflops(torch.float32)
    if machine_cache.busy_cpu() is None:
        assert again == first and how_again.startswith("cached")
    assert "float32" in how and f"{torch.get_num_threads()} thread" in how


def test_deterministic_algorithms_switch_on_and_restore(monkeypatch):
    """train.deterministic's switch: torch's deterministic mode (warn-only), cuBLAS's fixed
    workspace unless the user exported one, cuDNN without autotuning; the returned function
    puts back exactly what was there (tests and notebooks run trainers in-process)."""
    import torch

    from tape_train.precision import CUBLAS_WORKSPACE, deterministic_algorithms

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    restore = deterministic_algorithms(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        restore()
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.backends.cudnn.deterministic
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own choice is kept
    restore = deterministic_algorithms(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    restore()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    deterministic_algorithms(False)()  # off: nothing changes
    assert not torch.are_deterministic_algorithms_enabled()


def test_flash_backend_asks_for_the_deterministic_backward(monkeypatch):
    """flash-attn's backward adds dq with atomics unless told `deterministic=True`: the
    backend passes torch's deterministic mode on (a stand-in flash_attn module records it)."""
    import types

    import torch

    from tape_train.model.attention import flash_attention
    from tape_train.precision import deterministic_algorithms

    seen = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, alibi_slopes=None,
                        deterministic=False):
        seen.append(deterministic)
        return q

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_func=flash_attn_func))
    q = torch.zeros(1, 2, 4, 8)
    flash_attention(q, q, q)
    restore = deterministic_algorithms(True)
    try:
        flash_attention(q, q, q)
    finally:
        restore()
    assert seen == [False, True]


def test_the_plans_cpu_peak_is_measured_with_the_threads_each_rank_gets(monkeypatch):
    """--dry-run's step time on CPU: each rank's peak with the threads a run started now gives
    it (idle cores / ranks), not the dry run's own (every core: on a busy 2-core machine
    a 2-thread GEMM measured 40x below a 1-thread one), and ranks beyond the cores share them
    (4 ranks on 2 cores are not 4 times one rank's peak)."""
    import torch

    from tape_train import cpu_threads
    from tape_train.train import peak

    idle = {"cores": 2.0}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(machine_cache, "usable_cpus", lambda: 2)
    monkeypatch.setattr(cpu_threads, "usable_cpu_ids", lambda: [0, 1])
    monkeypatch.setattr(cpu_threads, "idle_cores", lambda cpus, *args, **kw: idle["cores"])
    # a GEMM peak proportional to the threads it ran with (the thread count is the subject)
    monkeypatch.setattr(peak, "measure_gemm_peak_tflops",
                        lambda dtype, budget_s=1.0: 0.1 * torch.get_num_threads())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert peak.cpu_rank_peak_tflops(torch.float32, 1)[0] == pytest.approx(0.2)
        four, source = peak.cpu_rank_peak_tflops(torch.float32, 4)
        assert four == pytest.approx(0.1 * 2 / 4) and "4 rank(s) of 1 thread(s) share 2" in source
        idle["cores"] = 0.9  # another process keeps a core busy: a run now takes 1 thread
        assert peak.cpu_rank_peak_tflops(torch.float32, 1)[0] == pytest.approx(0.1)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
        assert peak.cpu_rank_peak_tflops(torch.float32, 1)[0] == pytest.approx(0.2)
        assert torch.get_num_threads() == 2  # the dry run's own threads are left as they were
    finally:
        torch.set_num_threads(before)


def test_a_damaged_cached_peak_is_measured_again(tmp_path):
    """An entry json reads as Infinity (or 0, or negative) is not a peak: every MFU against an
    infinite one would be 0. It is measured again and the entry replaced."""
    import json

    path = machine_cache.cache_dir() / "measurements.json"
    path.parent.mkdir(parents=True)
    key = f"x/{machine_cache.machine_key()}/k"
    for damaged in ("Infinity", "0", "-1.5"):
        path.write_text(f'{{"{key}": {damaged}}}')
        assert machine_cache.cached("x", "k", lambda: 0.25) == (0.25, False)
        assert json.loads(path.read_text())[key] == 0.25
    assert machine_cache.cached("x", "k", lambda: 9.0) == (0.25, True)  # control: kept now


def test_a_cpu_peak_measured_on_a_busy_machine_is_flagged(monkeypatch):
    """Measured under load, the GEMM peak may be low and every MFU against it too high: the
    trainer gets a flag (it warns and records it in the start event), and the peak is not
    cached. Measured on an idle machine: no flag, cached."""
    import torch

    from tape_train.train import peak as peak_module

    monkeypatch.setattr(peak_module, "measure_gemm_peak_tflops", lambda dtype: 0.125)
    monkeypatch.setattr(peak_module, "busy_cpu", lambda: "load 9.0 on 2 cores")
    cpu = torch.device("cpu")
    peak, source, low = peak_module.device_peak_tflops(cpu, torch.float32, None)
    assert (peak, low) == (0.125, True) and "may be low" in source
    assert peak_module.device_peak_tflops(cpu, torch.float32, None)[2]  # still not cached
    # A configured peak is the user's word: no flag even on a busy machine.
    assert peak_module.device_peak_tflops(cpu, torch.float32, 2.0) == (
        2.0, "logging.peak_tflops", False)
    monkeypatch.setattr(peak_module, "busy_cpu", lambda: None)  # negative control: idle
    assert peak_module.device_peak_tflops(cpu, torch.float32, None) == (
        0.125, f"measured float32 GEMM peak, {torch.get_num_threads()} thread"
        f"{'s' * (torch.get_num_threads() != 1)}", False)
    peak, source, low = peak_module.device_peak_tflops(cpu, torch.float32, None)
    assert (peak, low) == (0.125, False) and source.startswith("cached")
    # Once cached, a busy machine no longer matters: the idle measurement is used.
    monkeypatch.setattr(peak_module, "busy_cpu", lambda: "load 9.0 on 2 cores")
    assert peak_module.device_peak_tflops(cpu, torch.float32, None)[2] is False


def test_the_console_shows_an_mfu_against_a_possibly_low_peak_as_an_upper_bound():
    from tape_train.train.metrics import format_summary

    m = {"loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.412,
         "step_time_s": 0.2, "data_wait_frac": 0.0, "tokens_seen": 1000}
    assert "| mfu <=41.2% |" in format_summary(1, 10, m, mfu_at_most=True)
    assert "| mfu 41.2% |" in format_summary(1, 10, m)  # control: a trusted peak
