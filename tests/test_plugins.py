"""The plugin manager: built-ins through the hooks, entry points, conflicts named."""

from __future__ import annotations

import types

import pytest

from tiered_ckpt import hookimpl
from tiered_ckpt.errors import PluginError
from tiered_ckpt.plugins import PluginManager
from tiered_ckpt.tiers.local import LocalTier


def _plugin(kind: str) -> types.SimpleNamespace:
    @hookimpl
    def tiered_ckpt_register_tiers(registry):
        registry.add(kind, LocalTier)

    return types.SimpleNamespace(tiered_ckpt_register_tiers=tiered_ckpt_register_tiers)


def test_builtins_and_entry_points_register_through_the_hooks():
    regs = PluginManager().registries
    assert {"gpu", "shm", "local", "fsspec", "faulty"} <= set(regs.tiers)
    assert regs.tiers.provider_of("shm") == "tiered_ckpt.builtin"
    assert regs.tiers.provider_of("faulty") == "faults"
    assert set(regs.layouts) >= {"megatron", "rank_sharded"} and set(regs.codecs) >= {"flat", "torch"}


def test_entry_points_can_be_skipped():
    assert "faulty" not in PluginManager(load_entry_points=False).registries.tiers


def test_duplicate_kind_names_both_providers():
    with pytest.raises(PluginError) as info:
        PluginManager(load_entry_points=False, extra_plugins=(_plugin("shm"),))
    msg = str(info.value)
    assert "tier kind 'shm' is provided by two plugins" in msg and "tiered_ckpt.builtin" in msg


def test_new_kind_from_an_extra_plugin():
    regs = PluginManager(load_entry_points=False, extra_plugins=(_plugin("nvme2"),)).registries
    assert regs.tiers.get("nvme2") is LocalTier


def test_unknown_kind_lists_known_ones():
    with pytest.raises(PluginError, match="unknown tier kind 'tape'.*local"):
        PluginManager(load_entry_points=False).registries.tiers.get("tape")


def test_failing_observer_never_breaks_a_save(tmp_path):
    import torch

    from tiered_ckpt import CheckpointEngine

    class Broken:
        @hookimpl
        def tiered_ckpt_on_event(self, event):
            raise RuntimeError("observer bug")

    pm = PluginManager(load_entry_points=False, extra_plugins=(Broken(),))
    cfg = {"drain": {"mode": "thread"}, "run_id": "obs", "tiers": [{"name": "d", "kind": "local",
                                                                      "path": str(tmp_path)}]}
    with CheckpointEngine(cfg, plugin_manager=pm) as engine:
        engine.save(1, {"state": {"w": torch.ones(2)}}).wait()
        assert engine.load().step == 1


def test_jsonl_event_observer(tmp_path):
    import json

    import torch

    from tiered_ckpt import CheckpointEngine

    log = tmp_path / "events.jsonl"
    cfg = {"drain": {"mode": "thread"}, "run_id": "jsonl", "events": {"jsonl": str(log)},
           "tiers": [{"name": "d", "kind": "local", "path": str(tmp_path / "d")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"state": {"w": torch.ones(2)}}).wait()
        engine.load()
    kinds = [json.loads(line)["kind"] for line in log.read_text().splitlines()]
    assert {"snapshot", "drain", "commit", "load"} <= set(kinds)
