"""The pipes between a training process and its drain worker (tiered_ckpt/worker_channel.py)."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import pytest

from tiered_ckpt.worker_channel import channels, close_child_ends


def test_messages_arrive_in_order_and_a_put_never_waits_for_the_reader():
    requests, worker_requests, results, worker_results = channels("test-feeder")
    try:
        putter = threading.Thread(target=lambda: [requests.put(("req", i, b"x" * 100)) for i in range(5000)])
        putter.start()  # far more than a pipe's buffer holds, and nobody reads yet
        putter.join(60)
        assert not putter.is_alive(), "put() waits for the reader"
        assert [worker_requests.get(timeout=30)[1] for _ in range(5000)] == list(range(5000))
        with pytest.raises(queue.Empty):
            worker_requests.get(timeout=0.05)
        worker_results.put(("tier_done", 1, "local", True, None))
        assert results.get(timeout=30) == ("tier_done", 1, "local", True, None)
    finally:
        requests.close()
        for end in (worker_requests, results, worker_results):
            end.close()


def test_a_message_that_cannot_be_pickled_is_dropped_not_the_channel(capfd):
    requests, worker_requests, results, worker_results = channels("test-feeder")
    try:
        worker_results.put(("event", lambda: None))  # a lambda does not pickle
        worker_results.put(("ready", 1))
        assert results.get(timeout=30) == ("ready", 1)
        assert "pickle" in capfd.readouterr().err.lower()
    finally:
        requests.close()
        for end in (worker_requests, results, worker_results):
            end.close()


def test_the_writer_s_end_reads_as_end_of_file_though_a_forked_child_lives():
    """A DataLoader worker forked from the training process inherits every descriptor: had it kept its copy of
    an end, a writer's death would never read as end of file while it lives. A forked child closes them."""
    requests, worker_requests, results, worker_results = channels("test-feeder")
    child = os.fork()
    if child == 0:  # the DataLoader worker: lives on, touching nothing
        time.sleep(600)
        os._exit(0)
    try:
        close_child_ends(worker_results)  # the only writer left is the child, if it kept its copy
        with pytest.raises(EOFError):  # (queue.Empty after 30 s: the child's copy of the end is still open)
            results.get(timeout=30)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        requests.close()
        worker_requests.close()
        results.close()
