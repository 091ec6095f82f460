"""The training command line as the cluster tools see it: ``--config <yaml> [key=value ...]``.

`tape-submit` and the per-node preflight both need the run directory before the trainer runs.
They parse the training arguments with the trainer's own parser (`tape_train.train.cli`) and
read the config with the project's one loader (`tape_train.config.load_run_config`), so a bad
argument, config or override fails at submission with the same message tape-train would give.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path


class TrainArgsError(ValueError):
    """The training arguments are not what tape-train accepts; the message says why."""


def parse_train_args(args: list[str]) -> argparse.Namespace:
    """tape-train's arguments parsed by tape-train's parser (``.config``, ``.overrides``, ...).

    Raises TrainArgsError with argparse's message instead of exiting.
    """
    from tape_train.train.cli import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            # As tape-train parses them: overrides may follow options.
            return build_parser().parse_intermixed_args(args)
    except SystemExit:
        # argparse prints the usage, then "<prog>: error: <what>", then perhaps hint lines.
        errors = [line.split(": error: ", 1)[1] for line in stderr.getvalue().splitlines()
                  if ": error: " in line]
        raise TrainArgsError(f"tape-train would reject the arguments {args}: "
                             f"{errors[0] if errors else 'invalid arguments'}") from None


def resolve_run_dir(args: list[str], base_dir: Path | None = None) -> Path:
    """The run directory (``train.run_dir``) the trainer will use, as an absolute path.

    Relative run directories are relative to ``base_dir`` (default: the current directory),
    which is where the batch script runs (tape-submit sets ``--chdir`` to it).
    Raises TrainArgsError or tape_train.config.ConfigError naming what is wrong.
    """
    from tape_train.config import load_run_config

    parsed = parse_train_args(args)
    run_dir = Path(load_run_config(parsed.config, parsed.overrides).train.run_dir)
    if not run_dir.is_absolute():
        run_dir = (base_dir or Path.cwd()) / run_dir
    return run_dir
