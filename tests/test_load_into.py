"""load(into=...): the checkpoint restored into the caller's tensors, verified, with fallback between tiers."""

from __future__ import annotations

import copy as copy_module
import logging
import uuid

import pytest
import torch
from helpers import assert_same, make_items

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.checksum import SNAPSHOT_PIECE, snapshot_checksum
from tiered_ckpt.errors import LoadIntoError
from tiered_ckpt.load_into import copy_verified, pair_into, tensors


def _config(shm_root, tmp_path, *names, **top):
    tiers = {"shm": {"name": "shm", "kind": "shm", "path": str(shm_root)},
             "local": {"name": "local", "kind": "local", "path": str(tmp_path / "local")}}
    return {"run_id": f"into{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
            "tiers": [tiers[n] for n in names], **top}


def _scrambled(items):
    """A copy of ``items`` whose tensors hold other values (what a freshly built model holds)."""
    out = copy_module.deepcopy(items)
    for t in tensors(out):
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point():
            t.add_(1)
        else:
            t.add_(3)
    return out


def _big_items(seed: int = 0) -> dict:
    """About 2.3 pieces of 64 MiB in one item, small tensors in between (so tensors straddle pieces)."""
    g = torch.Generator().manual_seed(seed)
    n = SNAPSHOT_PIECE // 4
    return {"model": {"a": torch.randn(n, generator=g), "bias": torch.randn(7, generator=g),
                      "b": torch.randn(n // 2, generator=g).to(torch.bfloat16),
                      "c": torch.randint(0, 1 << 40, (n // 3,), generator=g), "d": torch.randn(n // 5, generator=g),
                      "step": 12}}


@pytest.mark.parametrize("names", [("shm", "local"), ("local",)], ids=["from-shm", "from-local"])
def test_values_land_in_the_callers_tensors(shm_root, tmp_path, names):
    items = make_items(4)
    cfg = _config(shm_root, tmp_path, *names)
    with CheckpointEngine(cfg) as engine:
        engine.save(7, items).wait(timeout=60)
    with CheckpointEngine(cfg) as engine:  # a restart: shm snapshots survive it, in-process staging does not
        target = _scrambled(items)
        before = {id(t) for t in tensors(target)}
        res = engine.load(into=target)
    assert res.tier == names[0] and res.verified and res.step == 7
    assert_same(items, target)  # in place
    assert_same(items, res.items)
    assert {id(t) for t in tensors(res.items)} == before  # the result holds the caller's tensors


def test_a_large_item_spanning_several_pieces_is_copied_exactly(shm_root, tmp_path):
    items = _big_items(1)
    with CheckpointEngine(_config(shm_root, tmp_path, "shm")) as engine:
        engine.save(1, items).wait(timeout=120)
        target = _scrambled(items)
        res = engine.load(into=target)
    assert res.tier == "shm"
    assert_same(items, target)


def test_a_damaged_snapshot_falls_back_and_the_targets_end_right(shm_root, tmp_path, recorder):
    items = _big_items(2)
    with CheckpointEngine(_config(shm_root, tmp_path, "shm", "local")) as engine:
        engine.save(3, items).wait(timeout=120)
        store = engine.pipeline.stores["shm"]
        (meta,) = store.metas().values()
        # flip a byte inside the second piece of the slot, through the saver's own mapping
        store.buffer(meta.slot, meta.total_bytes)[SNAPSHOT_PIECE + 12345] ^= 0x40
        target = _scrambled(items)
        res = engine.load(into=target)
    assert res.tier == "local"
    assert [e.tier for e in recorder.kinds("fallback")] == ["shm"]
    assert_same(items, target)


def test_tensors_without_a_target_are_loaded_as_usual(shm_root, tmp_path):
    items = make_items(5)
    with CheckpointEngine(_config(shm_root, tmp_path, "shm")) as engine:
        engine.save(1, items).wait(timeout=60)
        target = {"state": {"model": _scrambled(items)["state"]["model"]}}  # no optimizer targets
        res = engine.load(into=target, copy=True)
        loaded_exp_avg = res.items["state"]["optimizer"]["state"][0]["exp_avg"]
        assert torch.equal(loaded_exp_avg, items["state"]["optimizer"]["state"][0]["exp_avg"])
        loaded_exp_avg.add_(1)  # a copy of its own: the snapshot is untouched
        again = engine.load(copy=True)
    assert_same(items, again.items)
    assert_same(items["state"]["model"], target["state"]["model"])


def test_a_target_of_another_shape_is_refused_with_its_path(shm_root, tmp_path):
    items = make_items(6)
    with CheckpointEngine(_config(shm_root, tmp_path, "shm")) as engine:
        engine.save(1, items).wait(timeout=60)
        target = _scrambled(items)
        target["state"]["model"]["layers.0.bias"] = torch.zeros(31, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"item 'state'\['model'\]\['layers.0.bias'\] is float16\[32\] in the "
                                             r"checkpoint but float16\[31\] in into"):
            engine.load(into=target)
        with pytest.raises(ValueError, match="into must be a dict"):
            engine.load(into=[1, 2])


def test_an_item_target_that_is_not_state_is_refused_not_ignored(shm_root, tmp_path):
    """into={"model": module} returned normally with the module untouched: a resume script written so trained from
    scratch without knowing it (a new user's trial). A module or an optimizer is refused, naming the item and what
    to pass instead; a plain value (the very dict given to save() holds some) is not."""
    lin = torch.nn.Linear(2, 2)
    with CheckpointEngine(_config(shm_root, tmp_path, "shm")) as engine:
        engine.save(1, {"model": lin.state_dict(), "meta": {"step": 1}}).wait(timeout=60)
        fresh = torch.nn.Linear(2, 2)
        with pytest.raises(LoadIntoError, match=r"item 'model' is Linear, not state: pass its state_dict\(\)"):
            engine.load(into={"model": fresh})
        with pytest.raises(LoadIntoError, match=r"item 'model' is SGD, not state: pass its state_dict"):
            engine.load(into={"model": torch.optim.SGD(fresh.parameters(), lr=0.1)})
        with pytest.raises(LoadIntoError, match=r"item 'meta' is object, not state: into maps"):
            engine.load(into={"meta": object()})
        for plain in (None, 5):
            assert engine.load(into={"meta": plain}).items["meta"] == {"step": 1}
        engine.load(into={"model": fresh.state_dict()})  # the module's own tensors receive the values
        assert torch.equal(fresh.weight, lin.weight) and torch.equal(fresh.bias, lin.bias)


@pytest.mark.parametrize("names", [("shm",), ("local",)], ids=["from-shm", "from-local"])
def test_a_target_the_checkpoint_does_not_hold_is_named_in_a_warning(shm_root, tmp_path, names, caplog):
    """Found by a new-user trial: a renamed parameter in into kept its initial values without a word. It is a
    warning, not an error: a fresh optimizer's state holds tensors for parameters that never had a gradient."""
    with CheckpointEngine(_config(shm_root, tmp_path, *names)) as engine:
        engine.save(1, {"model": {"encoder.weight": torch.ones(4), "head.weight": torch.ones(2),
                                  "blocks": [torch.ones(3)]}}).wait(timeout=60)
        target = {"model": {"encoder.weight": torch.zeros(4), "head.weight_renamed": torch.zeros(2),
                            "blocks": [torch.zeros(3)]}}
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            engine.load(into=target)
        said = [r.getMessage() for r in caplog.records if "does not hold" in r.getMessage()]
        assert len(said) == 1 and "item 'model'['head.weight_renamed'] is a tensor in into" in said[0]
        assert torch.equal(target["model"]["encoder.weight"], torch.ones(4))
        assert torch.equal(target["model"]["head.weight_renamed"], torch.zeros(2))  # kept, as the warning says
        caplog.clear()
        target = {"model": {"encoder.weight": torch.zeros(4), "head.weight": torch.zeros(2),
                            "blocks": [torch.zeros(3), torch.zeros(3)]}}  # a list of another length
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            engine.load(into=target)
        assert any("['blocks'][0] is a tensor in into" in r.getMessage() and "(and 1 more: " in r.getMessage()
                   for r in caplog.records)
        caplog.clear()
        target["model"]["blocks"] = [torch.zeros(3)]
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            engine.load(into=target)  # the same tensors: every one filled, nothing said
        assert not [r for r in caplog.records if "does not hold" in r.getMessage()]
        assert torch.equal(target["model"]["head.weight"], torch.ones(2))


def test_non_contiguous_targets_are_filled_too(shm_root, tmp_path):
    items = {"m": {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6)}}
    with CheckpointEngine(_config(shm_root, tmp_path, "shm")) as engine:
        engine.save(1, items).wait(timeout=60)
        backing = torch.zeros(6, 4)
        target = {"m": {"w": backing.t()}}  # a transposed view: not fusable, copied after verifying
        engine.load(into=target)
    assert torch.equal(backing.t(), items["m"]["w"])


def test_copy_verified_reports_a_mismatch():
    data = torch.arange(3 * SNAPSHOT_PIECE // 2, dtype=torch.uint8)
    good = snapshot_checksum(data)
    view = data[64:64 + 4096].view(torch.float32)
    dst = torch.zeros(1024)
    assert copy_verified(data, good, [(view, dst)]) and torch.equal(dst.view(torch.uint8), view.view(torch.uint8))
    data[SNAPSHOT_PIECE + 1] ^= 1
    dst.zero_()
    assert not copy_verified(data, good, [(view, dst)])


def test_pair_into_keeps_non_tensor_values_from_the_checkpoint():
    loaded = {"w": torch.ones(2), "n": 5, "l": [torch.zeros(1), "x"]}
    target = {"w": torch.zeros(2), "n": 99, "l": [torch.ones(1), "y"]}
    result, pairs = pair_into(loaded, target, "item 'i'")
    assert result["n"] == 5 and result["l"][1] == "x"
    assert result["w"] is target["w"] and result["l"][0] is target["l"][0]
    assert len(pairs) == 2


def test_a_target_only_a_failed_step_held_is_never_handed_on_as_loaded(shm_root, tmp_path):
    """The newest step (in shm alone) fails its checksum after its bytes were copied into the targets; the older
    step loaded instead lacks one of them, which then kept the damaged step's bytes while load() said verified
    (found by a review). load() refuses, naming the target."""
    from tiered_ckpt.errors import LoadIntoError

    cfg = _config(shm_root, tmp_path, "shm", "local")
    cfg["tiers"][1]["every"] = 2  # step 2 stays in shm
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"state": {"a": torch.full((1024,), 1.0)}}).wait(timeout=60)
        engine.save(2, {"state": {"a": torch.full((1024,), 2.0), "b": torch.full((1024,), 2.0)}}).wait(timeout=60)
        store = engine.pipeline.stores["shm"]
        meta = next(m for m in store.metas().values() if m.step == 2)
        meta = store.await_checksums(meta)  # damage after the checksums, as a stray write would
        store.buffer(meta.slot, meta.total_bytes)[meta.items[0].offset + meta.items[0].nbytes - 4] ^= 0xFF
        target = {"state": {"a": torch.zeros(1024), "b": torch.zeros(1024)}}
        with pytest.raises(LoadIntoError, match=r"does not hold 'state'\['b'\], which a failed read of step 2"):
            engine.load(into=target)
        fine = {"state": {"a": torch.zeros(1024)}}  # what the older step holds: loaded as asked
        assert engine.load(into=fine).step == 1 and torch.equal(fine["state"]["a"], torch.full((1024,), 1.0))


def test_a_failed_read_from_a_file_tier_leaves_the_targets_alone(shm_root, tmp_path, caplog):
    """A file tier's read is verified before anything is copied into the targets: its failure writes nothing, so
    a target the older step lacks keeps its values with the usual warning (not the refusal above)."""
    cfg = _config(shm_root, tmp_path, "local")
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"state": {"a": torch.full((1024,), 1.0)}}).wait(timeout=60)
        engine.save(2, {"state": {"a": torch.full((1024,), 2.0), "b": torch.full((1024,), 2.0)}}).wait(timeout=60)
    (data,) = (tmp_path / "local" / "iter_0000002" / "rank_00000").glob("*.flat")
    damaged = bytearray(data.read_bytes())
    damaged[-10] ^= 0xFF
    data.write_bytes(damaged)
    target = {"state": {"a": torch.zeros(1024), "b": torch.full((1024,), 7.0)}}
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        got = engine.load(into=target)
    assert got.step == 1 and got.fallbacks
    assert torch.equal(target["state"]["a"], torch.full((1024,), 1.0))
    assert torch.equal(target["state"]["b"], torch.full((1024,), 7.0))
    assert "it keeps its current values" in caplog.text
