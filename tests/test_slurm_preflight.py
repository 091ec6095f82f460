"""Per-node start-up checks (python -m tape_train.cluster.preflight), in-process and fast.

Each failing check is provoked for real (an impossible free-space requirement, GPUs on a CPU
machine, a run directory under a regular file, a module that does not exist) and must name the
node; the same invocation with sane values is the positive control.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from tape_train.cluster import preflight


@contextlib.contextmanager
def _held_port(monkeypatch, addr: str):
    """A port on 127.0.0.1 held by a listening socket, exported as the rendezvous at ``addr``
    (MASTER_ADDR, MASTER_PORT) until the block ends; yields the port."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", addr)
        monkeypatch.setenv("MASTER_PORT", str(port))
        yield port


def run_preflight(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = preflight.main(args)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def node_name(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-17")


def test_all_checks_pass_on_a_sane_node(tmp_path):
    rc, out, err = run_preflight(["--run-dir", str(tmp_path / "run"), "--min-free-gb", "0.001"])
    assert rc == 0, err
    assert "[preflight gpu-node-17] all 5 start-up checks passed" in out
    assert "CPU node: no GPUs requested" in out
    assert (tmp_path / "run").is_dir() and not list((tmp_path / "run").iterdir())


def test_run_dir_comes_from_the_training_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Synthetic data: this test is about the run dir (the input checks have their own tests).
    (tmp_path / "run.yaml").write_text("model: tiny\ntrain:\n  run_dir: runs/from-config\n"
                                       "  synthetic_data: true\n")
    rc, out, err = run_preflight(["--min-free-gb", "0", "--", "--config", "run.yaml",
                                  "train.run_dir=runs/from-override"])
    assert rc == 0, err
    assert f"run dir writable: {tmp_path / 'runs' / 'from-override'}" in out


def test_bad_training_arguments_fail_naming_the_node(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_preflight(["--", "--config", "missing.yaml"])
    assert rc == 1
    assert "[preflight gpu-node-17] FAILED: cannot determine the run directory" in err
    assert "missing.yaml" in err


@pytest.mark.parametrize("args, message", [
    (["--confg", "run.yaml"], "the following arguments are required: --config"),
    (["--config", "run.yaml", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_rejected_training_arguments_say_what_tape_train_says(tmp_path, monkeypatch, args,
                                                                message):
    # argparse's error line, not the usage or a hint printed after it.
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_preflight(["--", *args])
    assert rc == 1
    assert f"tape-train would reject the arguments {args}: {message}" in err


def test_overrides_may_follow_options_as_for_tape_train(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("model: tiny\ntrain:\n  synthetic_data: true\n")
    rc, out, err = run_preflight(["--min-free-gb", "0", "--", "--config", "run.yaml",
                                  "train.max_steps=3", "--allow-config-change",
                                  "train.run_dir=runs/after-option"])
    assert rc == 0, err
    assert f"run dir writable: {tmp_path / 'runs' / 'after-option'}" in out


def test_run_dir_locked_by_another_run_fails_on_the_first_node_only(tmp_path, monkeypatch,
                                                                   fake_slurm):
    from tape_train.train.run_lock import LOCK_NAME

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text('{"host": "gpu-node-9", "pid": 4711, "slurm_job_id": "991", '
                                 '"slurm_restart_count": "0", "slurm_cluster": "hpc", '
                                 '"started": "2026-01-01T00:00:00Z"}')
    fake_slurm.squeue_prints("991 RUNNING")
    monkeypatch.setenv("SLURM_JOB_ID", "992")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "hpc")
    args = ["--run-dir", str(run), "--min-free-gb", "0"]
    for node_id, expect_rc in (("0", 1), ("1", 0)):   # rank 0 (which takes the lock) is on 0
        monkeypatch.setenv("SLURM_NODEID", node_id)
        rc, out, err = run_preflight(args)
        assert rc == expect_rc, (node_id, out, err)
    monkeypatch.setenv("SLURM_NODEID", "0")
    rc, out, err = run_preflight(args)
    assert (f"FAILED run dir writable: run directory {run} is in use by another run (host "
            f"gpu-node-9, pid 4711, Slurm job 991 (restart 0)") in err
    # No host can check another host's pid: Slurm is asked about the holder's job.
    assert "wait for that run to end; Slurm says job 991 is RUNNING" in err
    # A job SIGKILLed on another host leaves its lock; once Slurm says that job has ended, the
    # trainer takes the lock over, so the check passes.
    fake_slurm.squeue_prints("991 CANCELLED")
    rc, out, err = run_preflight(args)
    assert rc == 0, err
    assert "(no other run holds its lock)" in out
    # The previous incarnation of this same job left it: the trainer takes it over, so passes
    # (without asking Slurm).
    fake_slurm.squeue_prints("991 RUNNING")
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    rc, out, err = run_preflight(args)
    assert rc == 0, err
    assert "(no other run holds its lock)" in out


def test_not_enough_free_disk_fails_naming_node_and_amount(tmp_path):
    rc, out, err = run_preflight(["--run-dir", str(tmp_path), "--min-free-gb", "1e12"])
    assert rc == 1
    assert "[preflight gpu-node-17] FAILED free disk:" in err
    assert "below the 1e+12 GB required" in err
    assert "FAILED 1 of 5 start-up checks on node gpu-node-17: free disk" in err


def test_gpus_requested_but_not_visible_fails(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices; the check would pass")
    rc, out, err = run_preflight(["--run-dir", str(tmp_path), "--min-free-gb", "0",
                                  "--gpus-per-node", "8"])
    assert rc == 1
    assert "[preflight gpu-node-17] FAILED devices: 0 CUDA device(s) visible, 8 requested" in err


def test_unwritable_run_dir_fails(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    rc, out, err = run_preflight(["--run-dir", str(blocker / "run"), "--min-free-gb", "0"])
    assert rc == 1
    assert f"[preflight gpu-node-17] FAILED run dir writable: {blocker / 'run'}" in err


def test_missing_module_is_named():
    result = preflight.check_imports(("json", "tape_train_no_such_module"))
    assert not result.ok
    assert "cannot import tape_train_no_such_module (ModuleNotFoundError" in result.detail
    assert preflight.check_imports(("json",)).ok


def test_old_python_is_refused():
    assert not preflight.check_python(minimum=(99, 0)).ok
    assert preflight.check_python().ok


def test_node_name_falls_back_to_the_host_name(monkeypatch):
    import socket
    monkeypatch.delenv("SLURMD_NODENAME")
    assert preflight.node_name() == socket.gethostname()


def test_free_disk_is_measured_at_the_nearest_existing_parent(tmp_path):
    result = preflight.check_free_disk(tmp_path / "not" / "yet" / "created", 0.0)
    assert result.ok and f"free at {tmp_path}" in result.detail
    assert not Path(tmp_path / "not").exists()


def test_the_rendezvous_host_must_resolve_and_its_port_be_free_where_it_is_hosted(tmp_path,
                                                                                 monkeypatch):
    """train.sbatch exports MASTER_ADDR (the first node's name) and MASTER_PORT (from the job
    id) before the checks. A name that does not resolve on a node, or a port already taken on
    the host node (another job's rendezvous there: the port from the job id repeats every
    14998 jobs), failed only inside torchrun after the imports, the other nodes waiting for a
    store nobody hosts. Only the node of that name tries the port."""
    args = ["--run-dir", str(tmp_path / "run"), "--min-free-gb", "0"]
    monkeypatch.setenv("MASTER_ADDR", "no-such-node.invalid")
    monkeypatch.setenv("MASTER_PORT", "15123")
    rc, out, err = run_preflight(args)
    assert rc == 1
    assert ("[preflight gpu-node-17] FAILED rendezvous: the rendezvous host no-such-node.invalid, "
            "the first node of the job, does not resolve on gpu-node-17") in err
    with _held_port(monkeypatch, "localhost") as port:
        rc, out, err = run_preflight(args)          # another node: it only resolves the name
        assert rc == 0 and f"ok     rendezvous: localhost:{port} (" in out, err
        assert "all 6 start-up checks passed" in out
        monkeypatch.setenv("SLURMD_NODENAME", "localhost")
        rc, out, err = run_preflight(args)
        assert rc == 1
        assert (f"[preflight localhost] FAILED rendezvous: port {port} on localhost, where the "
                f"rendezvous is hosted, is taken (Address already in use)") in err
        assert "TAPE_MASTER_PORT=<free port>" in err
    rc, out, err = run_preflight(args)              # released: the same node passes
    assert rc == 0 and "hosted here, port free" in out, err


def test_the_node_hosting_the_rendezvous_is_the_one_named_not_its_address(tmp_path,
                                                                          monkeypatch):
    """train.sbatch exports the first node's NodeAddr as MASTER_ADDR (node names need not
    resolve) and its name as TAPE_RDZV_NODE: the node of that name hosts the store, and it
    is the one that checks the port, though MASTER_ADDR is an address and not its name."""
    args = ["--run-dir", str(tmp_path / "run"), "--min-free-gb", "0"]
    with _held_port(monkeypatch, "127.0.0.1") as port:
        monkeypatch.setenv("TAPE_RDZV_NODE", "gpu-node-17")
        rc, out, err = run_preflight(args)
        assert rc == 1
        assert (f"[preflight gpu-node-17] FAILED rendezvous: port {port} on gpu-node-17, where "
                f"the rendezvous is hosted, is taken") in err
        monkeypatch.setenv("TAPE_RDZV_NODE", "gpu-node-3")    # control: another node hosts it
        rc, out, err = run_preflight(args)
        assert rc == 0 and f"ok     rendezvous: 127.0.0.1:{port} (127.0.0.1)\n" in out, err
    monkeypatch.setenv("MASTER_ADDR", "no-such-node.invalid")
    rc, out, err = run_preflight(args)
    assert ("FAILED rendezvous: the rendezvous host no-such-node.invalid (the address of "
            "gpu-node-3), the first node of the job, does not resolve on gpu-node-17") in err


@pytest.mark.parametrize("device, fails", [("auto", True), ("cuda", True), ("cpu", False)])
def test_a_cpu_job_on_a_node_showing_gpus_fails_unless_the_run_says_cpu(tmp_path, monkeypatch,
                                                                        device, fails):
    """--gpus-per-node 0 (tape-submit's default) where the node shows CUDA devices anyway (GPUs
    not confined to their jobs, or given by default): with train.device auto the trainer
    computes on cuda:<local rank>, one GPU per node, maybe another job's. The check said
    "CPU node: ... training on CPU with gloo". This machine has no GPU: torch is told it has 4."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(f"model: tiny\ntrain:\n  device: {device}\n"
                                       "  synthetic_data: true\n")
    result = preflight.run_checks(tmp_path / "run", 0, 0.0, "gpu-node-17",
                                  ["--config", "run.yaml"])[2]
    assert result.name == "devices" and result.ok is not fails, result
    if fails:
        assert result.detail.startswith(
            "4 CUDA device(s) visible (CUDA_VISIBLE_DEVICES=0,1,2,3) but none requested: the "
            f"trainer (train.device={device}) would compute on cuda:0") and \
            "--gpus-per-node N" in result.detail, result.detail
    else:
        assert "CPU node: no GPUs requested" in result.detail
    # Another --train-module (no trainer arguments to read): reported, not judged.
    assert preflight.run_checks(tmp_path / "run", 0, 0.0, "gpu-node-17")[2].ok
