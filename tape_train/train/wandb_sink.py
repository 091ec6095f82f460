"""Weights & Biases, opt-in: ``logging.wandb: {project, entity, name, mode, group, tags}``.

The sink receives exactly what TensorBoard receives (``metrics.scalar_items``) and the resolved
run config. W&B's own step must only grow, but a resumed run replays steps logged after its
last checkpoint; so every record carries ``trainer/step`` and all metrics are plotted against
it (``define_metric``), and replayed steps simply overwrite nothing. The W&B run id is kept in
``<run_dir>/wandb_run_id``: a restart (Slurm requeue, ``--resume-from``) continues the same
W&B run. ``wandb`` is imported only when the section is present.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

log = logging.getLogger("tape_train.train")

KEYS = ("project", "entity", "name", "mode", "group", "tags")
MODES = ("online", "offline", "disabled")
RUN_ID_FILE = "wandb_run_id"
STEP_KEY = "trainer/step"


def check_wandb_settings(settings: dict) -> str | None:
    """The problem with a ``logging.wandb`` mapping, or None when it is valid."""
    unknown = sorted(set(settings) - set(KEYS))
    if unknown:
        return f"logging.wandb: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}"
    if not isinstance(settings.get("project"), str) or not settings["project"]:
        return "logging.wandb.project: a project name (string) is required"
    for key in ("entity", "name", "group"):
        if settings.get(key) is not None and not isinstance(settings[key], str):
            return f"logging.wandb.{key}: expected a string, got {settings[key]!r}"
    if settings.get("mode", "online") not in MODES:
        return f"logging.wandb.mode: {settings['mode']!r} is not one of {', '.join(MODES)}"
    tags = settings.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        return f"logging.wandb.tags: expected a list of strings, got {tags!r}"
    return None


class WandbSink:
    """Rank-0 W&B run for one run directory; ``write(tag_values, step)`` logs scalars."""

    def __init__(self, run_dir: Path, settings: dict, config: dict) -> None:
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=settings["project"], entity=settings.get("entity"),
            name=settings.get("name"), group=settings.get("group"), tags=settings.get("tags"),
            mode=settings.get("mode", "online"), id=run_id, resume="allow", dir=str(run_dir),
            config=config)
        if not id_file.is_file():
            id_file.write_text(run_id + "\n")
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        log.info("wandb: run %s (project %s, mode %s)", run_id, settings["project"],
                 settings.get("mode", "online"))

    def write(self, items: dict[str, float], step: int) -> None:
        if items:
            self.run.log({**items, STEP_KEY: step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
