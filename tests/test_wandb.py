"""Weights & Biases logging (opt-in, offline mode here): same scalars and config as
TensorBoard, the same W&B run after a restart, never imported unless configured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tape_train.config import ConfigError, load_run_config
from tape_train.train.metrics import MetricsWriter

STEPS = [{"loss": 4.0 - 0.1 * s, "lr": 1e-3 * s, "grad_norm": float("nan") if s == 2 else 1.0,
          "skipped": False, "mem/rss_gib": 1.5} for s in range(1, 5)]


def test_config_section_is_validated():
    cfg = load_run_config(None, ["model=tiny",
                                 "logging.wandb={project: tape, mode: offline, tags: [a]}"])
    assert cfg.logging.wandb == {"project": "tape", "mode": "offline", "tags": ["a"]}
    assert load_run_config(None, ["model=tiny"]).logging.wandb is None
    with pytest.raises(ConfigError, match="logging.wandb.mode: 'ofline' is not one of"):
        load_run_config(None, ["model=tiny", "logging.wandb={project: tape, mode: ofline}"])
    with pytest.raises(ConfigError, match="logging.wandb: unknown key.s. projetc"):
        load_run_config(None, ["model=tiny", "logging.wandb={projetc: tape}"])
    with pytest.raises(ConfigError, match="logging.wandb.project: a project name"):
        load_run_config(None, ["model=tiny", "logging.wandb={mode: offline}"])


def test_wandb_is_not_imported_unless_configured(tmp_path):
    code = ("import sys; from pathlib import Path\n"
            "import tape_train.train.loop\n"
            "from tape_train.train.metrics import MetricsWriter\n"
            f"w = MetricsWriter(Path({str(tmp_path)!r}), enabled=True, tensorboard=False)\n"
            "w.write('train', 1, {'loss': 1.0}); w.close()\n"
            "print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def _tensorboard_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_offline_run_logs_what_tensorboard_logs_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'tape-train[wandb]')")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = {"project": "tape-test", "mode": "offline", "name": "tiny"}
    config = {"model": {"pe": "tape", "hidden_size": 64}, "train": {"lr": 0.001}}
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=True, wandb=settings,
                           run_config=config)
    run = writer._wandb.run
    for step, values in enumerate(STEPS[:3], start=1):
        writer.write("train", step, values)
    writer.write("event", 3, {"event": "checkpoint"})
    writer.write("eval", 3, {"ppl_256": 12.5})
    summary = {k: v for k, v in dict(run.summary).items() if not k.startswith("_")}
    run_id = run.id
    assert dict(run.config) == config
    writer.close()
    tb = _tensorboard_scalars(tmp_path)
    assert set(summary) - {"trainer/step"} == set(tb) == {
        "train/loss", "train/lr", "train/grad_norm", "mem/rss_gib", "eval/ppl_256"}
    for tag, by_step in tb.items():
        assert summary[tag] == pytest.approx(by_step[max(by_step)], rel=1e-6)
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id

    # A restart (same run directory) continues the same W&B run, replaying step 3 is fine.
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False, wandb=settings,
                           run_config=config)
    assert writer._wandb.run.id == run_id
    writer.write("train", 3, STEPS[2])
    writer.write("train", 4, STEPS[3])
    assert writer._wandb.run.summary["train/loss"] == pytest.approx(STEPS[3]["loss"])
    writer.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)
