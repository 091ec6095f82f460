"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest

from tape_train.data.testing import train_small_tokenizer


def pytest_configure(config):
    """Share the cores between pytest-xdist's workers (``make test`` runs two): each worker's
    torch, and what it starts, gets cores / workers OpenMP threads unless OMP_NUM_THREADS is
    set. Two workers with torch's default of one thread per core each ran 4 threads on 2 cores,
    and OpenMP's barriers made compute-bound modules 1.2-2x slower than with one thread each.
    Tests that need a thread count set their own; one process (no xdist) keeps torch's default."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or not workers.isdigit() or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    from tape_train.machine_cache import usable_cpus

    threads = max(1, usable_cpus() // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(items):
    """Order whole modules longest first, so that ``make test``'s two workers (pytest-xdist,
    ``--dist loadfile``: one module at a time per worker, taken in this order) end close
    together: modules marked ``waits`` (most of their time spent waiting out timeouts, beside
    which the other worker computes), then those with a ``slow`` test, then the rest. Each group
    keeps the collection order, and each module the order of its tests. (Modules marked
    ``alone`` are not in that part: ``make test`` runs them afterwards in one process.)"""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)

    def rank(tests) -> int:
        if any(test.get_closest_marker("waits") for test in tests):
            return 0
        return 1 if any(test.get_closest_marker("slow") for test in tests) else 2

    items[:] = [test for tests in sorted(modules.values(), key=rank) for test in tests]


@pytest.fixture(scope="session", autouse=True)
def _temp_files_inside_pytest_basetemp(tmp_path_factory):
    """Point TMPDIR (this process's and every child's) into pytest's own temporary directory,
    which pytest prunes: what a killed torchrun or launch script leaves behind on purpose
    (torchelastic_* log dirs, exit-code files) then does not pile up in the machine's /tmp."""
    import os
    import tempfile

    tmp = tmp_path_factory.mktemp("TMPDIR", numbered=False)
    before, before_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(tmp), None
    yield tmp
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = before_tempdir


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A small sentencepiece tokenizer trained on real text (deterministic; read-only)."""
    return train_small_tokenizer(tmp_path_factory.mktemp("tok"))


class FakeSlurm:
    """Stand-in Slurm client commands, first on PATH: each is a small shell script whose body
    a test chooses (print a state, fail, hang) and which appends its arguments to ``calls``."""

    def __init__(self, bin_dir):
        self.bin_dir = bin_dir
        self.calls_file = bin_dir / "calls"

    def command(self, name: str, body: str) -> None:
        path = self.bin_dir / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{self.calls_file}"\n{body}\n')
        path.chmod(0o755)

    def squeue_prints(self, stdout: str) -> None:
        self.command("squeue", f"printf '{stdout}\\n'")

    @property
    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """Stand-in ``squeue``/``scontrol`` (none until a test writes one) first on PATH; outside
    any Slurm job, with squeue's own environment filters cleared."""
    import os

    bin_dir = tmp_path / "fake-slurm-bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    for name in list(os.environ):
        if name.startswith("SQUEUE_") or name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT",
                                                  "SLURM_CLUSTER_NAME", "SLURM_CLUSTERS"):
            monkeypatch.delenv(name)
    return FakeSlurm(bin_dir)
