"""Built-in event observers, enabled from the YAML ``events`` section (one set per engine: they see only the
events of the engine whose configuration asked for them)."""

from __future__ import annotations

import json
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .events import Event
from .hookspecs import hookimpl

if TYPE_CHECKING:
    from .config import EventsConfig

events_log = logging.getLogger("tiered_ckpt.events")


class JsonLinesObserver:
    """Writes one JSON object per event to a file (appending) or to stderr (``-``)."""

    def __init__(self, path: str, source: str | None = None):
        self.path = path
        self._lock = threading.Lock()
        if path != "-":  # checked now: a path that cannot be written would fail at every event, in the drain
            try:
                with open(path, "a"):
                    pass
            except OSError as exc:
                raise ConfigError(f"cannot append to {path}: {exc.strerror or exc}: give a file in an existing, "
                                  "writable directory (or - for stderr)", source=source,
                                  key_path="events.jsonl") from None

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


def from_config(events: EventsConfig, source: str | None = None) -> list[Any]:
    """The observers a configuration's ``events`` section asks for (``source``: the configuration's file, for
    errors)."""
    observers: list[Any] = []
    if events.jsonl:
        observers.append(JsonLinesObserver(events.jsonl, source))
    if events.log:
        observers.append(LoggingObserver())
    return observers
