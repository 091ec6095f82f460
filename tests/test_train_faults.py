"""Fault injection on the real Trainer (2 gloo ranks, ZeRO-3, fp32, synthetic data).

One scenario, in order: a second run on a run directory in use is refused on both ranks,
naming the holder, while the first trains on; then a byte of the newest checkpoint is flipped
(size unchanged): the next run skips it with a warning, resumes from the older intact one and
replays the steps, bit-exactly; the replayed steps supersede their metrics rows (one row per
step in metrics.jsonl, one point per step in TensorBoard) and the damaged tag is rewritten.
"""

from __future__ import annotations

import pytest

from distributed import run_distributed_test

OVERRIDES = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
             "model.intermediate_size=128", "model.vocab_size=256",
             "model.tape_position_size=8", "train.seq_len=32", "train.micro_batch_size=2",
             "train.grad_accum_steps=1", "train.lr=1e-3", "train.warmup_steps=0",
             "train.dtype=fp32", "train.device=cpu", "train.synthetic_data=true",
             "train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep=3",
             "logging.peak_tflops=1.0", "logging.tensorboard=true", "eval.interval=0"]


def _scenario(run_dir: str) -> dict:
    import json
    import logging
    from pathlib import Path

    import torch.distributed as dist

    from tape_train.config import load_run_config
    from tape_train.train import checkpoint as ckpt
    from tape_train.train.loop import Trainer

    rank = dist.get_rank()
    cfg = lambda: load_run_config(None, OVERRIDES + [f"train.run_dir={run_dir}"])  # noqa: E731
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    from tape_train.train import loop

    keep, setup_logging = Keep(), loop.setup_logging
    loop.setup_logging = lambda *a: (setup_logging(*a),
                                     logging.getLogger("tape_train").addHandler(keep))
    out = {}
    first = Trainer(cfg())
    first.setup()
    second = Trainer(cfg())
    out["second_exit"] = second.run()      # refused while the first holds the lock
    out["refusal"] = [m for m in records if "in use" in m or "could not take" in m]
    out["first_exit"] = first.train()
    first.close()
    losses = {r["step"]: r["loss"] for r in map(json.loads, Path(run_dir, "metrics.jsonl")
                                                .read_text().splitlines()) if r["kind"] == "train"}
    out["losses"] = losses

    tag4 = Path(run_dir) / "checkpoints" / "step_00000004"
    victim = tag4 / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if rank == 0:
        data = bytearray(victim.read_bytes())
        data[len(data) // 3] ^= 0x10
        victim.write_bytes(bytes(data))
    dist.barrier()
    records.clear()
    third = Trainer(cfg())
    third.setup()
    out["resumed_at"] = third.state.step
    out["skip_lines"] = [m for m in records if "damaged" in m]
    out["third_exit"] = third.train()
    third.close()
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    out["train_steps"] = [r["step"] for r in rows if r["kind"] == "train"]
    out["replayed_losses"] = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
    out["superseded"] = [json.loads(line)["step"] for line in
                         Path(run_dir, "metrics.replayed.jsonl").read_text().splitlines()
                         if json.loads(line)["kind"] == "train"]
    out["tag4_intact"] = ckpt.verify_files(tag4) is None
    if rank == 0:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(Path(run_dir) / "tensorboard"))
        events.Reload()
        out["tb_loss_steps"] = [e.step for e in events.Scalars("train/loss")]
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_concurrent_start_flipped_bytes_and_replay(tmp_path):
    r0, r1 = run_distributed_test(_scenario, world_size=2, args=(str(tmp_path),), timeout=400)
    # Concurrent start: both ranks of the second run stop, the first trains to the end.
    assert r0["second_exit"] == r1["second_exit"] == 1 and r0["first_exit"] == 0
    assert any("in use by another run" in m and "pid" in m for m in r0["refusal"]), r0["refusal"]
    assert sorted(r0["losses"]) == [1, 2, 3, 4]
    # Flipped bytes: skipped with one line naming the file, resumed from step 2 on both ranks.
    assert r0["resumed_at"] == r1["resumed_at"] == 2
    lines = r0["skip_lines"]                # rank 0 names the file, whoever read it
    assert len(lines) == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in lines[0], lines
    assert "skipping checkpoint" in lines[0] and "step_00000004" in lines[0]
    assert r0["third_exit"] == 0 and r0["tag4_intact"]   # the damaged tag was rewritten
    # Replay: bit-exact, one row and one TensorBoard point per step.
    assert r0["replayed_losses"] == r0["losses"]
    assert r0["train_steps"] == [1, 2, 3, 4]
    assert r0["superseded"] == [3, 4]                      # the replaced rows, kept aside
    assert r0["tb_loss_steps"] == [1, 2, 3, 4]


def test_a_full_disk_under_the_metrics_is_one_error_naming_the_file(tmp_path):
    """A disk that filled between checkpoints failed the next step's metrics.jsonl line with a
    bare OSError traceback (and a second one from closing). Now it is one FileWriteError naming
    the file and the free space, which the trainer logs in one line (exit 1) as it does a
    failed save; later writes and the close do not fail again. /dev/full fails every write with
    ENOSPC, as a full disk does."""
    import os

    from tape_train.files import FileWriteError
    from tape_train.train.metrics import MetricsWriter

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "metrics.jsonl").symlink_to("/dev/full")
    writer = MetricsWriter(tmp_path / "full", enabled=True, tensorboard=False)
    with pytest.raises(FileWriteError, match=r"^metrics: no space left on device writing "
                                             + str(tmp_path / "full" / "metrics.jsonl")):
        writer.write("train", 1, {"loss": 1.0})
    writer.write("train", 2, {"loss": 0.9})
    writer.flush()
    writer.close()
    # Negative control: the same writes on a disk with room.
    writer = MetricsWriter(tmp_path / "ok", enabled=True, tensorboard=False)
    writer.write("train", 1, {"loss": 1.0})
    writer.close()
    assert '"loss": 1.0' in (tmp_path / "ok" / "metrics.jsonl").read_text()


def test_a_full_disk_under_tensorboard_is_one_line_without_a_thread_traceback(tmp_path,
                                                                             monkeypatch):
    """TensorBoard writes its events in a thread; on a full disk that thread's ENOSPC was
    printed as an "Exception in thread ... Traceback" (Python's threading.excepthook) besides
    the one line the trainer says when the writer hands the error on. Now only the line; an
    error of any other thread still reaches the hook (control)."""
    import errno
    import threading

    from tensorboard.summary.writer import record_writer

    from tape_train.files import FileWriteError
    from tape_train.train.metrics import MetricsWriter

    printed = []  # what Python's default hook would print as a traceback
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.thread.name))
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    writer.write("train", 1, {"loss": 1.0})
    writer.flush()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)  # what the thread calls
    with pytest.raises(FileWriteError, match=r"^metrics: no space left on device writing "
                                             + str(tmp_path / "tensorboard")):
        for step in range(2, 10_000):  # the thread's error reaches the next call after it
            writer.write("train", step, {"loss": 1.0})
    writer.close()                     # joins the thread, after its excepthook ran
    assert printed == []
    thread = threading.Thread(target=full, name="not-tensorboard")
    thread.start()
    thread.join()
    assert printed == ["not-tensorboard"]


def test_damaged_lines_in_the_metrics_do_not_stop_a_resume(tmp_path):
    """Bytes that are not UTF-8 in metrics.jsonl (a damaged disk or copy) stopped the resume
    with a UnicodeDecodeError traceback after DeepSpeed's start-up, where the resume sets the
    rows after its step aside; now such a line is set aside as it is, like a line cut by a
    kill, and the readers skip it. The intact rows stay (control)."""
    import json

    from tape_train.train.metrics import MetricsWriter, read_metrics

    rows = [json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    damaged = b"\xff\xfe{\"kind\": \"train\", \"step\": 2"
    text = "\n".join(rows[:2]).encode() + b"\n" + damaged + b"\n5\n" + rows[2].encode() + b"\n"
    (tmp_path / "metrics.jsonl").write_bytes(text)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    MetricsWriter(tmp_path, enabled=True, tensorboard=False, resume_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(rows[:2]) + "\n"
    assert (tmp_path / "metrics.replayed.jsonl").read_bytes() == \
        damaged + b"\n5\n" + rows[2].encode() + b"\n"


def test_a_directory_or_file_in_the_place_of_the_metrics_is_named(tmp_path):
    """A directory named metrics.jsonl, or a file named tensorboard, in the run dir: an
    IsADirectoryError / FileExistsError traceback from the trainer's set-up. Now one
    FileWriteError naming the path."""
    from tape_train.files import FileWriteError
    from tape_train.train.metrics import MetricsWriter

    (tmp_path / "a" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(FileWriteError, match=f"^metrics: {tmp_path / 'a' / 'metrics.jsonl'}: "
                                             f"Is a directory"):
        MetricsWriter(tmp_path / "a", enabled=True, tensorboard=False)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tensorboard").write_text("x")
    with pytest.raises(FileWriteError, match=f"^metrics: {tmp_path / 'b' / 'tensorboard'}: "):
        MetricsWriter(tmp_path / "b", enabled=True, tensorboard=True)
    # Negative control: the same run dir without it.
    (tmp_path / "b" / "tensorboard").unlink()
    MetricsWriter(tmp_path / "b", enabled=True, tensorboard=True).close()
