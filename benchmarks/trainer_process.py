"""A benchmark's object in its own spawned process, and the Trainer set-up the benchmarks share.

``Child(name, log, factory, *args)`` builds ``factory(*args)`` in a fresh interpreter (spawned:
nothing inherited, so ``ru_maxrss`` there is that object's own peak) and runs its methods when
the parent ``call``s them. The child's stdout/stderr go to ``log``; a failure or a dead child
raises ``BenchmarkError`` with the traceback or the log's tail.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import time
import traceback
from pathlib import Path


class BenchmarkError(RuntimeError):
    """A measurement could not be made; the message says which and where its log is."""


def _serve(conn, log_path: str, factory, args: tuple) -> None:
    """Body of a child: build ``factory(*args)``, then run its methods on request."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # A parent that stops waiting sends SIGUSR1 first: every thread's stack goes to the log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        obj = factory(*args)
        conn.send(("ok", None))
        while True:
            method, method_args = conn.recv()
            if method == "stop":
                obj.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", getattr(obj, method)(*method_args)))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        conn.send(("error", traceback.format_exc()))


class Child:
    """``factory(*args)`` built in a fresh spawned interpreter (its peak RSS is its own),
    whose methods the parent calls one at a time. Output goes to ``log_path``.

    Construction returns at once; ``result()`` waits for the object to be ready (``timeout``:
    give up after that many seconds, with the child's stacks and log tail in the error)."""

    def __init__(self, name: str, log_path: Path, factory, *args) -> None:
        ctx = mp.get_context("spawn")
        self.name, self.log_path = name, log_path
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_conn, str(log_path), factory, args),
                                daemon=True)
        self.proc.start()
        child_conn.close()

    def call(self, method: str, *args, timeout: float | None = None):
        self.conn.send((method, args))
        return self.result(timeout)

    def result(self, timeout: float | None = None):
        give_up = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                self._died()
            if give_up is not None and time.monotonic() >= give_up:
                self._stuck(timeout)
        try:
            status, value = self.conn.recv()
        except EOFError:
            self._died()
        if status == "error":
            raise BenchmarkError(f"{self.name} failed:\n{value}(log: {self.log_path})")
        return value

    def _died(self):
        self.proc.join(5)
        code = self.proc.exitcode
        why = "killed by SIGKILL (out of memory?)" if code == -9 else f"exit code {code}"
        tail = self._log_tail(15)
        raise BenchmarkError(f"{self.name} died ({why}); last lines of {self.log_path}:\n{tail}")

    def _stuck(self, timeout: float):
        """No answer in ``timeout`` s: the child dumps its stacks into its log (SIGUSR1), and
        the error carries them; the child is left for ``close``."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
        tail = self._log_tail(40)
        raise BenchmarkError(f"{self.name}: no answer in {timeout:.0f} s (stuck or too slow); "
                             f"its stacks and last lines of {self.log_path}:\n{tail}")

    def _log_tail(self, lines: int) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:  # the child ended or was stopped before it opened its log
            return "(no log: the child never opened it)\n"
        return "".join(text.splitlines(True)[-lines:])

    def close(self, timeout: float = 60.0) -> None:
        """Stop the child: asked politely (``timeout`` s), then terminated."""
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=timeout)
                self.proc.join(30)
            except (BenchmarkError, OSError):
                pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build_trainer(recipe: Path, overrides: list[str]):
    from tape_train.config import load_run_config
    from tape_train.train.loop import Trainer

    trainer = Trainer(load_run_config(recipe, overrides))
    trainer.setup()
    return trainer


def trainer_overrides(size: str, pe: str, seq_len: int, micro_batch: int, run_dir: Path
                      ) -> list[str]:
    from tape_train.model import load_model_config

    max_len = max(seq_len, load_model_config(size).max_seq_len)
    return [f"model.base={size}", f"model.pe={pe}", f"model.max_seq_len={max_len}",
            f"train.seq_len={seq_len}", f"train.micro_batch_size={micro_batch}",
            "train.grad_accum_steps=1", "train.synthetic_data=true", f"train.run_dir={run_dir}",
            "train.max_steps=1000000", "eval.interval=0", "logging.tensorboard=false",
            "logging.progress_bar=false",
            # The parent measures the GEMM peak; each worker measuring its own would cost time.
            "logging.peak_tflops=1.0"]
