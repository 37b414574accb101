"""What sd-accel says in the WebUI's console, and how.

The WebUI shows WARNING and up (its logging config, or Python's last-resort handler), so the
``sd_accel`` logger's INFO lines (a build's stages, "exported ... in 31 s") never reached the
console, and warnings printed in the middle of a sampling progress bar were glued onto it.
:func:`setup` gives the logger its own handler: INFO and up, each line prefixed ``sd-accel:``
once, written through ``tqdm.write`` (which clears the bars, writes the line, and redraws them).
:func:`say` is the same for lines the extension prints itself, and :func:`console_progress`
turns a build's progress events into one line per stage.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable

PREFIX = "sd-accel: "
_HANDLER_NAME = "sd-accel-webui-console"


def say(text: str) -> None:
    """One or more lines to the console, never glued onto a progress bar."""
    message = str(text)
    if not message.startswith(PREFIX.strip()):
        message = PREFIX + message  # the first line only: a traceback below stays as it is
    if _bar_below():
        # tqdm.write clears a bar below the cursor (A1111's "Total progress" sits at position 1)
        # and moves back up with a cursor-up code, then writes: in a console log the line would
        # start with that code, glued to the bar's line. End that line first.
        message = "\n" + message
    try:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)
    except Exception:  # no tqdm (unusual in a WebUI): a plain print still starts on a new line
        print("\n" + message if _bar_open() else message, flush=True)


def _bar_below() -> bool:
    """Whether an open tqdm bar sits below the cursor line (position > 0)."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    try:
        bars = list(getattr(tqdm, "_instances", None) or ())
    except Exception:  # tqdm's WeakSet changing under another thread
        return False
    return any(abs(getattr(b, "pos", 0) or 0) > 0 and not getattr(b, "disable", False) for b in bars)


def _bar_open() -> bool:
    tqdm = sys.modules.get("tqdm")
    return bool(getattr(getattr(tqdm, "tqdm", None), "_instances", None))


class TqdmHandler(logging.Handler):
    """A logging handler that writes through ``tqdm.write``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(self.format(record))
        except Exception:  # a handler must never raise into the caller
            self.handleError(record)


def setup(logger_name: str = "sd_accel", level: int = logging.INFO) -> logging.Handler:
    """Give the ``sd_accel`` logger its console handler (once; a script reload keeps one)."""
    logger = logging.getLogger(logger_name)
    for handler in logger.handlers:
        if handler.get_name() == _HANDLER_NAME:
            return handler
    handler = TqdmHandler(level)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    logger.propagate = False  # the root handlers (or the last-resort one) would print it again
    return handler


def _stage_class(stage: str) -> str:
    """A stage without its numbers: "step 3/20" and "step 4/20" are one stage."""
    return re.sub(r"\d+(\.\d+)?", "#", stage)


def console_progress(label: str, also: Callable | None = None) -> Callable:
    """A build progress callback printing one line when a build enters a new stage (not per step),
    with the seconds since the build started; ``also`` receives every event as well."""
    start = time.perf_counter()
    last: dict[tuple, str] = {}

    def report(event) -> None:
        if also is not None:
            also(event)
        if event is None:
            return
        key = (event.index, event.component, event.profile)
        stage = _stage_class(event.stage)
        if last.get(key) == stage:
            return
        last[key] = stage
        say(f"{label} [{event.index + 1}/{event.total}] {event.component} {event.profile}: {event.stage} "
            f"({time.perf_counter() - start:.0f} s)")

    return report
