"""``python -m tape_train.cluster.torchrun ARGS``: torchrun (``torch.distributed.run``) with
the same arguments, whose report of a failed worker is printed without the Python traceback
torchrun wraps it in.

That report ("Root Cause": the rank that failed first, its host and exit code) is what to
read; the workers' own lines above it say why (a bad input is one line), so the 25-line
``ChildFailedError`` traceback under it says nothing more. Used by ``launch/local.sh`` and
``launch/slurm/eval.sbatch``; the exit code is torchrun's (1 when a worker failed). A stop to
be resumed (the workers checkpointed on SIGUSR1/SIGTERM and exited 75) is not reported as a
failure but in one line saying so.

torchrun itself stopped by a signal (Slurm's SIGTERM at a time limit or ``scancel``, Ctrl-C's
SIGINT in a terminal) passes it on to its workers and ends; that is one line here, naming the
signal, and exit code 128 + its number as for a process killed by it (torchrun: a 30-line
``SignalException`` traceback and exit 1). With ``TAPE_TRAIN_STOP_WITH_LAUNCHER=1`` (set by
``launch/local.sh``) the death of the process that started it is such a signal (SIGTERM).
"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    import os

    from tape_train.train.signals import WITH_LAUNCHER_ENV, stop_with_launcher

    if os.environ.get(WITH_LAUNCHER_ENV, "").strip() == "1":
        # Asked by launch/local.sh: its death (SIGKILL) is a SIGTERM here, which torchrun
        # passes on to the workers (which watch torchrun the same way).
        stop_with_launcher(os.getppid())
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    sys.argv[0] = "torchrun"
    try:
        torchrun()
    except ChildFailedError as exc:
        print(_planned_stop(exc) or exc, file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        number = int(exc.sigval)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        print(f"torchrun: stopped by {name}, which its workers were sent too", file=sys.stderr,
              flush=True)
        return 128 + number
    return 0


def _planned_stop(exc) -> str | None:
    """One line when the "failure" is a stop to be resumed (the first worker to end exited
    ``EXIT_REQUEUE`` after checkpointing on SIGUSR1/SIGTERM, and the others with it or by
    torchrun's SIGTERM), instead of a failure report blaming that worker."""
    from tape_train.train.signals import EXIT_REQUEUE

    first_rank, first = exc.get_first_failure()
    codes = {failure.exitcode for failure in exc.failures.values()}
    if first.exitcode != EXIT_REQUEUE or not codes <= {EXIT_REQUEUE, -signal.SIGTERM}:
        return None
    return (f"torchrun: the workers stopped to be resumed (rank {first_rank} exited "
            f"{EXIT_REQUEUE} after its checkpoint"
            f"{', the others with it' if len(exc.failures) > 1 else ''}); run the same command "
            f"again to continue")


if __name__ == "__main__":
    sys.exit(main())
