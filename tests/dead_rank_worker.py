"""One rank of tests/reliability/test_dead_ranks.py (process drain): the victim's training process saves step 1
with its drain worker SIGSTOPped (so the worker writes nothing), then is SIGKILLed; the others save step 1 and
wait for it (``wait_committed`` where the spec asks). Each rank writes its worker's pid to ``spec["pids"]`` for
the test to kill the stopped one."""

from __future__ import annotations

import os
import signal
import time

from helpers import make_items
from rank_main import rank_main

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.errors import TieredCkptError

READY_S = 120


def body(rank: int, world: int, spec: dict, out: dict) -> None:
    with CheckpointEngine(spec["config"]) as engine:
        drain = engine._drain
        if not drain._ready.wait(READY_S):
            out["error"] = "the drain worker did not start"
            return
        with open(os.path.join(spec["pids"], str(rank)), "w") as f:
            f.write(str(drain._proc.pid))
        engine.coordinator.all_gather(None, "workers ready")  # every save goes to a running worker
        if rank == spec["victim"]:
            os.kill(drain._proc.pid, signal.SIGSTOP)
            engine.save(1, make_items(100 + rank))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(spec.get("delay_of", {}).get(str(rank), 0))
        handle = engine.save(1, make_items(100 + rank))
        try:
            if spec.get("wait_committed"):
                engine.wait_committed(handle, timeout=100)
            else:
                handle.wait(timeout=100)
            out["ok"] = True
        except TieredCkptError as exc:
            out["save_error"] = str(exc)[:2000]


if __name__ == "__main__":
    rank_main(body)
