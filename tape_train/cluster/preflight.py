"""Per-node start-up checks, run on every node (srun --ntasks-per-node=1) before training.

    python -m tape_train.cluster.preflight [--gpus-per-node N] [--procs-per-node P]
        [--min-free-gb G] [--run-dir DIR] [--train-module M] [-- --config <yaml> key=value ...]

Checks: the Python version, that the training packages import, that the node sees the GPUs
requested (or says it is a CPU node), that the run directory is writable (and, on the node of
rank 0, not locked by another run: ``RUN.lock``) and has free space, that the rendezvous host
train.sbatch exports (MASTER_ADDR) resolves here (and, on that node, that its port is free),
and, given the training arguments, the trainer's own input checks as this node sees them
(``tape_train.train.preflight``: tokenizer, data files, held-out lengths, the job's layout).
The run directory is `--run-dir`, or `train.run_dir` of the training arguments after `--`.
Every line starts with `[preflight <node>]` (the node is SLURMD_NODENAME, else the host name)
so a failure in a multi-node log names its node; any failed check makes the exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Keep in step with requires-python in pyproject.toml.
MIN_PYTHON = (3, 10)
# What the trainer imports on start-up: a node missing any of these fails here, in seconds,
# instead of inside torchrun after the other nodes have reached the rendezvous.
REQUIRED_MODULES = ("torch", "deepspeed", "yaml", "tape_train", "tape_train.config")


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


def node_name() -> str:
    """The Slurm node this runs on (several "nodes" may share a host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def check_python(minimum: tuple[int, int] = MIN_PYTHON) -> CheckResult:
    version = ".".join(map(str, sys.version_info[:3]))
    ok = sys.version_info[:2] >= minimum
    need = ".".join(map(str, minimum))
    return CheckResult("python", ok, f"{version} at {sys.executable} "
                       f"({'>=' if ok else 'older than'} {need})")


def check_imports(modules: tuple[str, ...] = REQUIRED_MODULES) -> CheckResult:
    found, missing = [], []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # any import failure is the finding, whatever its type
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
        else:
            version = getattr(module, "__version__", None)
            found.append(f"{name} {version}" if version else name)
    if missing:
        return CheckResult("imports", False, "cannot import " + "; ".join(missing))
    return CheckResult("imports", True, ", ".join(found))


def check_devices(gpus_per_node: int, train_device: str | None = None) -> CheckResult:
    """CUDA devices visible vs. requested. On CPU jobs, that the trainer will not take a GPU
    anyway: with ``train.device`` auto (``train_device``; None: not the trainer's) it computes
    on ``cuda:<local rank>`` wherever CUDA devices are visible (a node whose GPUs are not
    confined to their jobs, or given by default)."""
    try:
        import torch
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        return CheckResult("devices", False, f"cannot query CUDA devices: {exc}")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    if gpus_per_node == 0:
        if visible and train_device is not None and train_device != "cpu":
            return CheckResult("devices", False, f"{visible} CUDA device(s) visible "
                               f"(CUDA_VISIBLE_DEVICES={cvd}) but none requested: the trainer "
                               f"(train.device={train_device}) would compute on cuda:0, 1, ... "
                               f"(one per process) beside GPUs that may be another job's; ask "
                               f"for them (tape-submit --gpus-per-node N, sbatch "
                               f"--gpus-per-node=N) or set train.device=cpu")
        return CheckResult("devices", True, f"CPU node: no GPUs requested, training on CPU with "
                           f"gloo ({visible} CUDA device(s) visible, unused)")
    ok = visible >= gpus_per_node
    return CheckResult("devices", ok, f"{visible} CUDA device(s) visible, {gpus_per_node} "
                       f"requested (CUDA_VISIBLE_DEVICES={cvd})")


def check_rendezvous(node: str) -> CheckResult | None:
    """The rendezvous endpoint train.sbatch exports (MASTER_ADDR, MASTER_PORT; None without
    them; the address of the node TAPE_RDZV_NODE names, its NodeAddr or else its name): that
    it resolves on this node, and, on that node, which hosts the store, that nothing listens
    on the port yet. Either would otherwise show only after the imports, as torchrun's
    `RendezvousConnectionError`, with the other nodes waiting for a rendezvous nobody hosts
    (up to its join timeout, 600 s)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    host_node = os.environ.get("TAPE_RDZV_NODE") or host
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM)})
    except (OSError, UnicodeError) as exc:
        of = "" if host_node == host else f" (the address of {host_node})"
        return CheckResult("rendezvous", False, f"the rendezvous host {host}{of}, the first "
                           f"node of the job, does not resolve on {node} ({exc}): every node "
                           f"must resolve the node's NodeAddr, or without one its name "
                           f"(SLURM_JOB_NODELIST)")
    where = f"{host}:{port} ({', '.join(addresses)})"
    if node != host_node:
        return CheckResult("rendezvous", True, where)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the store binds it: a port left in TIME_WAIT by an earlier run is no obstacle.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port)))
        except OSError as exc:
            return CheckResult("rendezvous", False, f"port {port} on {node}, where the "
                               f"rendezvous is hosted, is taken ({exc.strerror}): by another "
                               f"job on this node or a service; give the job another one with "
                               f"TAPE_MASTER_PORT=<free port> in the environment it is "
                               f"submitted from")
    return CheckResult("rendezvous", True, f"{where}, hosted here, port free")


def check_run_dir_writable(run_dir: Path, node: str, check_lock: bool = False) -> CheckResult:
    """Create the run directory if needed and write, read back and remove a probe file.

    With ``check_lock`` (on the node of the trainer's rank 0, which takes the lock), also that
    no other run holds ``RUN.lock`` there: the trainer would refuse to start, after torchrun,
    the imports and the rendezvous."""
    probe = run_dir / f".preflight-{node}-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(node)
        if probe.read_text() != node:
            return CheckResult("run dir writable", False, f"{probe} did not read back")
        probe.unlink()
    except OSError as exc:
        return CheckResult("run dir writable", False, f"{run_dir}: {exc}")
    if check_lock:
        from tape_train.train.run_lock import lock_refusal

        refusal = lock_refusal(run_dir)
        if refusal is not None:
            return CheckResult("run dir writable", False, refusal)
        return CheckResult("run dir writable", True, f"{run_dir} (no other run holds its lock)")
    return CheckResult("run dir writable", True, str(run_dir))


def check_free_disk(run_dir: Path, min_free_gb: float) -> CheckResult:
    """Free space where the run directory is (or would be created), in GB of 10^9 bytes."""
    where = run_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free_gb = shutil.disk_usage(where).free / 1e9
    except OSError as exc:
        return CheckResult("free disk", False, f"{where}: {exc}")
    ok = free_gb >= min_free_gb
    return CheckResult("free disk", ok, f"{free_gb:.1f} GB free at {where} "
                       f"({'>=' if ok else 'below the'} {min_free_gb:g} GB required)")


def check_run_inputs(train_args: list[str], gpus_per_node: int, procs_per_node: int = 1,
                     check_resume: bool = False) -> CheckResult:
    """The trainer's own input checks (``tape_train.train.preflight``) as this node sees
    them: tokenizer, data files, held-out lengths, train.seq_len, the layout of the job;
    with ``check_resume`` (the first node) also whether the checkpoint it would resume from
    can continue on this job's layout (the trainer's refusal, before torchrun restarts it)."""
    try:
        from tape_train.train.preflight import RUN_START_LIMITS, run_preflight

        parsed, cfg = _load_run(train_args)
        world = int(os.environ.get("SLURM_NNODES", "1")) * (gpus_per_node or procs_per_node)
        report = run_preflight(cfg, world_size=world, gpus_per_node=gpus_per_node,
                               ranks_per_node=gpus_per_node or procs_per_node,
                               check_resume=check_resume, resume_from=parsed.resume_from,
                               allow_config_change=parsed.allow_config_change, plan=False,
                               limits=RUN_START_LIMITS)
    except Exception as exc:  # a broken config or install is this node's finding
        return CheckResult("run inputs", False, f"{type(exc).__name__}: {exc}")
    if report.problems:
        return CheckResult("run inputs", False, " | ".join(report.problems))
    return CheckResult("run inputs", True, f"config, layout (world {world}), tokenizer and data "
                       f"readable here")


def _load_run(train_args: list[str]):
    """The training arguments parsed, and the run config they load (raises as they do)."""
    from tape_train.cluster.run_args import parse_train_args
    from tape_train.config import load_run_config

    parsed = parse_train_args(train_args)
    return parsed, load_run_config(parsed.config, parsed.overrides)


def _train_device(train_args: list[str] | None) -> str | None:
    """``train.device`` of the run (None without the trainer's arguments, or when they do not
    load: the run-inputs check reports that)."""
    if not train_args:
        return None
    try:
        return _load_run(train_args)[1].train.device
    except Exception:  # reported, with its cause, by check_run_inputs
        return None


def run_checks(run_dir: Path, gpus_per_node: int, min_free_gb: float,
               node: str | None = None, train_args: list[str] | None = None,
               procs_per_node: int = 1) -> list[CheckResult]:
    node = node or node_name()
    # Rank 0, on node rank 0, takes the run lock and decides the resume (Slurm numbers the
    # job's nodes from 0).
    first_node = os.environ.get("SLURM_NODEID", "0") == "0"
    results = [
        check_python(),
        check_imports(),
        check_devices(gpus_per_node, _train_device(train_args)),
        check_run_dir_writable(run_dir, node, check_lock=first_node),
        check_free_disk(run_dir, min_free_gb),
    ]
    rendezvous = check_rendezvous(node)
    if rendezvous is not None:
        results.append(rendezvous)
    if train_args:
        results.append(check_run_inputs(train_args, gpus_per_node, procs_per_node,
                                        check_resume=first_node))
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tape_train.cluster.preflight",
                                description="Per-node start-up checks before training.")
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--min-free-gb", type=float, default=10.0)
    p.add_argument("--run-dir", type=Path, default=None,
                   help="default: train.run_dir from the training arguments after --")
    p.add_argument("--procs-per-node", type=int, default=1,
                   help="CPU nodes: trainer processes per node (for the job's layout)")
    p.add_argument("--train-module", default="tape_train.train.cli",
                   help="what torchrun will run; the trainer's input checks (tokenizer, data, "
                        "layout) run only for the trainer")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="-- --config <yaml> [key=value ...] (the tape-train arguments)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    node = node_name()
    prefix = f"[preflight {node}]"
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    start = time.monotonic()
    run_dir = args.run_dir
    if run_dir is None:
        try:
            from tape_train.cluster.run_args import resolve_run_dir
            run_dir = resolve_run_dir(train_args)
        except Exception as exc:  # a broken config or install: report it as this node's failure
            print(f"{prefix} FAILED: cannot determine the run directory from the training "
                  f"arguments {train_args}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    inputs = train_args if args.train_module == "tape_train.train.cli" else None
    results = run_checks(run_dir.resolve(), args.gpus_per_node, args.min_free_gb, node, inputs,
                         args.procs_per_node)
    for r in results:
        print(f"{prefix} {'ok    ' if r.ok else 'FAILED'} {r.name}: {r.detail}",
              file=sys.stdout if r.ok else sys.stderr, flush=True)
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"{prefix} FAILED {len(failed)} of {len(results)} start-up checks on node {node}: "
              f"{', '.join(failed)}", file=sys.stderr, flush=True)
        return 1
    print(f"{prefix} all {len(results)} start-up checks passed in "
          f"{time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
