"""Corruption: a flipped byte, a truncated, emptied or deleted file of each kind on each tier.

Every case ends one of three ways, never a fourth: the damage is detected and the next tier's copy of the same
step is loaded (bit-exact), the damage is harmless and the data still bit-exact, or — when no tier holds a good
copy — a clear error for that step and the next older step for ``load()``. Never a silently wrong value.

Kinds of files: on ``shm`` a snapshot's data and its record (``slot_i.data``, ``slot_i.json``); on ``local`` and
``shared`` (``file://``) the item files, the rank manifest, the checkpoint manifest and Megatron's tracker.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
from crash_worker import scenario_items
from helpers import assert_same, cli

from tiered_ckpt import CheckpointEngine, CheckpointUnreadableError
from tiered_ckpt.cli import EXIT_FAILED, EXIT_NOT_FOUND
from tiered_ckpt.memory_store import SlotMeta

STEPS = (1, 2)
KINDS = {
    "shm": ("data", "record"),
    "local": ("data", "manifest", "rank_manifest", "tracker"),
    "shared": ("data", "manifest", "rank_manifest", "tracker"),
}
DAMAGE = ("flip_start", "flip_middle", "flip_end", "truncate", "empty", "delete")
CASES = [(tier, kind, damage) for tier, kinds in KINDS.items() for kind in kinds for damage in DAMAGE]
# Damage that load() never reads: the rank manifests (votes, superseded by the checkpoint manifest) and
# Megatron's tracker (load() reads the manifests; the next commit rewrites the tracker).
HARMLESS = ("rank_manifest", "tracker")
# What each tier falls back to in these tests: the tier is listed first, this one second.
BACKUP = {"shm": "local", "local": "shared", "shared": "local"}


def items(step: int) -> dict:
    return scenario_items(step, 1)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Steps 1 and 2 committed on local and shared and snapshotted in shm; copied afresh for every test."""
    root = tmp_path_factory.mktemp("pristine")
    run_id = "pristine"
    cfg = {"run_id": f"corrupt-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(root / "shm")},
                     {"name": "local", "kind": "local", "path": str(root / "local"), "fsync": False},
                     {"name": "shared", "kind": "fsspec", "url": f"file://{root / 'shared'}"}]}
    with CheckpointEngine(cfg) as engine:
        for step in STEPS:
            engine.save(step, items(step)).wait(timeout=60)
    # the shm tier keeps {path}/{user}/{run_id}: rename the run so that every copy gets its own
    user_dir = next((root / "shm").iterdir())
    (user_dir / cfg["run_id"]).rename(user_dir / run_id)
    return root


class Copy:
    """A private copy of the pristine tiers, with helpers to find and damage their files."""

    def __init__(self, pristine: Path, tmp_path: Path, shm_root: str):
        self.root = tmp_path
        self.run_id = f"corrupt-{uuid.uuid4().hex[:8]}"
        for name in ("local", "shared"):
            shutil.copytree(pristine / name, tmp_path / name)
        self.shm_root = Path(shm_root)
        user_dir = next((pristine / "shm").iterdir())
        shutil.copytree(user_dir / "pristine", self.shm_root / user_dir.name / self.run_id)

    def tier_cfg(self, name: str) -> dict:
        return {"shm": {"name": "shm", "kind": "shm", "path": str(self.shm_root)},
                "local": {"name": "local", "kind": "local", "path": str(self.root / "local"), "fsync": False},
                "shared": {"name": "shared", "kind": "fsspec", "url": f"file://{self.root / 'shared'}"}}[name]

    def config(self, *names: str, **top) -> dict:
        return {"run_id": self.run_id, "drain": {"mode": "thread"}, "tiers": [self.tier_cfg(n) for n in names],
                **top}

    def key(self, tier: str, kind: str, step: int = 2) -> str:
        path = self.path(tier, kind, step)
        base = path.parent.parent if tier == "shm" else self.root / tier
        return str(path.relative_to(base))

    def path(self, tier: str, kind: str, step: int = 2) -> Path:
        if tier == "shm":
            rank_dir = next(self.shm_root.glob(f"*/{self.run_id}/rank_00000"))
            for record in rank_dir.glob("slot_*.json"):
                if json.loads(record.read_text())["step"] == step:
                    return record if kind == "record" else record.with_suffix(".data")
            raise AssertionError(f"no slot holds step {step}")
        base = self.root / tier
        return {"data": base / f"iter_{step:07d}/rank_00000/state.flat",
                "manifest": base / f"iter_{step:07d}/tiered_ckpt/manifest.json",
                "rank_manifest": base / f"iter_{step:07d}/tiered_ckpt/rank_00000.json",
                "tracker": base / "latest_checkpointed_iteration.txt"}[kind]


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how.startswith("flip_"):
        pos = {"flip_start": min(20, len(data) - 1), "flip_middle": len(data) // 2, "flip_end": len(data) - 1}[how]
        flip(path, pos)
    elif how == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()


def flip(path: Path, pos: int, bit: int = 2) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


@pytest.fixture
def copy(pristine, tmp_path, shm_root):
    return Copy(pristine, tmp_path, shm_root)



@pytest.mark.parametrize("tier,kind,how", CASES, ids=["-".join(c) for c in CASES])
def test_damaged_file_is_detected_and_the_next_tier_used(copy, tier, kind, how, recorder):
    damage(copy.path(tier, kind), how)
    backup = BACKUP[tier]
    with CheckpointEngine(copy.config(tier, backup)) as engine:
        loaded = engine.load()
        assert loaded.step == 2
        assert_same(items(2), loaded.items)
        if kind in HARMLESS:
            assert loaded.tier == tier
        else:
            assert loaded.tier == backup, f"the damaged copy on {tier!r} was used"
        if kind in ("data", "manifest") and how != "delete":  # a fallback event names the tier and the file
            fallbacks = recorder.kinds("fallback", tier)
            assert fallbacks and fallbacks[0].step == 2, recorder.events
            assert fallbacks[0].detail["key"] == copy.key(tier, kind)
            assert fallbacks[0].message.startswith(f"tier {tier!r}, file {copy.key(tier, kind)!r}: ")
        # The damaged tier takes the next step; Megatron's tracker names it, whatever the damage was.
        if tier != "shm":
            engine.save(3, items(3)).wait(timeout=60)
            assert (copy.root / tier / "latest_checkpointed_iteration.txt").read_text() == "3"
            assert_same(items(3), engine._load_from(tier, 3, True, None)[0])
    if tier != "shm" and kind in ("data", "manifest"):
        config = json_config(copy, tier)
        code, out = cli("verify", "--config", config, "--step", "2", "--json")
        if how == "delete" and kind == "manifest":
            assert code == EXIT_NOT_FOUND  # step 2 is no longer committed there
        else:
            assert code == EXIT_FAILED, out
            assert not json.loads(out)[0]["ok"]
        if kind == "manifest" and how != "delete":
            code, out = cli("ls", "--config", config, "--json")
            states = {r["step"]: r["state"] for r in json.loads(out)}
            assert states[2].startswith("corrupt manifest"), states


def json_config(copy: Copy, *names: str) -> str:
    path = copy.root / f"tiers-{'-'.join(names)}.json"
    path.write_text(json.dumps(copy.config(*names)))
    return str(path)


@pytest.mark.parametrize("kind", ["data", "manifest", "rank_manifest"])
def test_no_good_copy_left_is_a_clear_error_and_load_moves_to_an_older_step(copy, kind, recorder):
    for tier in ("local", "shared"):
        flip(copy.path(tier, kind), os.path.getsize(copy.path(tier, kind)) // 2)
    with CheckpointEngine(copy.config("local", "shared")) as engine:
        if kind == "rank_manifest":  # not read by load(): the checkpoint manifest lists every file
            assert engine.load().step == 2
            return
        with pytest.raises(CheckpointUnreadableError, match="step 2") as info:
            engine.load(step=2)
        if kind == "data":
            assert "'local'" in str(info.value) and "'shared'" in str(info.value)
            assert "checksum" in str(info.value)
        older = engine.load()
        assert older.step == 1
        assert_same(items(1), older.items)


def test_shm_snapshot_damaged_before_its_checksums_were_recorded_is_not_reported_verified(copy):
    """A snapshot's checksums are computed after the commit (off the time-to-durable path): one without them
    loads, but ``verified`` says it was not checked."""
    record = copy.path("shm", "record")
    meta = SlotMeta.from_json(record.read_bytes(), "", "shm")
    for item in meta.items:
        item.checksum = None
    record.write_bytes(meta.to_json())
    with CheckpointEngine(copy.config("shm", "local")) as engine:
        loaded = engine.load()
        assert (loaded.step, loaded.tier, loaded.verified) == (2, "shm", False)


def _sweep(engine, target: Path, stride: int, expect_tier: str) -> int:
    """Flip one bit at every ``stride``-th byte of ``target`` in turn; each time load() must give step 2,
    bit-exact, from ``expect_tier`` (the damaged copy is never used). Returns the number of flips."""
    original = target.read_bytes()
    flips = 0
    try:
        for pos in range(0, len(original), stride):
            data = bytearray(original)
            data[pos] ^= 1 << (pos % 8)
            target.write_bytes(data)
            for store in engine.pipeline.stores.values():
                getattr(store, "_manifests", {}).clear()  # committed manifests are cached: as after a restart
            loaded = engine.load()
            assert (loaded.step, loaded.tier) == (2, expect_tier), f"byte {pos}: {original[pos - 20:pos + 20]!r}"
            assert_same(items(2), loaded.items)
            flips += 1
    finally:
        target.write_bytes(original)
    return flips


@pytest.mark.slow
def test_every_flipped_byte_of_a_manifest_is_detected(copy):
    """Regression: a flip that still parsed (an item's name, a file's rank, the parallel layout) loaded a
    different checkpoint (missing or renamed items) or raised a bare ValueError; manifests now carry a digest."""
    with CheckpointEngine(copy.config("local", "shared")) as engine:
        assert _sweep(engine, copy.path("local", "manifest"), 2, "shared") > 300


@pytest.mark.slow
def test_every_flipped_byte_of_a_snapshot_record_is_detected(copy):
    """Regression: the shm slot record holds each item's flat header (structure, names, Python values) and the
    snapshot's step, none covered by the data checksums: flips loaded a wrong learning rate, renamed keys,
    swapped tensors. Records now carry a digest."""
    with CheckpointEngine(copy.config("shm", "local")) as engine:
        assert _sweep(engine, copy.path("shm", "record"), 11, "local") > 500


def test_a_tier_returning_flipped_bits_is_caught_by_the_checksums(copy, recorder):
    """A replica that reads back wrong (bad memory, a flaky NIC; the ``faulty`` plugin's flip_bits_on_read) is
    never loaded as numbers: the next tier's copy is, or — with none left — a clear error."""
    flaky = {"name": "flaky", "kind": "faulty", "flip_bits_on_read": True, "seed": 3,
             "inner": {"kind": "local", "path": str(copy.root / "local")}}
    cfg = copy.config("shared")
    cfg["tiers"].insert(0, flaky)
    with CheckpointEngine(cfg) as engine:
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (2, "shared")
        assert_same(items(2), loaded.items)
        assert recorder.kinds("fallback", "flaky")  # the manifest's digest or a file's checksum: what broke first
    with CheckpointEngine({**cfg, "tiers": [flaky]}) as engine:
        with pytest.raises(CheckpointUnreadableError, match="tier 'flaky' step 2: .*tier 'flaky' step 1: "):
            engine.load()


@pytest.mark.parametrize("text", ["²", "9" * 5000, "release", "-1", ""])
def test_a_tracker_that_names_no_step_is_replaced_by_the_next_commit(copy, text):
    """Regression: a tracker of unicode digits or 5000 digits made every later commit on the tier fail (a bare
    ValueError); one naming a step that was never committed kept Megatron's tracker there for good."""
    (copy.root / "local" / "latest_checkpointed_iteration.txt").write_text(text)
    with CheckpointEngine(copy.config("local")) as engine:
        assert engine.load().step == 2
        engine.save(3, items(3)).wait(timeout=60)
    assert (copy.root / "local" / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_an_unreadable_slot_record_is_logged_once_and_skipped(copy, caplog):
    record = copy.path("shm", "record")
    record.write_text("{not json")
    with CheckpointEngine(copy.config("shm", "local")) as engine, caplog.at_level("WARNING"):
        assert engine.load().tier == "local"
        assert engine.load().tier == "local"
    warned = [r for r in caplog.records if "is unreadable and is ignored" in r.getMessage()]
    assert len(warned) == 1 and record.name in warned[0].getMessage()
