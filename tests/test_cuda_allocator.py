"""The CUDA caching allocator on the training path, checked on CPU
(``tape_train/train/cuda_allocator.py``): expandable segments unless the user exported an
allocator setting (theirs wins), nothing touched on CPU, the run-time setting as torch itself
reports it in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tape_train.train import cuda_allocator
from tape_train.train.cuda_allocator import (EXPANDABLE, choose_allocator_setting,
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

