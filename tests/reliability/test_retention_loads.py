"""Issue #15: loads stay consistent while retention runs.

A saver commits step after step to a file tier that keeps only the newest ``keep`` steps, while loaders (engines
of their own on the same tier) load in a loop. Retention never removes the newest committed step, and a step
that vanishes between the listing and the read is not "no checkpoint": ``load()`` lists again and takes a newer
one. Seeded and bounded: a fixed number of saves and of loads per loader, zero NoCheckpointError.
"""

from __future__ import annotations

import random
import threading
import uuid

import pytest
import torch

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.errors import NoCheckpointError

SAVES, LOADS = 60, 80  # bounded: each loader loads LOADS times while SAVES steps are committed and retired


def _local(tmp_path, keep: int | None) -> dict:
    tier = {"name": "local", "kind": "local", "path": str(tmp_path / "local"), "fsync": False}
    return {**tier, "keep": keep} if keep else tier


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_checkpoint_error_never_appears_while_retention_runs(shm_root, tmp_path, seed):
    rng = random.Random(seed)
    saver = CheckpointEngine({"run_id": f"rs-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
                              "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}, _local(tmp_path, 1)]})
    loaders = [CheckpointEngine({"run_id": f"rl-{uuid.uuid4().hex[:8]}", "tiers": [_local(tmp_path, None)]})
               for _ in range(3)]
    try:
        saver.save(0, {"state": {"w": torch.zeros(256), "step": 0}}).wait(timeout=60)
        errors: list[BaseException] = []
        loaded: dict[int, list[int]] = {i: [] for i in range(len(loaders))}
        done = threading.Event()

        def save_loop() -> None:
            try:
                for step in range(1, SAVES + 1):
                    saver.save(step, {"state": {"w": torch.full((256,), float(step)), "step": step}})
                    if rng.random() < 0.2:
                        saver.wait(timeout=60)
                saver.wait(timeout=60)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
            finally:
                done.set()

        def load_loop(i: int, eng: CheckpointEngine, iterations: int) -> None:
            for _ in range(iterations):
                try:
                    res = eng.load()
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)
                    continue
                # what was loaded is that step's state, not a mix
                assert res.items["state"]["step"] == res.step
                assert torch.equal(res.items["state"]["w"], torch.full((256,), float(res.step)))
                loaded[i].append(res.step)

        threads = [threading.Thread(target=save_loop)]
        threads += [threading.Thread(target=load_loop, args=(i, eng, LOADS)) for i, eng in enumerate(loaders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert done.is_set()
        assert not [e for e in errors if isinstance(e, NoCheckpointError)], errors[:3]
        assert not errors, errors[:3]
        for steps in loaded.values():  # every load happened, each at least as new as the one before
            assert len(steps) == LOADS and steps == sorted(steps), steps
        assert loaders[0].load().step == SAVES
    finally:
        for eng in (saver, *loaders):
            eng.close()


def test_a_step_retired_between_listing_and_read_moves_to_the_newer_one(shm_root, tmp_path, monkeypatch):
    """The interleaving that made ``load()`` say "no checkpoint", forced: the loader has listed step 1 when the
    saver commits step 2 and retention (keep 1) removes step 1; the load lists again and takes step 2."""
    saver = CheckpointEngine({"run_id": f"rs-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
                              "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}, _local(tmp_path, 1)]})
    loader = CheckpointEngine({"run_id": f"rl-{uuid.uuid4().hex[:8]}", "tiers": [_local(tmp_path, None)]})
    try:
        saver.save(1, {"state": {"step": 1}}).wait(timeout=60)
        store = loader.pipeline.stores["local"]
        read_step = store.read_step
        raced: list[int] = []

        def racing(step, *args, **kwargs):
            if not raced:
                raced.append(step)
                saver.save(2, {"state": {"step": 2}}).wait(timeout=60)
                assert store.committed_steps() == [2]
            return read_step(step, *args, **kwargs)

        monkeypatch.setattr(store, "read_step", racing)
        res = loader.load()
        assert raced == [1] and res.step == 2 and res.items["state"]["step"] == 2 and res.verified
    finally:
        saver.close()
        loader.close()


@pytest.mark.parametrize("gone", ["directory", "manifest"])
def test_the_newest_step_removed_after_the_listing_moves_to_the_older_one(tmp_path, gone):
    """A review: the newest step listed and then removed by another process (its whole directory, or its manifest
    first, as retention un-commits) read as the tier's own error, and load() stopped, saying "the step is there"
    (a tier's errors are not damage). A step that is gone is gone: the older one is loaded."""
    import shutil

    cfg = {"run_id": f"rg-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "tiers": [_local(tmp_path, None)]}
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2):
            engine.save(step, {"state": {"step": torch.tensor(step)}}).wait(timeout=60)
    step_dir = tmp_path / "local" / "iter_0000002"
    with CheckpointEngine(cfg) as engine:
        listed = engine._checked_lists

        def listing_then_removal(*args):
            out = listed(*args)
            if gone == "directory":
                shutil.rmtree(step_dir)
            else:
                (step_dir / "tiered_ckpt" / "manifest.json").unlink()
            return out

        engine._checked_lists = listing_then_removal
        res = engine.load()
        assert res.step == 1 and int(res.items["state"]["step"]) == 1
