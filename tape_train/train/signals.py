"""Stop requests from the outside world (Slurm pre-emption, Ctrl-C) → a clean checkpointed stop.

The handlers only set a flag (a signal can land inside a collective or a checkpoint write; the
only safe thing there is to remember it). At each step boundary the trainer calls
``StopRequest.agreed(all_reduce_max)`` so every rank sees the same decision at the same step,
then checkpoints and exits with ``exit_code``:

- SIGUSR1 / SIGTERM → 75 (EX_TEMPFAIL): the Slurm batch script requeues the job on 75.
- SIGINT (Ctrl-C)   → 130 (128 + SIGINT), the shell convention; a second Ctrl-C while the
  checkpoint is being written is ignored with a message (use SIGKILL to abandon it).

The first signal is acknowledged on stderr at once, saying what will happen and the exit code.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

EXIT_REQUEUE = 75
EXIT_INTERRUPTED = 130

# Encoded for the all-reduce: larger wins, so a requeue request (which asks the scheduler to
# continue the job) dominates an interrupt (which asks it to stop) when both arrive.
_NONE, _INTERRUPT, _REQUEUE = 0, 1, 2
_CODES = {_NONE: 0, _INTERRUPT: EXIT_INTERRUPTED, _REQUEUE: EXIT_REQUEUE}


class StopRequest:
    """Installs handlers for SIGUSR1, SIGTERM and SIGINT; restores the old ones on ``close``."""

    def __init__(self) -> None:
        self.local = _NONE
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        if self._previous:  # installed already: keep the original handlers to restore
            return self
        for sig, kind in ((signal.SIGUSR1, _REQUEUE), (signal.SIGTERM, _REQUEUE),
                          (signal.SIGINT, _INTERRUPT)):
            self._previous[sig] = signal.signal(sig, self._make_handler(kind))
        return self

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _make_handler(self, kind: int):
        def handler(signum, frame) -> None:
            name = signal.Signals(signum).name
            if self.local != _NONE and kind == _INTERRUPT:
                _say("tape-train: stop already requested; finishing the checkpoint "
                     "(SIGKILL abandons it)")
            elif self.local == _NONE:  # acknowledged at once: the stop may be a step, an
                # evaluation or a save away, and a silent Ctrl-C invites a second one
                _say(f"tape-train: {name} received: stopping at the next step boundary after "
                     f"writing a checkpoint (before the first step: at the next start-up "
                     f"phase, nothing to save); exit {_CODES[max(self.local, kind)]}")
            self.local = max(self.local, kind)
            self.signal_name = name
        return handler

    def agreed(self, all_reduce_max: Callable[[int], int]) -> int:
        """The exit code every rank agrees on (0: keep training). Collective: call on all ranks.

        ``all_reduce_max`` maps this rank's integer to the maximum over all ranks.
        """
        return _CODES[all_reduce_max(self.local)]


def _say(line: str) -> None:
    """One line on stderr from a signal handler: ``os.write``, unbuffered, because the handler
    may interrupt the main thread inside a write to ``sys.stderr`` (a log line), where
    ``print`` would raise "reentrant call" into whatever the trainer was doing."""
    rank = os.environ.get("RANK")  # torchrun's: each rank says it, tagged like its log lines
    try:
        os.write(2, (f"[rank{rank}] " if rank else "").encode() + (line + "\n").encode())
    except OSError:
        pass
