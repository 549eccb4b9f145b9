"""One rank of a multi-rank test job (started by tests/test_multirank.py through run_ranks)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from helpers import assert_same, make_items  # noqa: E402
from rank_main import rank_main  # noqa: E402

from tiered_ckpt import CheckpointEngine, ParallelLayout  # noqa: E402
from tiered_ckpt.errors import TieredCkptError  # noqa: E402

EMPTY_RANKS: set[int] = set()  # ranks with nothing of their own to save (spec "empty_ranks")


def items_for(step: int, rank: int, run: int = 0) -> dict:
    """A rank's state at ``step``; ``run`` tells apart the saves of one step by different jobs (a re-run)."""
    return {} if rank in EMPTY_RANKS else make_items(step * 100 + rank + run * 100_000)


def body(rank: int, world: int, spec: dict, out: dict) -> None:
    EMPTY_RANKS.update(spec.get("empty_ranks", ()))
    cfg = spec["configs"][str(rank)] if "configs" in spec else spec["config"]
    layout = spec.get("parallels", {}).get(str(rank), spec.get("parallel"))  # "parallels": a rank's own
    parallel = ParallelLayout(**layout) if layout else None
    with CheckpointEngine(cfg, parallel) as engine:
        out["recovered"] = [h.step for h in engine.recovered]
        out["load_waits_for_recovery"] = engine._recovering
        for h in engine.recovered:
            try:
                h.wait(timeout=60)
            except TieredCkptError as exc:
                out.setdefault("recover_errors", []).append(str(exc))
        if spec.get("nowait"):  # every save at once, then the drain's end (its errors reported, not raised)
            for step in spec["nowait"]:
                engine.save(step, items_for(step, rank))
            try:
                engine.wait(timeout=120)
            except TieredCkptError as exc:
                out["wait_error"] = str(exc)[:2000]
        previous = None
        for step in spec.get("save_of", {}).get(str(rank), spec.get("save", [])):  # "save_of": rank → steps
            time.sleep(spec.get("delay_of", {}).get(str(rank), 0))  # "delay_of": rank → seconds before each save
            handle = engine.save(step, items_for(step, rank, spec.get("run", 0)))
            out.setdefault("blocking", []).append(handle.blocking_s)
            try:
                if spec.get("wait_committed"):  # then list the file tiers at once: the step must be there
                    engine.wait_committed(handle, timeout=60)
                    out.setdefault("listed", {})[step] = {t: step in steps for t, steps in
                                                         engine.available_steps().items() if t in handle.due}
                else:
                    handle.wait(timeout=60)
                if spec.get("wait_previous") and previous is not None:  # the previous save's commit, late
                    time.sleep(spec["wait_previous"])
                    engine.wait_committed(previous, timeout=60)
                    out.setdefault("previous_committed", []).append(previous.step)
            except TieredCkptError as exc:
                out.setdefault("save_errors", {})[step] = str(exc)
            previous = handle
        if "bad_into_rank" in spec:  # one rank asks load() for what the checkpoint cannot go into
            into = items_for(0, rank)
            if rank == spec["bad_into_rank"]:
                into["state"]["model"]["embedding.weight"] = torch.zeros(3)
            try:
                engine.load(into=into)
                out["first_load"] = "loaded"
            except TieredCkptError as exc:
                out["first_load"] = f"{type(exc).__name__}: {exc}"
        if "collective" in spec:  # the ranks at different exchanges
            try:
                if rank == 0:
                    engine.coordinator.agree_on_step({1})
                else:
                    engine.coordinator.all_succeeded(True)
                out["collective"] = "passed"
            except TieredCkptError as exc:
                out["collective"] = f"{type(exc).__name__}: {exc}"
        if spec.get("load"):
            loaded = engine.load()
            # "runs_of": {run: [steps]}, the job that saved each step last (default 0)
            runs = {step: int(run) for run, steps in spec.get("runs_of", {}).items() for step in steps}
            assert_same(items_for(loaded.step, rank, runs.get(loaded.step, 0)), loaded.items)
            out.update(step=loaded.step, tier=loaded.tier, verified=loaded.verified)
        out["available"] = engine.available_steps()


if __name__ == "__main__":
    rank_main(body)
