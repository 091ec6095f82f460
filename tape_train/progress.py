"""One progress convention for every command: a tqdm bar only on a terminal, never in logs.

``mode`` is ``"auto"`` (a bar when the stream is a terminal), ``True``/``"on"`` (always) or
``False``/``"off"`` (never). Without a bar, commands report progress as ordinary greppable log
lines, so a redirected log never holds carriage returns.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import IO

MODES = ("auto", "on", "off")


def show_progress(mode: bool | str = "auto", stream: IO | None = None) -> bool:
    """Whether a bar should be drawn on ``stream`` (default stderr) for ``mode``."""
    if mode is True or mode == "on":
        return True
    if mode is False or mode == "off":
        return False
    if mode != "auto":
        raise ValueError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(total: int | None, *, desc: str | None = None, unit: str = "it",
                 mode: bool | str = "auto", initial: int = 0, leave: bool = True,
                 stream: IO | None = None):
    """A tqdm bar on ``stream`` (default stderr), or None when ``mode`` says no bar."""
    stream = sys.stderr if stream is None else stream
    if not show_progress(mode, stream):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                leave=leave, file=stream)


@contextlib.contextmanager
def library_bars(module, mode: bool | str = "auto", stream: IO | None = None):
    """Within the block, the bars a library draws with its module-level ``tqdm`` (DeepSpeed's
    ``zero_to_fp32`` "Loading checkpoint shards") follow this convention too."""
    if show_progress(mode, stream):
        yield
        return
    original = module.tqdm
    module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        module.tqdm = original
