"""Stop requests: handlers only set a flag; the agreed code is the max over ranks."""

from __future__ import annotations

import os
import signal

import pytest

from tape_train.train.signals import EXIT_INTERRUPTED, EXIT_REQUEUE, StopRequest


def _local_max(value: int) -> int:  # a one-rank all-reduce
    return value


@pytest.mark.parametrize("sig, code", [(signal.SIGUSR1, EXIT_REQUEUE),
                                       (signal.SIGTERM, EXIT_REQUEUE),
                                       (signal.SIGINT, EXIT_INTERRUPTED)])
def test_signal_sets_flag_and_maps_to_exit_code(sig, code):
    previous = signal.getsignal(sig)
    stop = StopRequest().install()
    try:
        assert stop.agreed(_local_max) == 0  # negative control: nothing received yet
        os.kill(os.getpid(), sig)            # handled synchronously by the main thread
        assert stop.agreed(_local_max) == code
        assert stop.signal_name == signal.Signals(sig).name
    finally:
        stop.close()
    assert signal.getsignal(sig) is previous


def test_requeue_wins_over_interrupt_across_ranks():
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(_local_max) == EXIT_INTERRUPTED
        # Another rank saw SIGUSR1: the all-reduce (max) makes everybody requeue.
        assert stop.agreed(lambda mine: max(mine, 2)) == EXIT_REQUEUE
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed(_local_max) == EXIT_REQUEUE
    finally:
        stop.close()


def test_the_first_signal_is_acknowledged_at_once_and_a_second_ctrl_c_is_ignored(capfd):
    stop = StopRequest().install()
    try:
        assert capfd.readouterr().err == ""  # negative control: nothing said before a signal
        os.kill(os.getpid(), signal.SIGINT)
        said = capfd.readouterr().err
        assert "SIGINT received: stopping at the next step boundary after writing a " \
               "checkpoint" in said and said.rstrip().endswith("exit 130"), said
        os.kill(os.getpid(), signal.SIGINT)
        assert "stop already requested" in capfd.readouterr().err
        assert stop.agreed(_local_max) == EXIT_INTERRUPTED
    finally:
        stop.close()
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert capfd.readouterr().err.rstrip().endswith("exit 75")
    finally:
        stop.close()


def test_under_torchrun_the_acknowledgement_names_the_rank(capfd, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert capfd.readouterr().err.startswith("[rank3] tape-train: SIGTERM received: ")
    finally:
        stop.close()
