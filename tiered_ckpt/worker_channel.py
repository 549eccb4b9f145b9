"""The two message channels between a training process and its drain worker, over plain OS pipes.

``multiprocessing.Queue`` would carry the same messages, but each one holds three named POSIX semaphores
(``/dev/shm/sem.mp-*``) that only the resource-tracker process removes: a job killed with SIGKILL (a scheduler's
last word after its grace period) takes the tracker with it, and every rank left six of them in ``/dev/shm``
for good. A pipe is two file descriptors, which the kernel closes whatever ends the process; and a reader learns
that every writer is gone (``EOFError``) as soon as it happens.

Each direction has one reader and any number of writing threads. Requests (training process -> worker) go
through a feeder thread, so ``put`` never blocks a save on a worker that is stopped or still starting; results
(worker -> training process) are sent at once, under a lock, so nothing is left unsent when the worker exits.
Only the ends a process uses travel to the worker (``spawn`` duplicates the descriptors it pickles); the
training process closes its copies of the worker's ends once the worker has started (:func:`close_child_ends`),
and a forked child (a DataLoader's worker) closes its copies of every end at once: a child holding one would
keep a dead worker's death, or a dead training process's, from reading as end of file.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import traceback
import weakref
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import ForkingPickler
from typing import Any

_CLOSE = object()  # the feeder's own stop mark (never sent)
_ends: weakref.WeakSet[Receiver | Sender | QueuedSender] = weakref.WeakSet()  # this process's, for fork


def _close_ends_in_child() -> None:
    for end in list(_ends):
        with contextlib.suppress(OSError):  # not under the end's lock: another thread may have held it at the fork
            end._conn.close()


os.register_at_fork(after_in_child=_close_ends_in_child)


class Receiver:
    """The reading end: ``get(timeout)`` as ``queue.Queue`` has it (``queue.Empty`` when nothing came in time),
    and ``EOFError`` once every writer has closed its end (its process exited, or was killed)."""

    def __init__(self, conn: Connection):
        self._conn = conn
        _ends.add(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Receiver, (self._conn,))

    def get(self, timeout: float | None = None) -> Any:
        if not self._conn.poll(timeout):
            raise queue.Empty
        return self._conn.recv()

    def close(self) -> None:
        self._conn.close()


class Sender:
    """The writing end, sending each ``put`` at once (the worker's results). Several threads may put: one
    message is written whole before the next. A reader that is gone (its process died) drops what is put: the
    process that is left has nothing to tell it."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()
        _ends.add(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sender, (self._conn,))

    def put(self, obj: Any) -> None:
        data = _pickled(obj)
        if data is None:
            return
        with self._lock, contextlib.suppress(OSError, ValueError):  # (ValueError: this end was closed)
            self._conn.send_bytes(data)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class QueuedSender:
    """The writing end for the training process's requests: ``put`` hands the message to a feeder thread and
    returns, whatever the worker is doing (stopped, starting, its pipe full); the feeder sends them in order.
    ``close()`` lets the feeder send what was put before it, then closes the end."""

    def __init__(self, conn: Connection, name: str):
        self._conn = conn
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._feeder = threading.Thread(target=self._feed, name=name, daemon=True)
        self._feeder.start()
        _ends.add(self)

    def put(self, obj: Any) -> None:
        self._pending.put(obj)

    def close(self) -> None:
        self._pending.put(_CLOSE)

    def _feed(self) -> None:
        try:
            while (obj := self._pending.get()) is not _CLOSE:
                data = _pickled(obj)
                if data is not None:
                    self._conn.send_bytes(data)
        except (OSError, ValueError):  # the worker is gone: nothing will read what is left
            pass
        finally:
            self._conn.close()


def _pickled(obj: Any) -> bytes | None:
    """``obj`` pickled for the pipe, or None (printed, as ``multiprocessing.Queue`` does) where it cannot be: the
    message is lost, never the channel, and never by a logging call that could come back here."""
    try:
        return bytes(ForkingPickler.dumps(obj))
    except Exception:
        traceback.print_exc()
        return None


def channels(feeder_name: str) -> tuple[QueuedSender, Receiver, Receiver, Sender]:
    """New channels for one worker: (requests' sender, requests' receiver for the worker, results' receiver,
    results' sender for the worker)."""
    req_read, req_write = Pipe(duplex=False)
    res_read, res_write = Pipe(duplex=False)
    return QueuedSender(req_write, feeder_name), Receiver(req_read), Receiver(res_read), Sender(res_write)


def close_child_ends(*ends: Receiver | Sender) -> None:
    """In the training process, once the worker has started with its own duplicates: without this, the worker's
    death would never read as end of file here, nor this process's death there."""
    for end in ends:
        end.close()
