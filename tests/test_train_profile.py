"""Profiling a run (``profile`` section, ``tape_train.train.profiling``): traces of exactly the
configured steps and ranks, with the step annotations and phase labels; nothing at all when
off; nothing for a window the run did not finish; memory snapshots at a window's end and at a
CUDA out-of-memory error (the CUDA allocator faked: this machine has no GPU)."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest

from distributed import run_distributed_test

OVERRIDES = ["model=tiny", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256",
             "model.tape_position_size=8", "train.seq_len=32", "train.micro_batch_size=2",
             "train.grad_accum_steps=2", "train.warmup_steps=0", "train.device=cpu",
             "train.dtype=fp32", "train.synthetic_data=true", "parallel.zero_stage=1",
             "logging.tensorboard=false", "logging.progress_bar=false"]
LABELS = {"tape_train/" + name for name in ("data", "sync", "forward", "backward",
                                             "optimizer_step", "evaluation", "checkpoint")}


def _fake_cuda_allocator(history: list):
    """``torch.cuda.memory``'s history calls on a CPU machine: they record what was asked."""
    import torch

    from tape_train.train import profiling

    profiling.memory_history_supported = lambda device: True
    torch.cuda.memory._record_memory_history = (
        lambda enabled="all", **kwargs: history.append(("record", enabled, kwargs)))
    torch.cuda.memory._snapshot = lambda: {"segments": [], "history_calls": len(history)}


def _scenarios(root: str) -> dict:
    import os
    import signal

    import torch

    from tape_train.config import load_run_config
    from tape_train.train import loop

    labels: list[str] = []
    real_record_function = torch.profiler.record_function

    class CountingRecordFunction(real_record_function):
        def __init__(self, name, *args, **kwargs):
            labels.append(name)
            super().__init__(name, *args, **kwargs)

    torch.profiler.record_function = CountingRecordFunction
    rank = int(os.environ["RANK"])

    def run(name, *extra):
        cfg = load_run_config(None, OVERRIDES + [f"train.run_dir={root}/{name}", *extra])
        labels.clear()
        return loop.Trainer(cfg).run(), [n for n in labels if n.startswith("tape_train/")]

    out: dict = {}
    # 1. Rank 1 only; windows 2-3 and 5-6 after a warm-up step; evaluation and a checkpoint
    #    at step 3 (inside the first window).
    out["code"], out["labels"] = run(
        "on", "train.max_steps=7", "checkpoint.interval=3", "eval.interval=3",
        "eval.lengths=[32]", "profile.enabled=true", "profile.ranks=[1]",
        "profile.start_step=2", "profile.active_steps=2", "profile.warmup_steps=1",
        "profile.repeat=2", "profile.interval=3")

    # 2. Off: no file, and no record_function on the way.
    out["off_code"], out["off_labels"] = run("off", "train.max_steps=3", "eval.interval=2",
                                             "eval.lengths=[32]")

    # 3. A stop signal in the window's first step: the run ends inside it, nothing written.
    real_forward_backward = loop.forward_backward

    def stop_in_step_3(engine, micro_batches, **kwargs):
        if trainer_step() == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_forward_backward(engine, micro_batches, **kwargs)

    trainer_step = lambda: current["trainer"].state.step  # noqa: E731
    current: dict = {}
    loop.forward_backward = stop_in_step_3
    cfg = load_run_config(None, OVERRIDES + [f"train.run_dir={root}/cut", "train.max_steps=6",
                                             "profile.enabled=true", "profile.start_step=3",
                                             "profile.active_steps=2"])
    current["trainer"] = loop.Trainer(cfg)
    out["cut_code"] = current["trainer"].run()

    # 4. Out of CUDA memory in step 2 (allocator faked): the snapshot of the OOM is written.
    history: list = []
    _fake_cuda_allocator(history)

    def out_of_memory(engine, micro_batches, **kwargs):
        if current["trainer"].state.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward_backward(engine, micro_batches, **kwargs)

    loop.forward_backward = out_of_memory
    cfg = load_run_config(None, OVERRIDES + [f"train.run_dir={root}/oom", "train.max_steps=4",
                                             "profile.enabled=true", "profile.start_step=3",
                                             "profile.memory_snapshot=true",
                                             "profile.trace=false"])
    current["trainer"] = loop.Trainer(cfg)
    try:
        current["trainer"].run()
        out["oom_raised"] = False
    except torch.OutOfMemoryError:
        out["oom_raised"] = True
    out["oom_history"] = [call[1] for call in history]
    loop.forward_backward = real_forward_backward
    out["rank"] = rank
    return out


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.distributed
def test_a_profiled_run_traces_exactly_its_steps_and_ranks(tmp_path):
    results = run_distributed_test(_scenarios, world_size=2, args=(str(tmp_path),),
                                   timeout=300)
    for r in results:
        assert r["code"] == 0 and r["off_code"] == 0 and r["cut_code"] == 75, r
        assert r["oom_raised"], r
    # The allocator history: recorded on the profiled rank only, stopped after its snapshot.
    assert [r["oom_history"] for r in results] == [["all", None], []]

    # Exactly the configured windows, on exactly rank 1; nothing half-written beside them.
    assert _files(tmp_path / "on" / "profile") == ["step_2/rank1.pt.trace.json",
                                                   "step_5/rank1.pt.trace.json"]
    on_rank = {r["rank"]: r for r in results}
    assert on_rank[0]["labels"] == []                      # rank 0 does not profile ...
    assert set(on_rank[1]["labels"]) == LABELS             # ... rank 1 marks every phase
    for first in (2, 5):  # each window holds an evaluation and a checkpoint (steps 3 and 6)
        trace = json.loads((tmp_path / "on" / "profile" / f"step_{first}" /
                            "rank1.pt.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
        assert steps == [f"ProfilerStep#{first}", f"ProfilerStep#{first + 1}"]  # no warm-up
        assert trace["tape_train"] == {"first_step": first, "last_step": first + 1, "rank": 1}
        assert {n for n in names if n.startswith("tape_train/")} == LABELS

    # Off: no profile directory and not one record_function from the trainer.
    assert not (tmp_path / "off" / "profile").exists()
    assert all(r["off_labels"] == [] for r in results)
    # A window cut short by the stop after its first step writes nothing.
    assert _files(tmp_path / "cut" / "profile") == []
    # The out-of-memory snapshot, once per profiled rank (rank 0), after 1 completed step.
    assert _files(tmp_path / "oom" / "profile") == ["oom_after_step_1/memory_rank0.pickle"]
    snapshot = pickle.loads((tmp_path / "oom" / "profile" / "oom_after_step_1" /
                             "memory_rank0.pickle").read_bytes())
    assert snapshot == {"segments": [], "history_calls": 1}


# ------------------------------------------------------------------------------------------------
# The profiler on its own (no trainer): memory snapshots, warnings, phases of every rank
# ------------------------------------------------------------------------------------------------


def _profile(**keys):
    from tape_train.config import ProfileConfig

    return ProfileConfig(enabled=True, **keys)


def test_memory_snapshots_at_each_window_end_on_cuda(tmp_path, monkeypatch):
    import torch

    from tape_train.train import profiling

    history: list = []
    monkeypatch.setattr(profiling, "memory_history_supported", lambda device: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: history.append(enabled))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"calls": list(history)})
    prof = profiling.RunProfiler(
        _profile(start_step=2, active_steps=1, warmup_steps=0, repeat=0, interval=2,
                 trace=False, memory_snapshot=True, ranks="all"), tmp_path, rank=3,
        device=torch.device("cuda"), max_steps=5)
    prof.record_memory()
    prof.start(1)
    for step in range(1, 6):
        prof.before_step(step)
        assert prof.label("forward") is profiling.no_label("x")  # no trace: labels stay off
    prof.finish(5)
    prof.close()
    # Windows 2 and 4 (interval 2, until the run ends); step 6 is past train.max_steps.
    assert _files(tmp_path) == ["profile/step_2/memory_rank3.pickle",
                                "profile/step_4/memory_rank3.pickle"]
    assert history == ["all", None]                          # started once, stopped at close


def test_memory_snapshot_on_cpu_is_one_warning_not_an_error(tmp_path, caplog):
    import torch

    from tape_train.train.profiling import RunProfiler

    prof = RunProfiler(_profile(start_step=1, warmup_steps=0, memory_snapshot=True),
                       tmp_path, device=torch.device("cpu"), max_steps=3)
    with caplog.at_level(logging.WARNING, logger="tape_train.train"):
        prof.record_memory()
    assert [r.getMessage() for r in caplog.records] == [
        "profile.memory_snapshot: CUDA only, this run is on cpu: no memory snapshot is "
        "recorded"]
    assert not prof.snapshots and prof.after_out_of_memory(0, "step 1") is None


def test_every_rank_knows_when_a_window_ends():
    """The trainer makes the writing of a window's files a phase of every rank (the
    watchdog's timeouts are collective): a rank that does not profile must agree."""
    from tape_train.train.profiling import RunProfiler

    cfg = _profile(start_step=4, active_steps=2, warmup_steps=1, repeat=3, interval=4, ranks=[0])
    ends = {rank: [s for s in range(1, 20) if RunProfiler(cfg, rank=rank, max_steps=19)
                   .ends_window_before(s)] for rank in (0, 1)}
    assert ends[0] == ends[1] == [6, 10, 14]                 # after steps 5, 9 and 13
    assert [s for s in range(1, 20) if RunProfiler(None).ends_window_before(s)] == []


def test_a_trace_is_renamed_into_place_only_when_complete(tmp_path):
    from tape_train.files import atomic_path

    target = tmp_path / "step_3" / "rank0.pt.trace.json"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text('{"traceEvents": [')              # the export dies half-way
            raise RuntimeError("killed")
    assert _files(tmp_path) == []                             # no half trace, no temporary
    with atomic_path(target) as tmp:
        tmp.write_text('{"traceEvents": []}')
    assert _files(tmp_path) == ["step_3/rank0.pt.trace.json"]


def test_a_trace_that_cannot_be_written_is_one_error_and_training_goes_on(tmp_path, monkeypatch,
                                                                          caplog):
    import contextlib
    import errno

    from tape_train.files import FileWriteError
    from tape_train.train import profiling

    @contextlib.contextmanager
    def full_disk(path, **kwargs):
        raise FileWriteError(errno.ENOSPC, f"no space left on device writing {path}")
        yield

    monkeypatch.setattr(profiling, "atomic_path", full_disk)
    prof = profiling.RunProfiler(_profile(start_step=1, active_steps=1, warmup_steps=0),
                                 tmp_path, max_steps=2)
    with caplog.at_level(logging.INFO, logger="tape_train.train"):
        for step in (1, 2):
            prof.before_step(step)
            with prof.label("forward"):
                pass
        prof.finish(2)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [f"profile: the trace of steps 1-1 was not written: no space left on "
                      f"device writing {tmp_path}/profile/step_1/rank0.pt.trace.json"]
    assert _files(tmp_path) == []
