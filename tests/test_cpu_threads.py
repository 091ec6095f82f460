"""OpenMP threads per CPU process chosen from the cores idle now (tape_train/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tape_train import cpu_threads
from tape_train.cpu_threads import choose_threads, idle_cores
from tape_train.machine_cache import usable_cpu_ids

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("processes, cores, idle, threads", [
    (1, 2, 2.0, 2),    # quiet: a thread per core
    (1, 2, 1.9, 2),
    (1, 2, 1.0, 1),    # another process keeps a core busy: 2 threads were 1.75x slower
    (1, 2, 0.0, 1),    # never fewer than one
    (2, 2, 2.0, 1),    # never more than a process's share
    (4, 16, 16.0, 4),
    (4, 16, 8.0, 2),
    (4, 16, 1.0, 1),
    (1, 8, None, 8),   # not measurable: the share, as before
    (3, 8, None, 2),
])
def test_threads_follow_the_idle_cores_within_a_processs_share(processes, cores, idle, threads):
    choice = choose_threads(processes, cores, idle)
    assert choice.threads == threads
    assert ("fewer than the" in choice.reason) == (threads < max(1, cores // processes))


def test_more_processes_than_cores_is_said():
    assert "more processes than cores" in choose_threads(5, 2, 2.0).reason
    assert "more processes than cores" in choose_threads(3, 2, None).reason
    assert "more processes than cores" not in choose_threads(2, 2, 2.0).reason


def test_no_processes_is_an_error():
    with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
        choose_threads(0, 2, 2.0)


def _stat(busy: dict[int, int], idle: dict[int, int]) -> str:
    lines = ["cpu  999 0 999 999 0 0 0 0 0 0"]  # the machine's sum: not read
    lines += [f"cpu{c} {busy[c]} 0 0 {idle[c]} 0 0 0 0 0 0" for c in sorted(busy)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"


def test_idle_cores_counts_only_the_cpus_this_process_may_use(tmp_path, monkeypatch):
    """Between two /proc/stat samples cpu0 was busy, cpu1 idle, cpu2 busy but not ours."""
    stat = tmp_path / "stat"
    stat.write_text(_stat({0: 100, 1: 100, 2: 100}, {0: 100, 1: 100, 2: 100}))
    later = _stat({0: 200, 1: 100, 2: 200}, {0: 100, 1: 200, 2: 100})
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda s: stat.write_text(later))
    assert idle_cores([0, 1], stat_path=str(stat)) == pytest.approx(1.0)
    stat.write_text(_stat({0: 100, 1: 100, 2: 100}, {0: 100, 1: 100, 2: 100}))
    assert idle_cores([1], stat_path=str(stat)) == pytest.approx(1.0)
    assert idle_cores([7], stat_path=str(stat)) is None       # none of them listed
    # some not listed (a container numbering its CPUs otherwise): unknown, not scaled up from
    # the listed ones
    assert idle_cores([1, 7], stat_path=str(stat)) is None
    assert idle_cores([0], stat_path=str(tmp_path / "missing")) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc/stat")
def test_a_core_kept_busy_is_not_counted_idle():
    """Whatever else the machine does, a spinning child (on a CPU of ours: it inherits the
    affinity) keeps at least half a core of the sampled time."""
    cpus = usable_cpu_ids()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        idle = idle_cores(cpus, sample_s=0.5)
    finally:
        spin.kill()
        spin.wait()
    assert idle is not None and 0.0 <= idle <= len(cpus) - 0.5, idle


def test_local_sh_chooses_the_threads_and_keeps_a_value_set(tmp_path):
    """launch/local.sh without OMP_NUM_THREADS asks tape_train.cpu_threads and says so in one
    line; a value the caller set is passed on unchanged, without that line."""
    seen = tmp_path / "omp"
    python = tmp_path / "python"  # the real interpreter for the choice, a stand-in trainer
    python.write_text(f'#!/bin/bash\nif [[ "$2" == tape_train.cpu_threads ]]; then exec '
                      f'{sys.executable} "$@"; fi\necho "$OMP_NUM_THREADS" > {seen}\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHON=str(python), TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))
    script = [str(REPO / "launch" / "local.sh"), "1", "--config", "x.yaml"]
    proc = subprocess.run(["bash", *script], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    threads = int(seen.read_text())
    assert 1 <= threads <= len(usable_cpu_ids())
    assert f"local.sh: OMP_NUM_THREADS={threads} per process (" in proc.stderr
    assert "core(s) idle over 0.5 s, 1 process(es)" in proc.stderr
    env["OMP_NUM_THREADS"] = "3"  # control: the caller's value wins
    proc = subprocess.run(["bash", *script], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and seen.read_text() == "3\n", proc.stderr
    assert "OMP_NUM_THREADS" not in proc.stderr


def test_the_trainer_started_by_hand_on_cpu_sets_the_chosen_threads(monkeypatch, caplog):
    import logging

    import torch

    from tape_train.train.loop import Trainer

    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "threads_for",
                        lambda processes: cpu_threads.ThreadChoice(1, f"{processes} stand-in"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # pytest-xdist workers set it
    try:
        with caplog.at_level(logging.INFO, logger="tape_train"):
            Trainer._choose_cpu_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert ("CPU threads per process: 1 (1 stand-in; set OMP_NUM_THREADS to choose)"
            in caplog.text)


@pytest.mark.parametrize("value, chosen, warned", [
    (None, False, False), ("", False, False),
    ("3", True, False), (" 2", True, False), ("4,2", True, False), ("02", True, False),
    # libgomp ignores these ("Invalid value for environment variable OMP_NUM_THREADS") and
    # takes a thread per core: no choice of the user's
    ("abc", False, True), ("0", False, True), ("1.5", False, True), ("-1", False, True),
])
def test_only_a_value_openmp_reads_is_the_user_s_choice(monkeypatch, value, chosen, warned):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    got, warning = cpu_threads.user_threads()
    assert got == chosen and (warning is not None) == warned
    if warned:
        assert f"OMP_NUM_THREADS={value!r} is not a number of threads" in warning


def test_local_sh_chooses_over_a_value_openmp_cannot_read(tmp_path):
    """OMP_NUM_THREADS=abc was passed on: libgomp ignored it, a thread per core."""
    seen = tmp_path / "omp"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nif [[ "$2" == tape_train.cpu_threads ]]; then exec '
                      f'{sys.executable} "$@"; fi\necho "$OMP_NUM_THREADS" > {seen}\n')
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), TMPDIR=str(tmp_path), PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="abc")
    script = [str(REPO / "launch" / "local.sh"), "1", "--config", "x.yaml"]
    proc = subprocess.run(["bash", *script], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text().strip().isdigit(), seen.read_text()
    assert "OMP_NUM_THREADS='abc' is not a number of threads" in proc.stderr
    assert "core(s) idle over 0.5 s, 1 process(es)" in proc.stderr
    env["OMP_NUM_THREADS"] = "4,2"  # control: OpenMP's nested form is the caller's choice
    proc = subprocess.run(["bash", *script], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and seen.read_text() == "4,2\n", proc.stderr
    assert "OMP_NUM_THREADS" not in proc.stderr


@pytest.fixture
def one_thread_chosen(monkeypatch):
    """threads_for stubbed to 1; torch's threads restored after the test."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "threads_for",
                        lambda processes: cpu_threads.ThreadChoice(1, f"{processes} stand-in"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


def test_tape_eval_on_cpu_chooses_the_threads_too(tmp_path, caplog, monkeypatch,
                                                  one_thread_chosen):
    """Measured on 2 cores with one kept busy: the demo's evaluation took 30-36 s with a
    thread per core and 5-11 s with one."""
    import logging

    import torch

    from tape_train.eval.cli import main
    from test_eval_reports_cli import make_checkpoint

    make_checkpoint(tmp_path / "run", "tape", seed=1)
    torch.set_num_threads(2)
    args = ["--checkpoint", str(tmp_path / "run"), "--lengths", "8", "--max-tokens", "16",
            "--device", "cpu", "--no-progress", "--out", str(tmp_path / "out")]
    with caplog.at_level(logging.INFO, logger="tape_train.eval"):
        assert main(args) == 0
    assert torch.get_num_threads() == 1
    assert "CPU threads per process: 1 (1 stand-in; set OMP_NUM_THREADS to choose)" \
        in caplog.text
    caplog.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # control: the user's value wins
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="tape_train.eval"):
        assert main(args) == 0
    assert torch.get_num_threads() == 2 and "CPU threads" not in caplog.text


def test_tape_generate_on_cpu_chooses_the_threads_too(tmp_path, capsys, monkeypatch,
                                                      one_thread_chosen):
    """Measured as above: 1000 sampled tokens took 17-26 s with two threads, 6-9 s with one."""
    from tape_train.inference.generate import main

    args = [str(tmp_path / "nowhere"), "--prompt", "x", "--device", "cpu"]
    monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    assert main(args) == 1  # no model there: after the choice
    err = capsys.readouterr().err
    assert "tape-generate: OMP_NUM_THREADS='abc' is not a number of threads" in err
    assert "tape-generate: CPU threads per process: 1 (1 stand-in; set OMP_NUM_THREADS to " \
           "choose)" in err
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # control
    assert main(args) == 1
    assert "CPU threads" not in capsys.readouterr().err
