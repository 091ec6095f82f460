"""Slurm launch: rendering and submitting batch scripts (`tape-submit`), per-node start-up checks.

The batch scripts themselves live in ``launch/slurm/`` (``train.sbatch``, ``eval.sbatch``); they
are the one source of truth for what runs on the nodes. ``render`` fills in their two marked
blocks (the ``#SBATCH`` header and the run settings) from a run config plus cluster options.
"""

from tape_train.cluster.render import (
    ClusterOptions,
    RenderError,
    parse_time_limit,
    render_eval_script,
    render_train_script,
)
from tape_train.cluster.run_args import TrainArgsError, parse_train_args, resolve_run_dir

__all__ = [
    "ClusterOptions",
    "RenderError",
    "parse_time_limit",
    "render_eval_script",
    "render_train_script",
    "TrainArgsError",
    "parse_train_args",
    "resolve_run_dir",
]
