"""Moved to :mod:`tape_train.host_memory` (eval and benchmarks use it too). This name stays
for existing callers."""

from tape_train.host_memory import keep_freed_memory  # noqa: F401
