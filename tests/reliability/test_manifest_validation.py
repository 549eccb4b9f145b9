"""Every field of a manifest is checked against the layout (issue #15): a manifest rewritten with a valid digest
(a tool, a person, an attacker) that names another rank's file, claims an absurd size, or contradicts its own key
is a :class:`CorruptionError` naming the file and the field, and ``load()`` falls back to the next tier.

Property tests: random changes to valid manifests, parsed and then loaded end to end, raise nothing but
:class:`CorruptionError` (parsing) and never anything but a fallback (loading).
"""

from __future__ import annotations

import copy as copylib
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_ckpt import CheckpointEngine, NoCheckpointError
from tiered_ckpt.checksum import ALGORITHM, digest
from tiered_ckpt.errors import CorruptionError
from tiered_ckpt.manifest import MAX_BYTES, content_digest, load_checkpoint, load_rank

# Each example starts an engine and loads: fewer than the parse-only fuzz tests; FUZZ_EXAMPLES raises it.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 40))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture])
PARALLEL = {"tp": 1, "pp": 1, "dp": 2, "ep": 1, "cp": 1, "order": "tp-cp-ep-dp-pp", "world_size": 2}
WHERE = "iter_0000010/tiered_ckpt/rank_00001.json"


def _file(rank: int, **changes) -> dict:
    return {"key": f"iter_0000010/rank_{rank:05d}/state.flat", "item": "state", "rank": rank, "codec": "flat",
            "size": 100, "checksum": "xxh3_128:00", "compression": None, "raw_size": None, "meta": {}, **changes}


def rank_doc(**changes) -> dict:
    """A valid rank manifest of rank 1 of 2 (rank_sharded), with ``changes`` (dotted paths) applied."""
    doc = {"format": "tiered_ckpt.rank_manifest", "version": 1, "step": 10, "rank": 1, "layout": "rank_sharded",
           "coords": {"rank": 1, "tp": 0, "pp": 0, "dp": 1, "ep": 0, "cp": 0}, "parallel": dict(PARALLEL),
           "files": [_file(1)], "run_id": "r", "created": 1.5, "extra": {}}
    return _apply(doc, changes)


def checkpoint_doc(**changes) -> dict:
    doc = {"format": "tiered_ckpt.manifest", "version": 1, "step": 10, "layout": "rank_sharded",
           "parallel": dict(PARALLEL), "files": [_file(0), _file(1)], "run_id": "r", "created": 1.5,
           "extra": {"ranks": [0, 1], "scope": "job"}}
    return _apply(doc, changes)


def _apply(doc: dict, changes: dict) -> dict:
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return doc


def encode(doc: dict) -> bytes:
    return json.dumps({**doc, "digest": content_digest(doc)}).encode()


ZSTD = {"compression": "zstd", "raw_size": 400}
RANK_CASES = {
    "another rank's file": (rank_doc(**{"files.0": _file(0)}), "files[0].rank: 0, in the manifest of rank 1"),
    "another rank's directory": (rank_doc(**{"files.0.key": "iter_0000010/rank_00000/state.flat"}),
                                 "is not rank 1's file of item 'state'"),
    "no layout name": (rank_doc(layout=""), "layout: '' names no layout"),
    "another item's file": (rank_doc(**{"files.0.key": "iter_0000010/rank_00001/other.flat"}),
                            "is not rank 1's file of item 'state'"),
    "another step's directory": (rank_doc(**{"files.0.key": "iter_0000009/rank_00001/state.flat"}),
                                 "outside the directory of step 10"),
    "listed twice": (rank_doc(files=[_file(1), _file(1)]), "files[1].key: 'iter_0000010/rank_00001/state.flat' is "
                                                           "listed twice"),
    "rank of another key": (rank_doc(rank=0, coords={"rank": 0}, **{"files.0": _file(0)}),
                            "step/rank: 10/0, but the manifest is the one of step 10 rank 1"),
    "step of another key": (rank_doc(step=11), "but the manifest is the one of step 10 rank 1"),
    "coords of another rank": (rank_doc(**{"coords.dp": 0}), "coords.dp: 0, but rank 1 of the layout has 1"),
    "1 PiB raw_size": (rank_doc(**{"files.0": _file(1, **{**ZSTD, "raw_size": 1 << 50})}),
                       f"files[0].raw_size: {1 << 50} bytes cannot come from 100 bytes of zstd"),
    "compressed without raw_size": (rank_doc(**{"files.0": _file(1, compression="zstd")}),
                                    "files[0].raw_size is missing for a zstd file"),
    "raw_size of an uncompressed file": (rank_doc(**{"files.0.raw_size": 7}),
                                         "files[0].raw_size: 7 differs from the size 100 of an uncompressed file"),
    "unknown compression": (rank_doc(**{"files.0": _file(1, **{**ZSTD, "compression": "lz4"})}),
                            "files[0].compression: unknown 'lz4'"),
    "size beyond any tier": (rank_doc(**{"files.0.size": MAX_BYTES + 1}), "files[0].size: "),
    "negative raw_size": (rank_doc(**{"files.0": _file(1, **{**ZSTD, "raw_size": -1})}), "files[0].raw_size: "
                                                                                          "negative"),
    "checksum not hex": (rank_doc(**{"files.0.checksum": "xxh3_128:zz"}), "files[0].checksum: expected"),
    "empty item": (rank_doc(**{"files.0.item": ""}), "files[0].item: expected a name"),
    "byte_grouping not a bool": (rank_doc(**{"files.0.meta": {"byte_grouping": "yes"}}),
                                 "files[0].meta.byte_grouping: expected a bool"),
    "created beyond a float": (rank_doc(created=10 ** 400), "created: "),  # was an OverflowError
    "step beyond int64": (rank_doc(step=1 << 64), "step: "),
}
CHECKPOINT_CASES = {
    "a file in another rank's directory": (checkpoint_doc(**{"files.1.key": "iter_0000010/rank_00000/x.flat"}),
                                           "files[1].key: 'iter_0000010/rank_00000/x.flat' is not rank 1's file"),
    "step of another key": (checkpoint_doc(step=11), "step: 11, but the manifest is the one of step 10"),
    "ranks not a list": (checkpoint_doc(extra={"ranks": 5}), "extra.ranks: expected a list of ranks"),  # TypeError
    "ranks outside the world": (checkpoint_doc(extra={"ranks": [0, 7]}), "extra.ranks: expected distinct ranks"),
    "unknown scope": (checkpoint_doc(extra={"scope": "moon"}), "extra.scope: expected 'job' or 'node'"),
    "unknown layout, another rank's directory": (
        checkpoint_doc(layout="plugin_layout", **{"files.0.key": "iter_0000010/rank_00001/state.flat"}),
        "is in another rank's directory (rank_00001), not in rank 0's"),
}


@pytest.mark.parametrize("name", list(RANK_CASES))
def test_a_rank_manifest_field_the_layout_does_not_allow_is_a_corruption_error(name):
    doc, expected = RANK_CASES[name]
    with pytest.raises(CorruptionError) as info:
        load_rank(encode(doc), WHERE, "nvme")
    message = str(info.value)
    assert message.startswith(f"tier 'nvme', file '{WHERE}': malformed manifest: "), message
    assert expected in message, message


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_a_checkpoint_manifest_field_the_layout_does_not_allow_is_a_corruption_error(name):
    doc, expected = CHECKPOINT_CASES[name]
    where = "iter_0000010/tiered_ckpt/manifest.json"
    with pytest.raises(CorruptionError) as info:
        load_checkpoint(encode(doc), where, "nvme")
    assert str(info.value).startswith(f"tier 'nvme', file '{where}': malformed manifest: ")
    assert expected in str(info.value), str(info.value)


def test_a_rank_outside_the_world_is_refused_wherever_the_manifest_was_read_from():
    with pytest.raises(CorruptionError, match="rank: 5 is outside a world of 2"):
        load_rank(encode(rank_doc(rank=5)), "copied.json", "nvme")


def test_the_valid_manifests_of_these_tests_parse():
    assert load_rank(encode(rank_doc()), WHERE).files[0].rank == 1
    assert [f.rank for f in load_checkpoint(encode(checkpoint_doc())).files] == [0, 1]
    assert load_rank(encode(rank_doc(**{"files.0": _file(1, **ZSTD)})), WHERE).files[0].raw_size == 400
    assert load_checkpoint(encode(checkpoint_doc(layout="plugin_layout"))).layout == "plugin_layout"


def test_a_rank_manifest_listing_another_ranks_file_is_refused_at_commit(tmp_path):
    """Rank 1's vote lists rank 0's file as its own part: before, the step was committed and rank 1 would have
    restored rank 0's state; now the commit fails on that tier (the drain reports it) and nothing is committed."""
    from tiered_ckpt.manifest import FileEntry, RankManifest, dump_rank
    from tiered_ckpt.parallel import ParallelLayout

    cfg = {"run_id": f"mv-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local"), "fsync": False}]}
    layout = ParallelLayout(dp=2)
    with CheckpointEngine(cfg) as engine:
        store = engine.pipeline.stores["local"]
        for rank in (0, 1):
            entry = FileEntry(key="iter_0000007/rank_00000/state.flat", item="state", rank=0, codec="flat", size=1,
                              checksum="xxh3_128:00")
            vote = RankManifest(step=7, rank=rank, layout="rank_sharded", coords=layout.coords(rank).to_dict(),
                                parallel=layout.to_dict(), files=(entry,), run_id=cfg["run_id"])
            store.tier.publish(f"iter_0000007/tiered_ckpt/rank_{rank:05d}.json", dump_rank(vote))
        with pytest.raises(CorruptionError, match=r"rank_00001\.json': malformed manifest: files\[0\]\.rank: 0, in "
                                                  r"the manifest of rank 1: a rank lists only its own files"):
            store.try_commit(7, layout.coords(0), [0, 1])
        assert not (tmp_path / "local/iter_0000007/tiered_ckpt/manifest.json").exists()


# ----- end to end: load() falls back -----------------------------------------------------------------------------
STATE = {"state": {"w": torch.arange(64.0), "b": torch.ones(3, dtype=torch.bfloat16)}}


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """Step 1 of one rank committed on ``local`` (zstd) and ``shared``; a second run's file of other values."""
    root = tmp_path_factory.mktemp("committed")
    cfg = {"run_id": f"mv-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "local", "kind": "local", "path": str(root / "local"), "fsync": False,
                      "compression": {"codec": "zstd"}},
                     {"name": "shared", "kind": "fsspec", "url": f"file://{root / 'shared'}"}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, STATE).wait(timeout=60)
    other = {**cfg, "run_id": cfg["run_id"] + "-other", "tiers": [
        {"name": "local", "kind": "local", "path": str(root / "other"), "fsync": False}]}
    with CheckpointEngine(other) as engine:
        engine.save(1, {"state": {"w": -torch.arange(64.0), "b": torch.zeros(3, dtype=torch.bfloat16)}}).wait(
            timeout=60)
    return root, cfg


@pytest.fixture
def tiers(committed, tmp_path):
    root, cfg = committed
    for name in ("local", "shared", "other"):
        shutil.copytree(root / name, tmp_path / name)
    cfg = copylib.deepcopy(cfg)
    cfg["tiers"][0]["path"] = str(tmp_path / "local")
    cfg["tiers"][1]["url"] = f"file://{tmp_path / 'shared'}"
    return tmp_path, cfg


def rewrite(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps({**{k: v for k, v in doc.items() if k != "digest"},
                                "digest": content_digest({k: v for k, v in doc.items() if k != "digest"})}))


def _one_file(doc: dict) -> dict:
    (entry,) = doc["files"]
    return entry


def test_an_absurd_raw_size_falls_back_to_the_next_tier(tiers, recorder):
    root, cfg = tiers
    rewrite(root / "local/iter_0000001/tiered_ckpt/manifest.json",
            lambda doc: _one_file(doc).update(raw_size=1 << 50))  # 1 PiB: was a RuntimeError from load()
    with CheckpointEngine(cfg) as engine:
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (1, "shared")
        assert_same(STATE, loaded.items)
    (fallback,) = recorder.kinds("fallback", "local")
    assert "raw_size" in fallback.message and "manifest.json" in fallback.message


def test_a_manifest_naming_another_runs_file_in_another_rank_directory_falls_back(tiers, recorder):
    """The forged entry names a file with the right bytes and checksum, in rank 1's directory: before, rank 0
    restored it (another run's state); now the manifest is refused and the next tier's copy loads."""
    root, cfg = tiers
    foreign = (root / "other/iter_0000001/rank_00000/state.flat").read_bytes()
    target = root / "local/iter_0000001/rank_00001/state.flat"
    target.parent.mkdir()
    target.write_bytes(foreign)

    def point_at_rank_1(doc):
        _one_file(doc).update(key="iter_0000001/rank_00001/state.flat", size=len(foreign), raw_size=len(foreign),
                              compression=None, checksum=f"{ALGORITHM}:{digest(foreign)}")

    rewrite(root / "local/iter_0000001/tiered_ckpt/manifest.json", point_at_rank_1)
    with CheckpointEngine(cfg) as engine:
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (1, "shared")
        assert_same(STATE, loaded.items)
    (fallback,) = recorder.kinds("fallback", "local")
    assert "files[0].key: 'iter_0000001/rank_00001/state.flat' is not rank 0's file" in fallback.message


# Values that broke parsing or loading before (wrong types, overflowing numbers), and plain random JSON.
TRICKY = [None, True, -1, 0, 1, 7, 100, 2 ** 31, "rank_sharded", "megatron", "dcp",
          2 ** 53 + 1, 2 ** 63, 2 ** 64, 1 << 50, 10 ** 30, -(2 ** 63), 1.5,
          float("inf"), "", "zstd", "none", "flat", "torch", "state", "rank_00000", "../x", [], [0], [0, 0], {},
          "iter_0000001/rank_00000/state.flat", "iter_0000001/rank_00001/state.flat", {"byte_grouping": True}]
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)
FILE_FIELDS = ["key", "item", "rank", "codec", "size", "checksum", "compression", "raw_size", "meta"]
TOP_FIELDS = ["step", "layout", "parallel", "run_id", "created", "extra"]


PARSE_FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 500)), deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])
EXTENSION = {"flat": "flat", "torch": "pt"}
KEYS = st.sampled_from(["iter_0000010/rank_00001/state.flat", "iter_0000010/rank_00000/state.flat",
                        "iter_0000010/rank_00001/other.flat", "iter_0000009/rank_00001/state.flat",
                        "iter_0000010/mp_rank_00/model_optim_rng.pt", "iter_0000010/rank_00001/state.pt"])


@PARSE_FUZZ
@given(data=st.data())
def test_random_rank_manifests_are_refused_or_name_only_that_ranks_sane_files(data):
    """Random field values in a rank manifest of rank 1 (digest recomputed): a :class:`CorruptionError`, or a
    manifest whose every file is rank 1's own, in step 10, with sizes a tier and zstd can produce."""
    doc = rank_doc(files=[_file(1), _file(1, key="iter_0000010/rank_00001/aux.flat", item="aux")])
    for _ in range(data.draw(st.integers(1, 4))):
        if data.draw(st.booleans()):
            entry = doc["files"][data.draw(st.integers(0, 1))]
            field = data.draw(st.sampled_from(FILE_FIELDS))
            entry[field] = data.draw(KEYS if field == "key" else st.sampled_from(TRICKY) | JSON)
        else:
            doc[data.draw(st.sampled_from(TOP_FIELDS + ["rank", "coords"]))] = data.draw(st.sampled_from(TRICKY) | JSON)
    try:
        manifest = load_rank(encode(doc), WHERE, "t")
    except CorruptionError as exc:
        assert str(exc).startswith(f"tier 't', file '{WHERE}': malformed manifest: ")
        return
    assert (manifest.step, manifest.rank) == (10, 1)
    for f in manifest.files:
        assert f.rank == 1 and f.key.startswith("iter_0000010/")
        assert not [p for p in f.key.split("/") if p.startswith("rank_") and p != "rank_00001"], f.key
        if manifest.layout in ("rank_sharded", "megatron", "dcp"):
            assert f.key.startswith("iter_0000010/rank_00001/")
            if f.codec in EXTENSION:
                assert f.key == f"iter_0000010/rank_00001/{f.item}.{EXTENSION[f.codec]}"
        # (a layout or codec this process does not have: only the rank's directory can be checked; loading it
        # is refused later, naming the unknown codec or layout)
        assert 0 <= f.size <= MAX_BYTES
        assert f.raw_size in (None, f.size) if f.compression is None else 0 <= f.raw_size <= f.size * 32768


@FUZZ
@given(data=st.data())
def test_random_changes_to_a_committed_manifest_are_refused_or_loaded_never_an_escape(tiers, data):
    """A committed manifest with random fields replaced (digest recomputed): ``load()`` returns the right state,
    from this tier or by falling back to the next one, never any other exception (and never other values)."""
    root, cfg = tiers
    path = root / "local/iter_0000001/tiered_ckpt/manifest.json"
    pristine = path.read_text()
    value = st.sampled_from(TRICKY) | JSON

    def change(doc):
        for _ in range(data.draw(st.integers(1, 3))):
            if data.draw(st.booleans()):  # raw_size more often: the field that made load() allocate 1 PiB
                _one_file(doc)[data.draw(st.sampled_from(FILE_FIELDS + ["raw_size"] * 3))] = data.draw(value)
            else:
                doc[data.draw(st.sampled_from(TOP_FIELDS))] = data.draw(value)

    try:
        rewrite(path, change)
        try:
            with CheckpointEngine(cfg) as engine:
                loaded = engine.load()
        except NoCheckpointError:  # a changed step or layout can hide this step from every tier: said clearly
            return
        assert loaded.step == 1
        assert_same(STATE, loaded.items)
    finally:
        path.write_text(pristine)
