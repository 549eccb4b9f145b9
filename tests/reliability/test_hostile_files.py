"""Hostile files inside a file tier: links, FIFOs, files far larger than their manifest says, temporary files that
vanish before their rename.

* A link below a tier's root is never followed: not on writes (a step directory that is a link to elsewhere fails
  the save with an error naming it, instead of a "committed" step the listing never sees), not on reads (a data
  file or manifest linked to a copy outside the tier is a corruption, and the load falls back to the next tier),
  not on deletes (what the link points to stays).
* A FIFO where a data file, manifest or tracker should be blocks neither ``load()``, ``tiered-ckpt ls/verify``
  nor the commit: it is refused as what it is.
* A data file far larger than its manifest records is refused before a byte of it is read.
* A temporary file removed before its rename (``gc --delete`` while the drain writes) fails that attempt as
  transient: the engine writes the file again and the step commits.

Each case runs on the ``local`` kind, on ``fsspec`` with a ``file://`` URL and, at the tier level, on ``shm``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest
from crash_worker import scenario_items
from helpers import assert_same
from helpers import cli as run_cli

from tiered_ckpt import CheckpointEngine, SaveError
from tiered_ckpt.cli import EXIT_FAILED
from tiered_ckpt.errors import CorruptionError, PermanentTierError, TransientTierError
from tiered_ckpt.tiers import _files

HANG_GUARD_S = 60  # not a performance bound: how long a call may sit on a FIFO before the test unblocks it
BIG = 256 << 20  # a sparse file: nothing of it is on disk, all of it would be resident if it were read
STEPS = (1, 2)

cli = functools.partial(run_cli, stderr=True)  # these tests read the CLI's errors too


def no_hang(fn, fifo: Path):
    """``fn()`` on a thread. If it is still blocked after :data:`HANG_GUARD_S`, the FIFO's other end is opened
    and closed (the reader sees end-of-file) and the test fails: the call blocked on the FIFO."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    if t.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(HANG_GUARD_S)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if "error" in out:
        raise out["error"]
    return out.get("value")



# ----- the tier primitives ---------------------------------------------------------------------------------
@pytest.fixture(params=["local", "shm", "fsspec-file"])
def tier(request, make_tier, tmp_path):
    if request.param == "local":
        t = make_tier("local", path=str(tmp_path / "root"), fsync=False)
    elif request.param == "shm":
        t = make_tier("shm")
    else:
        t = make_tier("fsspec", url=f"file://{tmp_path}/root")
    t.write_blob("seed", [b"s"])  # the root exists from here on, whatever the kind
    return t


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    return path


def test_a_link_where_a_step_directory_should_be_is_never_written_through(tier, outside):
    link = Path(tier.root) / "iter_0000001"
    link.symlink_to(outside)
    with pytest.raises(PermanentTierError, match="is a symbolic link") as info:
        tier.write_blob("iter_0000001/rank_00000/state.flat", [b"data"])
    assert str(link) in str(info.value)
    assert list(outside.iterdir()) == []


def test_reads_never_follow_a_link_out_of_the_tier(tier, outside):
    root = Path(tier.root)
    (outside / "iter_0000001").mkdir()
    (outside / "iter_0000001" / "state.flat").write_bytes(b"not the tier's")
    (outside / "file").write_bytes(b"not the tier's")
    (root / "iter_0000001").symlink_to(outside / "iter_0000001")
    (root / "linked").symlink_to(outside / "file")
    for key in ("iter_0000001/state.flat", "linked"):
        for read in (tier.read_blob, tier.read_blob_hashed, lambda k: tier.read_range(k, 0, 1), tier.size):
            with pytest.raises(CorruptionError, match="is a symbolic link") as info:
                read(key)
            assert key.split("/")[0] in str(info.value)
    assert tier.list() == ["linked", "seed"]  # the linked file is listed (reading it says why it is refused)
    assert tier.list("iter_0000001/") == [] and not tier.exists("iter_0000001/state.flat")


def test_deleting_through_a_linked_directory_leaves_what_it_points_to(tier, outside):
    root = Path(tier.root)
    (outside / "state.flat").write_bytes(b"keep")
    (root / "iter_0000001").symlink_to(outside)
    tier.delete("iter_0000001/state.flat")
    tier.delete_prefix("iter_0000001")
    assert (outside / "state.flat").read_bytes() == b"keep"
    assert not os.path.lexists(root / "iter_0000001")  # the link itself is the tier's entry: removed


def test_a_fifo_where_a_blob_should_be_is_refused_without_blocking(tier):
    root = Path(tier.root)
    (root / "iter_0000001").mkdir()
    fifo = root / "iter_0000001" / "state.flat"
    os.mkfifo(fifo)
    key = "iter_0000001/state.flat"
    for read in (tier.read_blob, tier.read_blob_hashed, lambda k: tier.read_range(k, 0, 1), tier.size):
        with pytest.raises(CorruptionError, match="is a FIFO") as info:
            no_hang(lambda r=read: r(key), fifo)
        assert str(fifo) in str(info.value)
    assert tier.list("iter_0000001/") == [key]
    tier.write_blob(key, [b"data"])  # a write replaces it
    assert bytes(tier.read_blob(key).cpu().numpy()) == b"data"


def test_a_file_larger_than_its_manifest_says_is_not_read(tier, monkeypatch):
    tier.write_blob("iter_0000001/state.flat", [b"0123456789"])
    os.truncate(Path(tier.root) / "iter_0000001" / "state.flat", BIG)
    reads = []
    real = _files.read_file
    monkeypatch.setattr(_files, "read_file", lambda fd, size, **kw: reads.append(size) or real(fd, size, **kw))
    with pytest.raises(CorruptionError, match=f"is {BIG} bytes, more than the 10 bytes its manifest records"):
        tier.read_blob_hashed("iter_0000001/state.flat", None, max_size=10)
    assert reads == []
    assert tier.read_blob_hashed("seed", None, max_size=1).numel() == 1  # the size itself is fine


def test_a_temp_file_that_vanishes_before_its_rename_is_a_transient_failure(tier):
    root = Path(tier.root)

    def chunks():
        yield b"a" * 100
        for tmp in root.rglob(".*.tmp-*"):  # what gc --delete does to a write in flight
            tmp.unlink()
        yield b"b"

    with pytest.raises(TransientTierError, match="vanished before its rename"):
        tier.write_blob("iter_0000001/state.flat", chunks())
    assert not tier.exists("iter_0000001/state.flat")
    assert tier.write_blob("iter_0000001/state.flat", [b"again"]) == 5
    assert bytes(tier.read_blob("iter_0000001/state.flat").cpu().numpy()) == b"again"


# ----- through the engine, the CLI and the commit ------------------------------------------------------------
TIERS = ("local", "shared")
BACKUP = {"local": "shared", "shared": "local"}


def items(step: int) -> dict:
    return scenario_items(step, 1)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Steps 1 and 2 committed on ``local`` and ``shared`` (``file://``); copied afresh for every test."""
    root = tmp_path_factory.mktemp("pristine")
    with CheckpointEngine(Copy.make_config(root, f"hostile-{uuid.uuid4().hex[:8]}")) as engine:
        for step in STEPS:
            engine.save(step, items(step)).wait(timeout=60)
    return root


class Copy:
    def __init__(self, pristine: Path, tmp_path: Path):
        self.root = tmp_path
        self.run_id = f"hostile-{uuid.uuid4().hex[:8]}"
        for name in TIERS:
            shutil.copytree(pristine / name, tmp_path / name)
        self.outside = tmp_path / "outside"
        self.outside.mkdir()

    @staticmethod
    def make_config(root: Path, run_id: str, *names: str) -> dict:
        tiers = {"local": {"name": "local", "kind": "local", "path": str(root / "local"), "fsync": False},
                 "shared": {"name": "shared", "kind": "fsspec", "url": f"file://{root / 'shared'}"}}
        return {"run_id": run_id, "drain": {"mode": "thread"}, "tiers": [tiers[n] for n in names or TIERS]}

    def config(self, *names: str) -> dict:
        return self.make_config(self.root, self.run_id, *names)

    def config_file(self, *names: str) -> str:
        path = self.root / f"tiers-{'-'.join(names)}.json"
        path.write_text(json.dumps(self.config(*names)))
        return str(path)

    def key(self, what: str, step: int = 2) -> str:
        return {"data": f"iter_{step:07d}/rank_00000/state.flat",
                "manifest": f"iter_{step:07d}/tiered_ckpt/manifest.json",
                "tracker": "latest_checkpointed_iteration.txt"}[what]

    def path(self, tier: str, what: str, step: int = 2) -> Path:
        return self.root / tier / self.key(what, step)


@pytest.fixture
def copy(pristine, tmp_path):
    return Copy(pristine, tmp_path)


def assert_fell_back(copy: Copy, tier: str, what: str, loaded, recorder, match: str) -> None:
    assert (loaded.step, loaded.tier) == (2, BACKUP[tier]), f"the hostile copy on {tier!r} was used"
    assert_same(items(2), loaded.items)
    fallbacks = recorder.kinds("fallback", tier)
    assert fallbacks and fallbacks[0].detail["key"] == copy.key(what), recorder.events
    assert match in fallbacks[0].message, fallbacks[0].message


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("what", ["data", "manifest"])
def test_a_link_to_an_identical_copy_outside_the_tier_is_refused_and_the_next_tier_used(copy, tier, what,
                                                                                      recorder):
    path = copy.path(tier, what)
    moved = copy.outside / path.name
    shutil.move(path, moved)  # the very same bytes: they would verify
    path.symlink_to(moved)
    with CheckpointEngine(copy.config(tier, BACKUP[tier])) as engine:
        assert_fell_back(copy, tier, what, engine.load(), recorder, "is a symbolic link")
    code, out = cli("verify", "--config", copy.config_file(tier), "--step", "2", "--json")
    assert code == EXIT_FAILED and "symbolic link" in out, out


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("what", ["data", "manifest", "tracker"])
def test_a_fifo_blocks_neither_load_ls_verify_nor_the_commit(copy, tier, what, recorder):
    fifo = copy.path(tier, what)
    fifo.unlink()
    os.mkfifo(fifo)
    with CheckpointEngine(copy.config(tier, BACKUP[tier])) as engine:
        loaded = no_hang(engine.load, fifo)
        if what == "tracker":  # load() reads the manifests, not Megatron's tracker
            assert (loaded.step, loaded.tier) == (2, tier)
        else:
            assert_fell_back(copy, tier, what, loaded, recorder, "is a FIFO")
        config = copy.config_file(tier)
        code, out = no_hang(lambda: cli("ls", "--config", config, "--json"), fifo)
        assert code in (0, EXIT_FAILED), out
        code, out = no_hang(lambda: cli("verify", "--config", config, "--step", "2", "--json"), fifo)
        if what == "tracker":
            assert code == 0, out
        else:
            assert code == EXIT_FAILED and "FIFO" in out, out
        # The commit reads the tracker (never moved backwards): a FIFO there is a damaged tracker, replaced.
        handle = engine.save(3, items(3))
        no_hang(lambda: handle.wait(timeout=60), fifo)
        assert_same(items(3), engine._load_from(tier, 3, True, None)[0])
        assert copy.path(tier, "tracker").read_text() == "3"


@pytest.mark.parametrize("tier", TIERS)
def test_a_save_into_a_linked_step_directory_fails_instead_of_committing_invisibly(copy, tier):
    (copy.root / tier / "iter_0000003").symlink_to(copy.outside)
    with CheckpointEngine(copy.config(tier)) as engine:
        with pytest.raises(SaveError, match="symbolic link"):
            engine.save(3, items(3)).wait(timeout=60)
        assert engine.load().step == 2
    assert list(copy.outside.iterdir()) == []


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """The sizes of every whole-file read the file tiers make from now on."""
    sizes: list[int] = []
    real = _files.read_file
    monkeypatch.setattr(_files, "read_file", lambda fd, size, **kw: sizes.append(size) or real(fd, size, **kw))
    return sizes


@pytest.mark.parametrize("tier", TIERS)
def test_a_data_file_far_larger_than_its_manifest_says_is_not_read(copy, tier, recorder, reads):
    os.truncate(copy.path(tier, "data"), BIG)
    with CheckpointEngine(copy.config(tier, BACKUP[tier])) as engine:
        assert_fell_back(copy, tier, "data", engine.load(), recorder, f"is {BIG} bytes, more than the")
    assert BIG not in reads


@pytest.mark.parametrize("tier", TIERS)
def test_a_huge_file_where_the_manifest_should_be_is_not_read(copy, tier, recorder, reads):
    """A manifest has no manifest to bound it: a file far above any manifest's size is refused before a read."""
    os.truncate(copy.path(tier, "manifest"), BIG)
    with CheckpointEngine(copy.config(tier, BACKUP[tier])) as engine:
        assert_fell_back(copy, tier, "manifest", engine.load(), recorder, f"{BIG} bytes where a manifest should be")
    assert BIG not in reads
    code, out = cli("verify", "--config", copy.config_file(tier), "--step", "2", "--json")
    assert code == EXIT_FAILED and "where a manifest should be" in out, out


@pytest.mark.parametrize("tier", TIERS)
def test_a_temp_file_removed_during_the_drain_is_written_again(copy, tier, recorder, monkeypatch):
    removed = []
    real = _files.crash_point

    def gc_strikes(name: str) -> None:  # gc --delete removing the drain's temp files, once, before the rename
        if name.endswith("temp_written") and not removed:
            removed.extend(p for p in (copy.root / tier).rglob(".*.tmp-*"))
            for p in removed:
                p.unlink()
        real(name)

    monkeypatch.setattr(_files, "crash_point", gc_strikes)
    with CheckpointEngine(copy.config(tier)) as engine:
        engine.save(3, items(3)).wait(timeout=60)
        assert removed
        retries = recorder.kinds("retry", tier)
        assert retries and "vanished before its rename" in retries[0].message, recorder.events
        loaded = engine.load()
        assert loaded.step == 3
        assert_same(items(3), loaded.items)


def test_a_fifo_or_a_linked_directory_where_a_slot_should_be_is_refused(make_tier, outside):
    tier = make_tier("shm")
    tier.allocate_slot("rank_00000/slot_0.data", 4096)
    root = Path(tier.root)
    os.mkfifo(root / "rank_00000" / "slot_1.data")
    with pytest.raises(PermanentTierError, match="is a FIFO"):
        no_hang(lambda: tier.allocate_slot("rank_00000/slot_1.data", 4096), root / "rank_00000" / "slot_1.data")
    (root / "rank_00001").symlink_to(outside)
    with pytest.raises(PermanentTierError, match="is a symbolic link"):
        tier.allocate_slot("rank_00001/slot_0.data", 4096)
    assert list(outside.iterdir()) == []
