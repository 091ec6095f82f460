"""tests/distributed.py itself: results by rank, child tracebacks, hangs and crashes."""

from __future__ import annotations

import pytest

from distributed import run_distributed_test


def _sum_of_ranks(scale: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(t)
    return t.item()


def _rank1_raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 would wait forever: the helper must not


def _rank0_crashes() -> None:
    import os

    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


@pytest.mark.distributed
def test_results_are_returned_by_rank():
    assert run_distributed_test(_sum_of_ranks, world_size=2, args=(2.0,)) == [6.0, 6.0]


@pytest.mark.distributed
def test_child_exception_is_reported_with_its_traceback():
    with pytest.raises(AssertionError) as err:
        run_distributed_test(_rank1_raises, world_size=2, timeout=60)
    text = str(err.value)
    assert "rank 1" in text and "ValueError: boom from rank one" in text
    assert "_rank1_raises" in text  # the child's traceback, not just the message


@pytest.mark.distributed
def test_crashed_rank_is_reported_and_the_rest_killed():
    with pytest.raises(AssertionError, match=r"rank 0 exited with code 3"):
        run_distributed_test(_rank0_crashes, world_size=2, timeout=60)
