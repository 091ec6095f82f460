"""``tape-model``: inspect model sizes (parameters, training FLOPs per token)."""

from __future__ import annotations

import sys

from tape_train.model import flops


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["info"]:
        argv = argv[1:]
    return flops.main(argv)
