"""Start-up of a run: the resolved dtype is recorded and kept on resume, MFU above 100 % is
reported as missing, a stop signal before the first step exits 75 with nothing written,
DeepSpeed builds no C++ op on CPU, and every command's --help/--version imports no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import run_distributed_test

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["model=tiny", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256",
             "model.tape_position_size=8", "train.seq_len=32", "train.micro_batch_size=2",
             "train.lr=1e-3", "train.warmup_steps=0", "train.device=cpu",
             "train.synthetic_data=true", "checkpoint.interval=100", "parallel.zero_stage=1",
             "logging.tensorboard=false", "eval.interval=0"]


def _startup_scenarios(run_dir: str, ext_dir: str) -> dict:
    import json
    import signal

    import yaml

    from tape_train.config import load_run_config
    from tape_train.train import loop
    from tape_train.train.checkpoint import find_latest_complete, read_marker
    from tape_train.precision import PrecisionChoice

    out: dict = {}
    resolved: list[str] = []

    def fake_machine(dtype):
        def resolve(requested, device_type="cpu"):
            resolved.append(dtype)
            return PrecisionChoice(dtype, "faked machine")
        return resolve

    def trainer(*extra):
        return loop.Trainer(load_run_config(None, OVERRIDES + [f"train.run_dir={run_dir}",
                                                               *extra]))

    # 1. `auto` on a machine that resolves to fp32; a peak far too low gives MFU >> 100 %.
    loop.resolve_dtype = fake_machine("fp32")
    out["first_code"] = trainer("train.max_steps=2", "logging.peak_tflops=1e-9").run()
    out["first_config_dtype"] = yaml.safe_load(
        Path(run_dir, "config.yaml").read_text())["train"]["dtype"]
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    out["guarded_mfu"] = [r.get("mfu") for r in records if r["kind"] == "train"]
    out["start_basis"] = [r["mfu_basis"] for r in records if r.get("event") == "start"][0]

    # 2. Resume on a machine where `auto` means bf16: keeps the checkpoint's fp32, not refused;
    #    a sensible peak gives an MFU in (0, 1]: a CPU peak measured (faked) on a busy machine,
    #    so the resume event flags it as possibly low.
    from tape_train import machine_cache
    from tape_train.train import peak

    os.environ[machine_cache.CACHE_ENV] = os.path.join(os.path.dirname(run_dir), "peak-cache")
    peak.busy_cpu = lambda: "load 9.0 on 2 cores"
    peak.measure_gemm_peak_tflops = lambda dtype: 1e6
    loop.resolve_dtype = fake_machine("bf16")
    resolved.clear()
    out["resume_code"] = trainer("train.max_steps=3").run()
    out["resolved_on_resume"] = list(resolved)
    out["resume_config_dtype"] = yaml.safe_load(
        Path(run_dir, "config.yaml").read_text())["train"]["dtype"]
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    out["resumed_mfu"] = [r.get("mfu") for r in records if r["kind"] == "train"][-1]
    out["resume_basis"] = [r["mfu_basis"] for r in records if r.get("event") == "resume"][-1]
    tag = find_latest_complete(run_dir)
    out["checkpoint_dtype"] = read_marker(tag)["dtype"]
    out["launch_dir"] = read_marker(tag)["launch_dir"]  # what relative data paths mean

    # 3. SIGTERM while DeepSpeed starts: exit 75 before the first step; the run is untouched.
    real_build_engine = loop.build_engine

    def build_engine_then_sigterm(*args, **kwargs):
        result = real_build_engine(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    loop.build_engine = build_engine_then_sigterm
    before = sorted(p.name for p in Path(run_dir, "checkpoints").iterdir())
    metrics_before = Path(run_dir, "metrics.jsonl").read_text()
    out["sigterm_code"] = trainer("train.max_steps=5").run()
    out["checkpoints_unchanged"] = before == sorted(
        p.name for p in Path(run_dir, "checkpoints").iterdir())
    out["metrics_unchanged"] = metrics_before == Path(run_dir, "metrics.jsonl").read_text()
    out["still_resumable_at"] = read_marker(find_latest_complete(run_dir))["step"]
    loop.build_engine = real_build_engine

    # 4. No C++ op was built on the way (the extensions dir of this process stays empty).
    import deepspeed.comm.comm as ds_comm

    out["shm_op"] = ds_comm.cdb.shm_comm_op
    out["extensions"] = sorted(os.listdir(ext_dir)) if os.path.isdir(ext_dir) else []
    return out


@pytest.mark.distributed
def test_dtype_resume_mfu_guard_and_stop_during_startup(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    [r] = run_distributed_test(_startup_scenarios, world_size=1,
                               args=(str(tmp_path / "run"), str(tmp_path / "ext")), timeout=300)
    assert r["first_code"] == 0 and r["first_config_dtype"] == "fp32"
    assert r["guarded_mfu"] == [None, None]            # 1e-9 TFLOP/s: MFU >> 100 %, not shown
    assert r["resume_code"] == 0
    assert r["resolved_on_resume"] == []              # auto kept the checkpoint's dtype ...
    assert r["resume_config_dtype"] == "fp32" and r["checkpoint_dtype"] == "fp32"  # ... fp32
    assert r["launch_dir"] == os.getcwd()
    assert 0 < r["resumed_mfu"] <= 1                  # negative control: a real peak shows MFU
    # What every MFU divides by is in the start/resume event; a peak measured under load is
    # flagged there (and warned about), a configured one is not.
    start, resume = r["start_basis"], r["resume_basis"]
    assert start["peak_tflops_per_rank"] == 1e-9 and start["peak_source"] == "logging.peak_tflops"
    assert start["peak_may_be_low"] is False and start["flops_per_token"] > 0
    assert resume["peak_tflops_per_rank"] == 1e6 and resume["peak_may_be_low"] is True
    assert "machine busy (load 9.0 on 2 cores)" in resume["peak_source"]
    assert r["sigterm_code"] == 75
    assert r["checkpoints_unchanged"] and r["metrics_unchanged"]
    assert r["still_resumable_at"] == 3
    assert r["shm_op"] is None and r["extensions"] == []


def _console_lines_of_every_rank(run_dir: str, cache_dir: str) -> dict:
    import contextlib
    import io
    import json

    import torch.distributed as dist

    from tape_train import machine_cache
    from tape_train.config import load_run_config
    from tape_train.train import loop, peak

    rank = dist.get_rank()
    os.environ[machine_cache.CACHE_ENV] = cache_dir
    # Rank 0 measures (a faked busy machine: the peak may be low, `mfu <=`); no other rank may.
    peak.busy_cpu = lambda: "load 9.0 on 2 cores"

    def measure(dtype):
        assert rank == 0, f"rank {rank} measured the peak"
        return 1e6

    peak.measure_gemm_peak_tflops = measure
    out: dict = {}
    for all_ranks in (True, False):  # False: the negative control, rank 0 alone prints
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = loop.Trainer(load_run_config(None, OVERRIDES + [
                f"train.run_dir={run_dir}-{all_ranks}", "train.max_steps=2",
                f"logging.all_ranks={str(all_ranks).lower()}", "logging.console_interval=1",
                "logging.progress_bar=false"])).run()
        out[all_ranks] = {"code": code, "lines": [line for line in stdout.getvalue().splitlines()
                                                  if "step " in line and "| loss" in line]}
        if rank == 0:
            records = [json.loads(line) for line in
                       Path(f"{run_dir}-{all_ranks}", "metrics.jsonl").read_text().splitlines()]
            out[all_ranks]["mfu"] = [r["mfu"] for r in records if r["kind"] == "train"]
    return out


@pytest.mark.distributed
def test_all_ranks_console_lines_carry_mfu(tmp_path, monkeypatch):
    """With `logging.all_ranks` every rank's line shows the MFU against rank 0's peak (sent
    once at start-up, flagged `<=` as rank 0's is); rank 0's lines and metrics are as without
    it, and without it the other ranks print no line (negative control)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    r0, r1 = run_distributed_test(_console_lines_of_every_rank, world_size=2,
                                  args=(str(tmp_path / "run"), str(tmp_path / "cache")),
                                  timeout=300)
    for rank, r in enumerate((r0, r1)):
        assert r[True]["code"] == r[False]["code"] == 0
        lines = r[True]["lines"]
        assert [line.split(" | ")[0] for line in lines] == [f"[rank{rank}] step 1/2",
                                                             f"[rank{rank}] step 2/2"], lines
        assert all(" | mfu <=" in line for line in lines), lines
    assert [line.split(" | ")[0] for line in r0[False]["lines"]] == ["step 1/2", "step 2/2"]
    assert all(" | mfu <=" in line for line in r0[False]["lines"])
    assert r1[False]["lines"] == []
    for all_ranks in (True, False):  # rank 0 writes the metrics either way
        assert len(r0[all_ranks]["mfu"]) == 2 and all(0 < m <= 1 for m in r0[all_ranks]["mfu"])


CLIS = ["tape-train", "tape-eval", "tape-export", "tape-generate", "tape-data",
        "tape-tokenizer", "tape-model", "tape-submit"]


def test_help_and_version_of_every_command_import_no_torch():
    code = """
import sys
from importlib.metadata import entry_points
eps = {e.name: e for e in entry_points(group="console_scripts") if e.name.startswith("tape-")}
for name in %r:
    for flag in ("--help", "--version"):
        sys.argv = [name, flag]
        try:
            eps[name].load()()
        except SystemExit as exc:
            assert exc.code in (0, None), (name, flag, exc.code)
        else:
            raise AssertionError((name, flag, "did not exit"))
print("TORCH" if "torch" in sys.modules else "NO-TORCH")
""" % (CLIS,)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in CLIS:
        assert f"{name} 0." in out.stdout, name           # every --version answered
        assert f"usage: {name}" in out.stdout or name == "tape-model", name
    assert out.stdout.strip().endswith("NO-TORCH"), out.stdout[-500:]


def test_a_leftover_build_lock_is_reported(tmp_path, caplog):
    import logging

    from tape_train.train.distributed import report_build_locks

    assert report_build_locks(tmp_path) == []                    # negative control
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    with caplog.at_level(logging.WARNING, logger="tape_train.train"):
        assert report_build_locks(tmp_path) == [lock]
    assert str(lock) in caplog.text and "delete this file" in caplog.text


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (``SigCgt`` in /proc/<pid>/status)."""
    import signal

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("SigCgt:")), 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_sigterm_while_importing_torch_exits_75_and_writes_nothing(tmp_path):
    """The CLI installs the stop handlers before the heavy imports: a SIGTERM that lands while
    torch and DeepSpeed are still importing ends the start-up with 75 (requeue), not a bare
    SIGTERM death (-15), and leaves no run directory behind."""
    import signal
    import time

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tape_train.train.cli", "--config", "demo",
         "train.synthetic_data=true", "train.dtype=fp32", "train.max_steps=2",
         "train.warmup_steps=0", f"train.run_dir={run_dir}", "eval.interval=0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_cli_installs_stop_handlers_before_importing_the_trainer(monkeypatch, tmp_path):
    """What the test above relies on, checked without timing: when ``tape-train`` imports the
    trainer module (torch, DeepSpeed), SIGTERM already has the trainer's handler, and that
    same stop flag is handed to the Trainer."""
    import signal
    import types

    from tape_train.train import cli

    seen = {}

    class FakeTrainer:
        def __init__(self, cfg, *, stop=None, **_):
            self.stop = stop

        def run(self):
            seen["stop_given"] = self.stop is not None
            if self.stop is not None:
                self.stop.close()  # give the test process its handlers back
            return 0

    class TrainerModule(types.ModuleType):
        def __getattr__(self, name):  # called by ``from tape_train.train.loop import Trainer``
            if name == "Trainer":
                seen["handler_at_import"] = signal.getsignal(signal.SIGTERM)
                return FakeTrainer
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, "tape_train.train.loop", TrainerModule("fake_loop"))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["--config", "demo", "train.synthetic_data=true",
                     f"train.run_dir={tmp_path / 'run'}"]) == 0
    assert seen["handler_at_import"] not in (signal.SIG_DFL, signal.SIG_IGN, None, before)
    assert seen["stop_given"]
    assert signal.getsignal(signal.SIGTERM) == before


def _collective_warnings() -> list[str]:
    """torch's deprecated collectives (what DeepSpeed's ZeRO calls) three times on one gloo
    rank, the warning registry reset before each call as it is during a step, with every
    warning shown; then another FutureWarning. Returns the messages shown."""
    import warnings

    import torch
    import torch.distributed as dist

    from tape_train.train.metrics import quiet_library_deprecations

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_deprecations()
        for _ in range(3):
            warnings.filterwarnings("default", message="unrelated")  # resets the registry
            dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))
            dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))
        warnings.warn("another deprecation", FutureWarning)
    return [str(w.message) for w in seen]


@pytest.mark.distributed
def test_the_deprecated_collectives_of_zero_print_no_warning_per_step():
    """Each rank printed DeepSpeed's use of torch's deprecated all_gather_into_tensor /
    reduce_scatter_tensor as a two-line FutureWarning at every step; the trainer ignores
    exactly those two (another FutureWarning is still shown)."""
    (shown,) = run_distributed_test(_collective_warnings, world_size=1, timeout=120)
    assert shown == ["another deprecation"]
