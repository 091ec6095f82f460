"""One progress convention for every command: a tqdm bar only on a terminal, never in logs.

``mode`` is ``"auto"`` (a bar when the stream is a terminal), ``True``/``"on"`` (always) or
``False``/``"off"`` (never). Without a bar, commands report progress as ordinary greppable log
lines, so a redirected log never holds carriage returns. ``setup_cli_logging`` makes those lines
one per record, whatever library logged them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import IO

MODES = ("auto", "on", "off")
CLI_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _not_printed_by_its_library(record: logging.LogRecord) -> bool:
    """False for a record that a handler below the root prints: libraries such as
    huggingface_hub and datasets attach a stderr handler to their loggers (at import, i.e.
    possibly after ours was set up) and also propagate, so the root would print it twice. A
    ``NullHandler`` (urllib3's and requests', e.g. for connection retries) or a handler whose
    level is above the record's prints nothing: such a record is still the root's to print."""
    logger = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if any(not isinstance(handler, logging.NullHandler) and record.levelno >= handler.level
               for handler in logger.handlers):
            return False
        logger = logger.parent if logger.propagate else None
    return True


def setup_cli_logging(level: int = logging.INFO) -> None:
    """A command's log on stderr: one ``time LEVEL logger: message`` line per record, and no
    second copy of what a library prints through its own handler. Keeps an existing root
    setup (a command called from another one, or from tests) apart from adding the filter."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, stream=sys.stderr, format=CLI_LOG_FORMAT)
    for handler in root.handlers:
        if _not_printed_by_its_library not in handler.filters:
            handler.addFilter(_not_printed_by_its_library)


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
