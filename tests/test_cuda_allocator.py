"""The CUDA caching allocator on the training path, checked on CPU
(``tape_train/train/cuda_allocator.py``): expandable segments unless the user exported an
allocator setting (theirs wins), nothing touched on CPU, the run-time setting as torch itself
reports it in a fresh process, the allocator's counts in the step metrics, and one warning per
growth of its retry count (none without growth)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tape_train.train import cuda_allocator
from tape_train.train.cuda_allocator import (EXPANDABLE, RetryWatch, choose_allocator_setting,
                                             configure_cuda_allocator)

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda", 0)
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def test_expandable_segments_unless_turned_off():
    on = choose_allocator_setting(True, {"PATH": "/bin"})
    assert (on.settings, on.source, on.expandable, on.apply) == (
        "expandable_segments:True", "train.cuda_expandable_segments", True, EXPANDABLE)
    assert on.describe() == ("CUDA caching allocator: expandable_segments:True "
                             "(train.cuda_expandable_segments=true; expandable segments on)")
    assert on.remedy() is None
    off = choose_allocator_setting(False, {})
    assert (off.settings, off.expandable, off.apply) == ("", False, None)
    assert off.describe() == ("CUDA caching allocator: torch's defaults "
                              "(train.cuda_expandable_segments=false; expandable segments off)")
    assert off.remedy() == "set train.cuda_expandable_segments=true (expandable segments, off now)"


@pytest.mark.parametrize("name", ENV_VARS)
@pytest.mark.parametrize("value, expandable", [
    ("max_split_size_mb:256", False),
    ("max_split_size_mb:256,expandable_segments:True", True),
    ("expandable_segments:True,expandable_segments:False", False),  # the last one counts
    ("", False),  # exported empty: torch's defaults, still the user's choice
])
def test_an_exported_setting_wins_and_nothing_is_applied(name, value, expandable):
    for requested in (True, False):
        setting = choose_allocator_setting(requested, {name: value})
        assert setting.apply is None
        assert (setting.settings, setting.source, setting.expandable) == (value, name,
                                                                          expandable)
        assert setting.describe() == (
            f"CUDA caching allocator: {name}={value!r} from the environment, which wins over "
            f"train.cuda_expandable_segments (expandable segments "
            f"{'on' if expandable else 'off'})")
    if not expandable:
        assert setting.remedy().startswith(f"add expandable_segments:True to {name} ")


def test_nothing_is_touched_off_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_allocator, "set_allocator_settings", calls.append)
    for device in (torch.device("cpu"), torch.device("meta")):
        assert configure_cuda_allocator(True, device, environ={}) is None
    assert calls == []
    setting = configure_cuda_allocator(True, CUDA, environ={})  # control: CUDA sets it
    assert calls == [EXPANDABLE] and setting.apply == EXPANDABLE
    assert configure_cuda_allocator(True, CUDA, environ={ENV_VARS[0]: "x"}).apply is None
    assert calls == [EXPANDABLE]  # the user's setting: not touched either


def test_memory_reserved_before_the_setting_is_reported(monkeypatch):
    monkeypatch.setattr(cuda_allocator, "set_allocator_settings", lambda settings: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**29)
    setting = configure_cuda_allocator(True, CUDA, environ={})
    assert setting.reserved_before_gib == 1.5
    assert setting.describe().endswith("; 1.50 GiB were reserved before it was set: those "
                                       "segments keep fixed sizes")


# In a fresh interpreter: what torch's allocator configuration holds after the trainer's call,
# as torch reports it (the CPU build parses and keeps the same settings the CUDA build uses).
PROBE = """
import json, sys, torch
from tape_train.train.cuda_allocator import configure_cuda_allocator
out = []
for device, requested in json.loads(sys.argv[1]):
    setting = configure_cuda_allocator(requested, torch.device(device))
    out.append([None if setting is None else setting.settings,
                torch._C._accelerator_getAllocatorSettings()])
print(json.dumps(out))
"""


def _probe(steps: list, env_extra: dict) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(env_extra, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                   env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(steps)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_torch_holds_the_setting_in_force():
    # No variable exported: CPU and `false` leave torch's defaults; `true` on CUDA sets it.
    assert _probe([["cpu", True], ["cuda:0", False], ["cuda:0", True]], {}) == [
        [None, ""], ["", ""], [EXPANDABLE, EXPANDABLE]]
    # Exported: torch keeps the user's setting, and what the trainer logs is what torch holds,
    # also with both variables set (torch reads PYTORCH_CUDA_ALLOC_CONF first).
    assert _probe([["cuda:0", True]], {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}) == [
        ["max_split_size_mb:64", "max_split_size_mb:64"]]
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:False",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64"}
    [[logged, held]] = _probe([["cuda:0", False]], both)
    assert logged == held == both["PYTORCH_CUDA_ALLOC_CONF"]
    # An empty PYTORCH_CUDA_ALLOC_CONF is a setting too: torch's defaults, for both of them.
    empty = {"PYTORCH_ALLOC_CONF": EXPANDABLE, "PYTORCH_CUDA_ALLOC_CONF": ""}
    assert _probe([["cuda:0", True]], empty) == [["", ""]]


def test_the_trainer_hands_its_key_to_the_process_group_start(monkeypatch, tmp_path):
    """``train.cuda_expandable_segments`` reaches ``init_distributed``, which applies it as
    soon as the device is chosen (``test_cuda_paths``: before NCCL starts)."""
    from tape_train.config import load_run_config
    from tape_train.train import loop

    class Stop(Exception):
        pass

    seen = []

    def init_distributed(device, timeout_s=None, cuda_expandable_segments=None):
        seen.append(cuda_expandable_segments)
        raise Stop

    monkeypatch.setattr(loop.tdist, "init_distributed", init_distributed)
    for value in ("true", "false"):
        trainer = loop.Trainer(load_run_config(None, [
            "model=tiny", f"train.run_dir={tmp_path}", "train.synthetic_data=true",
            "eval.interval=0", f"train.cuda_expandable_segments={value}"]))
        try:
            with pytest.raises(Stop):
                trainer.setup()
        finally:
            trainer.close()
    assert seen == [True, False]


def _stats(retries: int) -> dict:
    return {"allocated_bytes.all.current": 2**30, "allocated_bytes.all.peak": 2 * 2**30,
            "reserved_bytes.all.current": 3 * 2**30, "reserved_bytes.all.peak": 5 * 2**30,
            "num_alloc_retries": retries, "num_ooms": 1}


def test_step_memory_metrics_on_cuda_read_the_allocators_counts(monkeypatch):
    from tape_train.train.metrics import memory_metrics

    asked = []
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda device=None: asked.append(device) or _stats(7))
    m = memory_metrics(CUDA)
    assert asked == [CUDA]  # one read for all the figures
    assert {k: v for k, v in m.items() if k.startswith("mem/cuda")} == {
        "mem/cuda_allocated_gib": 1.0, "mem/cuda_peak_allocated_gib": 2.0,
        "mem/cuda_reserved_gib": 3.0, "mem/cuda_peak_reserved_gib": 5.0,
        "mem/cuda_alloc_retries": 7, "mem/cuda_ooms": 1}
    assert not [k for k in memory_metrics(torch.device("cpu")) if "cuda" in k]
    assert asked == [CUDA]


def test_retry_growth_warns_once_per_growth_and_backs_off():
    watch = RetryWatch(3, step=0, setting=choose_allocator_setting(False, {}))
    # Negative control: no growth, no line (set-up's 3 retries are no step's).
    assert [watch.check(step, 3) for step in range(1, 6)] == [None] * 5
    line = watch.check(6, 5)
    assert line == (
        "CUDA allocator: 2 allocation retries in step 6 (5 in this process): each freed the "
        "allocator's cached memory and retried cudaMalloc, a device-wide synchronisation that "
        "idles the device. The step is near the device's memory capacity: lower "
        "train.micro_batch_size, set train.activation_checkpointing=true, or set "
        "train.cuda_expandable_segments=true (expandable segments, off now). Next such warning "
        "at step 16 at the earliest")
    assert [watch.check(step, 5) for step in range(7, 30)] == [None] * 23  # no growth again
    # Growing every step from step 30: one line now, then after 20 and 40 steps, summed up.
    lines = {step: watch.check(step, 5 + step - 29) for step in range(30, 120)}
    warned = {step: line for step, line in lines.items() if line}
    assert list(warned) == [30, 50, 90]
    assert warned[30].startswith("CUDA allocator: 1 allocation retry in step 30 (6 in this ")
    assert warned[50].startswith("CUDA allocator: 20 allocation retries in steps 31-50 (26 ")
    assert warned[90].startswith("CUDA allocator: 40 allocation retries in steps 51-90 (66 ")
    assert all("\r" not in line and "\n" not in line for line in warned.values())


def test_the_retry_warning_names_only_the_remedies_left():
    on = RetryWatch(0, step=10, setting=choose_allocator_setting(True, {}))
    assert ("memory capacity: lower train.micro_batch_size, or set "
            "train.activation_checkpointing=true. Next such") in on.check(12, 4)
    assert on.check(12, 4) is None  # the same count again: nothing new
    both_on = RetryWatch(0, step=0, setting=choose_allocator_setting(True, {}),
                         checkpointing=True)
    assert "memory capacity: lower train.micro_batch_size. Next such" in both_on.check(1, 1)
    user = RetryWatch(0, step=0, setting=choose_allocator_setting(True, {ENV_VARS[0]: ""}))
    assert user.check(1, 1).endswith(", or add expandable_segments:True to "
                                     "PYTORCH_CUDA_ALLOC_CONF (exported in the environment, it "
                                     "wins over train.cuda_expandable_segments). Next such "
                                     "warning at step 11 at the earliest")
    assert RetryWatch(None, 0, None).check(5, None) is None  # off CUDA: nothing to watch


def test_the_trainer_warns_when_a_logged_steps_retries_grew(monkeypatch, tmp_path):
    """The loop's logging of a step (``Trainer._log_step``) on a faked CUDA rank: the counts
    reach the metrics, a growth gives one WARNING line, steps without growth none."""
    from tape_train.config import load_run_config
    from tape_train.train.distributed import DistInfo
    from tape_train.train.loop import Trainer
    from tape_train.train.metrics import MetricsWriter, read_metrics

    retries = {"now": 4}  # retried during set-up: not a step's
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda device=None: _stats(retries["now"]))
    trainer = Trainer(load_run_config(None, ["model=tiny", f"train.run_dir={tmp_path}"]))
    trainer.dist = DistInfo(0, 1, 0, CUDA, choose_allocator_setting(True, {}))
    trainer.writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("tape_train.train")
    logger.addHandler(handler)
    try:
        trainer._watch_retries()
        for step in range(1, 4):
            trainer._log_step(step, {"loss": 1.0})
        assert records == []  # negative control: no growth
        retries["now"] = 9
        trainer._log_step(4, {"loss": 1.0})
        trainer._log_step(5, {"loss": 1.0})
    finally:
        logger.removeHandler(handler)
        trainer.writer.close()
    [record] = records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("CUDA allocator: 5 allocation retries in step 4 "
                                          "(9 in this process)")
    rows = read_metrics(tmp_path)
    assert [r["mem/cuda_alloc_retries"] for r in rows] == [4, 4, 4, 9, 9]
    assert rows[-1]["mem/cuda_peak_reserved_gib"] == 5.0 and rows[-1]["mem/cuda_ooms"] == 1
