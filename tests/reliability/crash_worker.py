"""Runs crash scenarios for ``test_crash_points.py``: a training process saves some steps and dies by SIGKILL at a
crash point (``tiered_ckpt.crashpoints``).

Two ways to run it:

* ``python crash_worker.py run SPEC_JSON`` runs one scenario in this process (handy to reproduce a failure);
* ``python crash_worker.py serve`` imports torch and tiered_ckpt once, then reads one scenario per line on stdin,
  forks a fresh process for each, waits until it and every process it started (the drain worker) are gone, and
  answers one JSON line: ``{"status": "killed" | "exited" | "timeout", "code": ...}``. Forking a warm process
  instead of starting Python each time keeps 80 crashes inside a couple of minutes.

A scenario (``SPEC_JSON``): ``config`` (the engine's), ``crash_at`` (``point`` or ``point:N``), ``steps``,
``scales`` and ``wait`` (per save: item size factor, and whether to wait for its drain), ``log`` (stdout and
stderr of the scenario go there).

In drain process mode a crash point in the drain worker kills only the worker; the scenario then kills its own
process too, as when a node dies with every process on it. A training process killed first leaves the worker
orphaned: it finishes what it has, then exits, as it does in production.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers import make_items  # noqa: E402

from tiered_ckpt import CheckpointEngine, SaveError, crashpoints  # noqa: E402
from tiered_ckpt.plugins import get_plugin_manager  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
SCENARIO_TIMEOUT_S = 90.0


def scenario_items(step: int, scale: int) -> dict:
    """Two items (so that a crash can strike between them), sizes varying with ``scale``."""
    g = torch.Generator().manual_seed(10_000 + step)
    items = make_items(step, scale)
    items["aux"] = {"step": torch.tensor([step]), "noise": torch.randn(37 * scale, generator=g),
                    "tokens": torch.randint(0, 50_000, (5, 3 * scale), generator=g)}
    return items


def _die_with_the_drain_worker(engine: CheckpointEngine) -> None:
    """A thread: once a drain worker of this engine was SIGKILLed, SIGKILL this process too (a lost node takes
    every process). Every worker ever started is watched: a save restarts a dead one at once."""
    drain = getattr(engine._drain, "proc", engine._drain)  # SplitDrain: its process part
    if not hasattr(drain, "_proc"):
        return
    seen: list = []

    def watch() -> None:
        while True:
            proc = drain._proc
            if proc is not None and proc not in seen:
                seen.append(proc)
            if any(p.exitcode == -signal.SIGKILL for p in seen):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    # The watcher's poll can come late: the drain learns of its worker's death at once (its pipe's end of file),
    # and this process would report the worker's saves failed and go on. Before it does, the node is lost.
    handle_death = drain._worker_died

    def worker_died(proc: Any, why: str | None = None) -> None:
        if why is None and not drain._closing:  # (why: a worker that said it failed, then was killed here)
            proc.join(10)
            if proc.exitcode == -signal.SIGKILL:
                os.kill(os.getpid(), signal.SIGKILL)
        handle_death(proc, why)

    drain._worker_died = worker_died


def run_scenario(spec: dict) -> None:
    crashpoints.arm(spec["crash_at"])
    engine = CheckpointEngine(spec["config"])
    _die_with_the_drain_worker(engine)
    drain = getattr(engine._drain, "proc", engine._drain)
    if hasattr(drain, "_ready"):  # process mode: the worker drains, not this process's threads while it starts
        assert drain._ready.wait(SCENARIO_TIMEOUT_S), "the drain worker never came up"
    for step, scale, wait in zip(spec["steps"], spec["scales"], spec["wait"], strict=True):
        handle = engine.save(step, scenario_items(step, scale))
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"saved {step}\n".encode())  # one write: never split by another's log line
        if wait:
            try:
                handle.wait(timeout=60)
            except SaveError as exc:
                print(f"save {step} failed: {exc}", flush=True)
    engine.wait(60)
    time.sleep(0.05)  # the watcher's last look
    engine.close()
    print("COMPLETED without reaching the crash point", flush=True)


def _reap_all(leader: int, deadline: float) -> bool:
    """Wait for every process of the scenario (orphans come to us: we are a subreaper); False on timeout."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            if time.monotonic() > deadline:
                try:
                    os.killpg(leader, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                while True:  # collect what the kill left
                    try:
                        os.waitpid(-1, 0)
                    except ChildProcessError:
                        return False
            time.sleep(0.01)


def _run_forked(spec: dict) -> dict:
    pid = os.fork()
    if pid == 0:  # the scenario: its own process group, output to its log
        code = 1
        try:
            os.setpgid(0, 0)
            fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdin.close()
            run_scenario(spec)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    status = None
    while status is None:
        done, status_ = os.waitpid(pid, os.WNOHANG)
        if done:
            status = status_
        elif time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _reap_all(pid, time.monotonic() + 10)
            return {"status": "timeout", "code": None}
        else:
            time.sleep(0.01)
    reaped = _reap_all(pid, deadline)
    if os.WIFSIGNALED(status):
        out = {"status": "killed", "code": -os.WTERMSIG(status)}
    else:
        out = {"status": "exited", "code": os.WEXITSTATUS(status)}
    if not reaped:
        out["stragglers"] = "killed after the timeout"
    return out


def serve() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    get_plugin_manager()  # warm: entry points loaded once, inherited by every fork
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        result = _run_forked(json.loads(line))
        print(json.dumps(result), file=out, flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve()
    elif sys.argv[1:2] == ["run"] and len(sys.argv) == 3:
        run_scenario(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: crash_worker.py serve | run SPEC_JSON")
