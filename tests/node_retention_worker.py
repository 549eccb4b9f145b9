"""One rank of tests/reliability/test_node_local_retention.py: two nodes, each with its own local tier behind the
faults plugin's control file; the given steps saved (the node listed in ``fail`` fails the steps named there), or
the checkpoint loaded."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from rank_main import rank_main  # noqa: E402

from tiered_ckpt import CheckpointEngine  # noqa: E402
from tiered_ckpt.errors import TieredCkptError  # noqa: E402


def body(rank: int, world: int, spec: dict, out: dict) -> None:
    from tiered_ckpt_faults import write_control_file

    from tiered_ckpt import node_commits

    node_commits.REFRESH_S = 0.1  # the nodes learn each other's commits within a training step's pause

    node = os.environ["TIERED_CKPT_NODE"]
    control = os.path.join(spec["base"], f"{node}.control.json")
    cfg = {"run_id": spec["run_id"], "drain": {"mode": spec.get("mode", "thread"), "commit_timeout_s": 10},
           "tiers": [{"name": "local", "kind": "faulty", "control_file": control, "keep": spec["keep"],
                      "inner": {"kind": "local", "path": os.path.join(spec["base"], node, "local")}}]}
    with CheckpointEngine(cfg) as engine:
        time.sleep(spec.get("settle_s", 0))  # a job's start-up: the nodes have told each other what they hold
        for step in spec.get("save", []):
            failing = step in spec.get("fail", {}).get(node, [])
            if failing:
                write_control_file(control, permanent_error=True)
            handle = engine.save(step, {"state": {"w": torch.full((4,), float(step))}})
            try:
                handle.wait(timeout=60)
            except TieredCkptError as exc:
                out.setdefault("failed", []).append(step)
                out.setdefault("why", str(exc)[:300])
            dist.barrier()  # every node done with this step (a training step's collective would do the same)
            if failing:
                write_control_file(control)
            time.sleep(spec.get("pause_s", 0))  # a training step's time: each node learns the others' commits
        if spec.get("load"):
            loaded = engine.load()
            out.update(step=loaded.step, w=loaded.items["state"]["w"].tolist())


if __name__ == "__main__":
    rank_main(body)
