"""Built-in event observers, enabled from the YAML ``events`` section."""

from __future__ import annotations

import json
import logging
import sys
import threading

from .events import Event
from .hookspecs import hookimpl

events_log = logging.getLogger("tiered_ckpt.events")


class JsonLinesObserver:
    """Writes one JSON object per event to a file (appending) or to stderr (``-``)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    @hookimpl
    def tiered_ckpt_on_event(self, event: Event) -> None:
        line = json.dumps(event.to_dict(), sort_keys=True, default=str) + "\n"
        with self._lock:
            if self.path == "-":
                sys.stderr.write(line)
            else:
                with open(self.path, "a") as f:
                    f.write(line)


class LoggingObserver:
    @hookimpl
    def tiered_ckpt_on_event(self, event: Event) -> None:
        events_log.info("%s", json.dumps(event.to_dict(), sort_keys=True, default=str))
