"""Rank processes for the multi-rank tests, forked from a server that has imported torch and tiered_ckpt once.

A new interpreter spends about 3 s of CPU importing torch; the multi-rank tests start a few hundred ranks, on
two cores. Each rank here is forked from a ``forkserver`` that imported them before it touched anything, so it
inherits no state of the test process, and runs its script as a new interpreter would: its own environment and
``sys.argv``, ``__main__``, non-daemon threads joined and ``atexit`` handlers run at the end, its exit code (or
the signal that killed it) reported. :class:`RankProcess` answers the part of ``subprocess.Popen`` the tests use.

What it does not do as an interpreter would: tear down its modules and native objects at the end (it leaves with
``os._exit``), so a crash there would go unseen. ``run_ranks(..., fresh=True)`` starts new interpreters instead;
some multi-rank tests use it, so that such a crash still fails a test.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import torch

# What rank scripts import first. A process has one fork server, started with the list set when it is first
# used, so tests/megatron_real/harness.py (whose ranks import megatron) takes this same list: whichever starts it,
# neither kind of rank imports its modules again (a missing one is skipped by the server). Megatron's modules touch
# CUDA at import, after which a forked child cannot use it: with CUDA, they are not preloaded (the harness spawns
# its CUDA ranks anyway).
PRELOAD = ["torch", "torch.distributed", "numpy", "tiered_ckpt", "tiered_ckpt.engine", "tiered_ckpt.builtin"]
if not torch.cuda.is_available():
    PRELOAD += ["megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
                "megatron.core.pipeline_parallel", "tiered_ckpt.megatron.adapter"]
_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(PRELOAD)


def _run_script(script: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    from tiered_ckpt import crashpoints

    crashpoints.arm(env.get(crashpoints.ENV))  # read from the environment at import, in the server
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read when torch was imported, in the server
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as an interpreter would, then the exit code says it failed
        traceback.print_exc()
        code = 1
    # An interpreter's end: wait for its non-daemon threads, then run its atexit handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class RankProcess:
    """``python script *argv`` with environment ``env``, forked from the server; stdout and stderr kept in files
    until :meth:`communicate` reads them."""

    def __init__(self, script: str | Path, argv: list[str], env: dict[str, str]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="rank-proc-")
        self._out, self._err = (os.path.join(self._dir.name, n) for n in ("out", "err"))
        self._proc = _ctx.Process(target=_run_script, args=(str(script), argv, dict(env), self._out, self._err))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise TimeoutError(f"rank process {self.pid} still running after {timeout} s")
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (``TimeoutError`` after ``timeout`` seconds, the process left running), then its
        stdout and stderr."""
        self.wait(timeout)
        out, err = (Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (self._out, self._err))
        self._dir.cleanup()
        return out, err

    def kill(self) -> None:
        """SIGKILL it, if it still runs, and wait for it to be gone (its locks released, its files closed)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.join(30)
            self.poll()


def start_rank(script: str | Path, argv: list[str], env: dict[str, str]) -> RankProcess:
    """Start one rank (``env`` is its whole environment, as for ``subprocess.Popen``)."""
    return RankProcess(script, argv, env)
