"""Stop a Slurm job that requeues itself without making progress.

train.sbatch asks this module before every ``scontrol requeue``::

    python -m tape_train.cluster.requeue_guard --max-stalled K -- <training arguments>

It finds the run directory from the training arguments (as the trainer will), looks at the
newest complete checkpoint there, and compares it with the one recorded at the previous
requeue of this job in ``<run_dir>/requeue_state.json``. An incarnation that ends without a
newer checkpoint is *stalled* (e.g. start-up alone takes longer than the time limit minus the
signal grace, so every incarnation is stopped before its first save). After K consecutive
stalled incarnations the answer is "stop", with the reason on one line.

Exit status: 0 requeue, 3 stop (the reason is printed), 2 the question could not be answered
(bad arguments, unreadable run directory; printed too): the script then requeues as before.

``--restart-verdict`` asks instead whether the trainer refused an in-job restart in this run of
the job (``tape_train.train.restarts``: it ends such a run with exit 0 so that torchrun stops
restarting): exit 0 no refusal, 3 refused, the job fails (the reason is printed), 4 refused
because the attempt had stopped on a signal: the job requeues.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tape_train.checkpoint_layout import newest_complete_tag

STATE_NAME = "requeue_state.json"
EXIT_REQUEUE, EXIT_ERROR, EXIT_STOP, EXIT_RESTART_REQUEUE = 0, 2, 3, 4


newest_checkpoint = newest_complete_tag  # the one notion of progress (restarts use it too)


def decide(run_dir: Path, job_id: str, restart: str, max_stalled: int) -> tuple[bool, str]:
    """``(requeue, one-line reason)``; records this incarnation in the state file."""
    from tape_train.files import write_atomic

    newest = newest_checkpoint(run_dir)
    state_path = run_dir / STATE_NAME
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        state = {}
    same_job = state.get("job_id") == job_id
    if state and state.get("newest_checkpoint") == newest:
        stalled = (int(state.get("stalled", 0)) if same_job else 0) + 1
    elif not state and newest is None:
        stalled = 1  # a first incarnation that saved nothing
    else:
        stalled = 0
    write_atomic(state_path, json.dumps({"job_id": job_id, "restart": restart,
                                         "newest_checkpoint": newest,
                                         "stalled": stalled}) + "\n")
    where = f"newest checkpoint {newest or 'none'} in {run_dir}"
    if stalled >= max_stalled:
        return False, (f"{stalled} consecutive restarts added no checkpoint ({where}); "
                       f"start-up probably takes longer than the time limit minus the signal "
                       f"grace, or the run fails before its first save: raise --time, lower "
                       f"checkpoint.interval, or look at the log above (limit "
                       f"TAPE_MAX_STALLED_REQUEUES={max_stalled})")
    if stalled:
        return True, f"no new checkpoint in this incarnation ({stalled} of {max_stalled} " \
                     f"allowed in a row; {where})"
    return True, f"progress: {where}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tape_train.cluster.requeue_guard")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--max-stalled", type=int)
    mode.add_argument("--restart-verdict", action="store_true")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        from tape_train.cluster.run_args import resolve_run_dir

        run_dir = resolve_run_dir(train_args)
        if args.restart_verdict:
            from tape_train.train.restarts import REQUEUE, read_verdict

            verdict = read_verdict(run_dir)
            if verdict is None:
                return EXIT_REQUEUE
            print(verdict[1])
            return EXIT_RESTART_REQUEUE if verdict[0] == REQUEUE else EXIT_STOP
        requeue, reason = decide(run_dir, os.environ.get("SLURM_JOB_ID", ""),
                                 os.environ.get("SLURM_RESTART_COUNT", "0"), args.max_stalled)
    except Exception as exc:  # noqa: BLE001 - any failure: say it, let the script requeue
        print(f"requeue guard: cannot tell whether the job progresses ({type(exc).__name__}: "
              f"{exc})")
        return EXIT_ERROR
    print(reason)
    return EXIT_REQUEUE if requeue else EXIT_STOP


if __name__ == "__main__":
    sys.exit(main())
