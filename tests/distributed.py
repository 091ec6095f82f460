"""Real multi-process tests on CPU: ``run_distributed_test(fn, world_size=2, backend="gloo")``.

Each rank is a fresh *spawned* process (no state inherited from pytest), with the usual
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set and the
default process group initialised before ``fn(*args, **kwargs)`` runs. ``fn`` must be a
module-level function (it is pickled by reference).

What you get back: the list of return values, indexed by rank (they must be picklable).
What you get on failure: an ``AssertionError`` carrying every failing rank's full traceback;
``TimeoutError`` naming the ranks still running after ``timeout`` seconds (they are killed);
an error naming ranks that died without a Python exception (segfault, ``os._exit``). A port
collision at start-up (another test grabbed the port we picked) is retried with a new port.

Example::

    def _check_sum(scale):
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank() + 1)]) * scale
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_distributed_test(_check_sum, world_size=2, args=(2.0,)) == [6.0, 6.0]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["find_free_port", "run_distributed_test"]

_PORT_IN_USE_MARKERS = ("Address already in use", "EADDRINUSE", "address already in use")


def find_free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, backend: str,
           num_threads: int, env: dict[str, str], pg_timeout_s: float, results,
           args: tuple, kwargs: dict) -> None:
    """Body of one rank: environment, process group, ``fn``, report, tear down."""
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(num_threads))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(num_threads)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            value = fn(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle bytes: the queue's ForkingPickler would pass tensors as shared-memory
        # file descriptors, which vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_distributed_test(fn: Callable[..., Any], world_size: int = 2, backend: str = "gloo", *,
                         args: tuple = (), kwargs: dict | None = None, timeout: float = 180.0,
                         num_threads: int = 1, env: dict[str, str] | None = None,
                         port_retries: int = 2) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return values by rank.

    Args:
        fn: module-level function; runs after ``torch.distributed.init_process_group``.
        backend: ``gloo`` on CPU.
        timeout: seconds for the whole group; stragglers are killed and reported.
        num_threads: torch/OpenMP threads per rank (the CI machine has 2 cores).
        env: extra environment variables for the ranks.
        port_retries: new-port attempts when the rendezvous port was taken meanwhile.
    """
    for attempt in range(port_retries + 1):
        try:
            return _run_once(fn, world_size, backend, args, kwargs or {}, timeout, num_threads,
                             env or {})
        except _PortInUse:
            if attempt == port_retries:
                raise AssertionError("could not find a free rendezvous port after "
                                     f"{port_retries + 1} attempts") from None
    raise AssertionError("unreachable")


class _PortInUse(Exception):
    pass


def _run_once(fn, world_size, backend, args, kwargs, timeout, num_threads, env) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_child, name=f"rank{rank}", daemon=True,
                         args=(fn, rank, world_size, port, backend, num_threads, env,
                               max(timeout, 30.0), results, args, kwargs))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()

    import time

    deadline = time.monotonic() + timeout
    reports: dict[int, tuple[str, Any]] = {}
    try:
        while len(reports) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
                reports[rank] = (status, payload)
                continue
            except queue_module.Empty:
                pass
            # A rank that died without reporting (segfault, os._exit) never will: stop waiting.
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in reports]
            if dead:
                time.sleep(0.5)  # its report may still be in flight
                while True:
                    try:
                        rank, status, payload = results.get_nowait()
                        reports[rank] = (status, payload)
                    except queue_module.Empty:
                        break
                dead = [r for r in dead if r not in reports]
                for r in dead:
                    reports[r] = ("died", f"rank {r} exited with code {procs[r].exitcode} "
                                          f"without reporting (crash or os._exit)")
                # The others are probably blocked in a collective with the dead rank.
                if any(s != "ok" for s, _ in reports.values()):
                    break
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)

    errors = {r: payload for r, (status, payload) in reports.items() if status != "ok"}
    if any(marker in str(payload) for payload in errors.values()
           for marker in _PORT_IN_USE_MARKERS):
        raise _PortInUse()
    missing = [r for r in range(world_size) if r not in reports]
    if errors:
        detail = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
        hung = f" (ranks {missing} were still running and were killed)" if missing else ""
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed{hung}:\n{detail}")
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                           f"(deadlock in a collective?); they were killed")
    return [pickle.loads(reports[r][1]) for r in range(world_size)]
