"""Console entry points. Each one imports its subsystem lazily so `--help` stays fast."""

from __future__ import annotations

import importlib
import sys


def _run(module: str) -> None:
    sys.exit(importlib.import_module(module).main())


def model_main() -> None:
    _run("tape_train.model.cli")


def tokenizer_main() -> None:
    _run("tape_train.data.tokenizer_cli")


def data_main() -> None:
    _run("tape_train.data.cli")


def train_main() -> None:
    _run("tape_train.train.cli")


def eval_main() -> None:
    _run("tape_train.eval.cli")


def submit_main() -> None:
    _run("tape_train.cluster.submit")


def export_main() -> None:
    _run("tape_train.inference.export")


def generate_main() -> None:
    _run("tape_train.inference.generate")
