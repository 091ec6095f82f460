"""Sequences of runs on one run directory, as a researcher goes through them (the real Trainer,
one process, ZeRO-1, fp32, synthetic data): rewinding to an older checkpoint with another
learning rate must leave the new trajectory's checkpoints, not the abandoned one's, in the run
dir, with the abandoned ones kept aside and a re-run continuing the new trajectory; the
learning-rate change is named with both rates; re-running the finished run is a quick no-op;
a train.max_steps lowered below the newest checkpoint ends the run there, saying so.
"""

from __future__ import annotations

import pytest

from distributed import run_distributed_test
from test_train_faults import OVERRIDES as FAULTS_OVERRIDES  # tiny model, 4 steps, every 2

OVERRIDES = [*FAULTS_OVERRIDES, "parallel.zero_stage=1", "logging.tensorboard=false"]


def _rewind(run_dir: str) -> dict:
    import json
    import logging
    import os
    from pathlib import Path

    from tape_train.config import load_run_config
    from tape_train.train import checkpoint as ckpt
    from tape_train.train import loop
    from tape_train.train.loop import Trainer

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    setup_logging = loop.setup_logging
    loop.setup_logging = lambda *a: (setup_logging(*a),
                                     logging.getLogger("tape_train").addHandler(Keep()))
    cfg = lambda *extra: load_run_config(None, [*OVERRIDES, f"train.run_dir={run_dir}",  # noqa: E731
                                                *extra])
    root = Path(run_dir) / "checkpoints"

    def lr_of(tag: Path) -> float:
        return ckpt.read_marker(tag)["config"]["train"]["lr"]

    out = {"first": Trainer(cfg()).run()}
    from tape_train.train.preflight import run_preflight

    out["dry_run"] = run_preflight(cfg("train.lr=3e-3"), world_size=1, plan=False,
                                   resume_from=root / "step_00000002").warnings
    # Rewind to step 2 with three times the learning rate, then the same command again.
    out["rewind"] = Trainer(cfg("train.lr=3e-3"), resume_from=root / "step_00000002").run()
    metrics_before = Path(run_dir, "metrics.jsonl").read_text()
    rerun = Trainer(cfg("train.lr=3e-3"))
    out["rerun"] = rerun.run()
    out["rerun_built_an_engine"] = hasattr(rerun, "engine")
    out["rerun_wrote_metrics"] = Path(run_dir, "metrics.jsonl").read_text() != metrics_before
    # A requeue of a job started with --resume-from step_2 runs that command line again: not
    # a second rewind (which would throw away what the job did since, on every requeue).
    os.environ["SLURM_RESTART_COUNT"] = "1"
    try:
        plan = run_preflight(cfg("train.lr=3e-3"), world_size=1, plan=False,
                             resume_from=root / "step_00000002")
        out["requeue_plan"] = plan.lines + plan.warnings
        out["requeued"] = Trainer(cfg("train.lr=3e-3"), resume_from=root / "step_00000002").run()
    finally:
        del os.environ["SLURM_RESTART_COUNT"]
    out["requeue_lines"] = [m for m in records if "is not applied again" in m]
    out["complete_lines"] = [m for m in records if "run already complete" in m]
    out["tags"] = [t.name for t in ckpt.list_tags(root)]
    out["latest"] = (root / ckpt.LATEST).read_text()
    out["lr_in_place"] = lr_of(root / "step_00000004")
    aside = sorted((root / "superseded").glob("*/step_*"))
    out["aside"] = [(t.name, lr_of(t), ckpt.why_incomplete(t)) for t in aside]
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    out["train_steps"] = [r["step"] for r in rows if r["kind"] == "train"]
    out["resume_events"] = [(r["step"], r.get("superseded_checkpoints")) for r in rows
                            if r.get("event") == "resume"]
    out["moved_lines"] = [m for m in records if "moved to" in m]
    # max_steps lowered below the newest checkpoint of a run not marked done (as if killed in
    # its final evaluation): the run ends there, saying why, not "it stopped before ...".
    metrics = Path(run_dir, "metrics.jsonl")
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("event") != "done"))
    out["lowered"] = Trainer(cfg("train.lr=3e-3", "train.max_steps=2")).run()
    out["lowered_lines"] = [m for m in records if "below the step of the checkpoint" in m
                            or "stopped before its final evaluation" in m]
    out["done_at"] = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
                      if json.loads(line).get("event") == "done"]
    out["lr_lines"] = [m for m in records if "learning rate of step" in m]
    return out


@pytest.mark.distributed
def test_a_rewind_with_another_lr_keeps_its_own_checkpoints_and_sets_the_old_ones_aside(
        tmp_path):
    [r] = run_distributed_test(_rewind, world_size=1, args=(str(tmp_path / "run"),),
                               timeout=300)
    assert (r["first"], r["rewind"], r["rerun"]) == (0, 0, 0)
    # The dry run says what the rewind will do.
    assert any("step_00000002 is older than this run dir's newest checkpoint step_00000004"
               in w and "superseded" in w for w in r["dry_run"]), r["dry_run"]
    # Step 4 in the run dir is the rewound run's (lr 3e-3), not the abandoned one's.
    assert r["tags"] == ["step_00000002", "step_00000004"] and r["latest"] == "step_00000004"
    assert r["lr_in_place"] == pytest.approx(3e-3)
    # The abandoned step 4 is kept aside, complete; the warning says where.
    assert r["aside"] == [("step_00000004", pytest.approx(1e-3), None)]
    assert len(r["moved_lines"]) == 1 and "step_00000004" in r["moved_lines"][0]
    assert "superseded" in r["moved_lines"][0] and "nothing was deleted" in r["moved_lines"][0]
    # The lr change is named at the rewind, with both rates.
    assert len(r["lr_lines"]) == 1 and "train.lr 0.001 -> 0.003" in r["lr_lines"][0]
    # The re-run continues the new trajectory: it is complete at its own step 4, which it
    # says without starting DeepSpeed or loading the checkpoint, and without writing anything.
    assert not r["rerun_built_an_engine"] and not r["rerun_wrote_metrics"]
    assert r["train_steps"] == [1, 2, 3, 4]                # one row per step
    [(step, aside)] = r["resume_events"]
    assert step == 2 and aside and "superseded" in aside
    # The requeue resumed from the newest checkpoint (complete: nothing to do), set nothing
    # aside (the tags and the one superseded directory are as they were), and said why.
    assert r["requeued"] == 0 and len(r["requeue_lines"]) == 1, r["requeue_lines"]
    assert "SLURM_RESTART_COUNT=1" in r["requeue_lines"][0]
    assert "continued from it to step_00000004" in r["requeue_lines"][0]
    assert len(r["complete_lines"]) == 2
    assert any("not applied again on this restart" in line for line in r["requeue_plan"])
    assert not any("is older than" in line for line in r["requeue_plan"]), r["requeue_plan"]
    # max_steps lowered below the checkpoint: the run ends at step 4, saying why.
    assert r["lowered"] == 0 and r["done_at"] == [4]
    assert len(r["lowered_lines"]) == 1, r["lowered_lines"]
    assert "train.max_steps=2 is below the step of the checkpoint resumed (4)" in \
        r["lowered_lines"][0]
