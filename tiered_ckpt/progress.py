"""Progress bars (tqdm): the command line's long operations (``verify``, ``convert``) and ``engine.wait``."""

from __future__ import annotations

import os
import sys
from typing import Any


def progress_bar(**kwargs: Any) -> Any:
    """A tqdm bar of bytes, sized to the terminal it draws on (:func:`sized_bar`)."""
    return sized_bar(unit="B", unit_scale=True, unit_divisor=1024, **kwargs)


def sized_bar(**kwargs: Any) -> Any:
    """A tqdm bar sized to the terminal it draws on. A terminal that reports no size (``script`` without one says
    0x0) gets 80x24: tqdm would print an empty line in place of the bar."""
    from tqdm import tqdm

    stream = kwargs.get("file") or sys.stderr
    try:
        columns, lines = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):  # not a terminal (the bar is disabled then), or no fileno
        columns, lines = 0, 0
    return tqdm(**{"ncols": columns or 80, "nrows": lines or 24, **kwargs})
