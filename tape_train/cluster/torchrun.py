"""``python -m tape_train.cluster.torchrun ARGS``: torchrun (``torch.distributed.run``) with
the same arguments, whose report of a failed worker is printed without the Python traceback
torchrun wraps it in.

That report ("Root Cause": the rank that failed first, its host and exit code) is what to
read; the workers' own lines above it say why (a bad input is one line), so the 25-line
``ChildFailedError`` traceback under it says nothing more. Used by ``launch/local.sh`` and
``launch/slurm/eval.sbatch``; the exit code is torchrun's (1 when a worker failed).
"""

from __future__ import annotations

import sys


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    sys.argv[0] = "torchrun"
    try:
        torchrun()
    except ChildFailedError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
