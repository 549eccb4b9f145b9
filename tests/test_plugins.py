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


# ----- pluggy: the checks at start-up -----------------------------------------------------------------------------
def test_a_misspelt_hook_is_an_error_naming_the_plugin_and_the_hook():
    @hookimpl
    def tiered_ckpt_register_tier(registry):  # "tier", not "tiers"
        registry.add("never", LocalTier)

    typo = types.SimpleNamespace(tiered_ckpt_register_tier=tiered_ckpt_register_tier)
    with pytest.raises(PluginError) as info:
        PluginManager(load_entry_points=False, extra_plugins=(typo,))
    msg = str(info.value)
    assert "'tiered_ckpt_register_tier'" in msg and "did you mean 'tiered_ckpt_register_tiers'" in msg
    assert str(id(typo)) in msg  # the plugin's name (pluggy's canonical name of an unnamed object)


def test_a_hook_function_without_hookimpl_is_an_error():
    def tiered_ckpt_register_tiers(registry):
        registry.add("never", LocalTier)

    with pytest.raises(PluginError, match="tiered_ckpt_register_tiers is not marked @hookimpl"):
        PluginManager(load_entry_points=False,
                      extra_plugins=(types.SimpleNamespace(tiered_ckpt_register_tiers=tiered_ckpt_register_tiers),))


def test_registration_hooks_are_refused_after_start_up():
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(PluginError, match="runs only when the plugin manager starts.*extra_plugins"):
        pm.register(_plugin("late"))
    assert "late" not in pm.registries.tiers


def test_a_raising_observer_does_not_stop_the_others():
    from tiered_ckpt.events import Event

    seen = []

    class Good:
        @hookimpl
        def tiered_ckpt_on_event(self, event):
            seen.append(event.kind)

    class Broken:
        @hookimpl
        def tiered_ckpt_on_event(self, event):
            raise RuntimeError("observer bug")

    # pluggy calls the last registered first: Broken runs before Good, and Good must still see the event.
    pm = PluginManager(load_entry_points=False, extra_plugins=(Good(), Broken()))
    pm.emit(Event("snapshot", step=1))
    assert seen == ["snapshot"]


# ----- observers per engine, run_id on every event ----------------------------------------------------------------
def test_two_engines_in_one_process_see_only_their_own_events(tmp_path):
    import torch
    from helpers import Recorder

    from tiered_ckpt import CheckpointEngine

    everyone = Recorder()  # on the plugin manager: every engine's events, told apart by run_id
    pm = PluginManager(load_entry_points=False, extra_plugins=(everyone,))
    mine, theirs = Recorder(), Recorder()

    def config(run_id):
        return {"drain": {"mode": "thread"}, "run_id": run_id,
                "tiers": [{"name": "d", "kind": "local", "path": str(tmp_path / run_id)}]}

    with CheckpointEngine(config("run-a"), plugin_manager=pm, observers=[mine]) as a, \
            CheckpointEngine(config("run-b"), plugin_manager=pm, observers=[theirs]) as b:
        a.save(1, {"state": {"w": torch.ones(2)}}).wait()
        b.save(7, {"state": {"w": torch.zeros(2)}}).wait()
    assert mine.events and theirs.events
    assert {e.run_id for e in mine.events} == {"run-a"} and {e.step for e in mine.kinds("commit")} == {1}
    assert {e.run_id for e in theirs.events} == {"run-b"} and {e.step for e in theirs.kinds("commit")} == {7}
    assert {e.run_id for e in everyone.events} == {"run-a", "run-b"}
    assert all(e.run_id is not None for e in everyone.events)


def test_jsonl_observers_of_two_engines_write_only_their_own_events(tmp_path):
    import json

    import torch

    from tiered_ckpt import CheckpointEngine

    def config(run_id):
        return {"drain": {"mode": "thread"}, "run_id": run_id, "events": {"jsonl": str(tmp_path / f"{run_id}.jsonl")},
                "tiers": [{"name": "d", "kind": "local", "path": str(tmp_path / run_id)}]}

    with CheckpointEngine(config("one")) as one, CheckpointEngine(config("two")) as two:
        one.save(1, {"state": {"w": torch.ones(2)}}).wait()
        two.save(2, {"state": {"w": torch.ones(2)}}).wait()
    for run_id in ("one", "two"):
        lines = [json.loads(line) for line in (tmp_path / f"{run_id}.jsonl").read_text().splitlines()]
        assert lines and {line["run_id"] for line in lines} == {run_id}


# ----- the drain worker gets the same plugins ---------------------------------------------------------------------
def _worker_config(tmp_path, shm_root, kind="mirror"):
    # Two shm tiers: a memory tier below the first one means every drain runs in the worker process (never in this
    # process's threads while the worker starts), so the worker must know kind "mirror".
    return {"run_id": f"worker-plugins-{tmp_path.name}"[:100], "drain": {"mode": "process"},
            "tiers": [{"name": "host", "kind": "shm", "path": f"{shm_root}/a"},
                      {"name": "host2", "kind": "shm", "path": f"{shm_root}/b"},
                      {"name": "disk", "kind": kind, "path": str(tmp_path / "disk")}]}


@pytest.mark.parametrize("how", ["module", "object"])
def test_a_kind_from_extra_plugins_drains_in_the_worker_process(tmp_path, shm_root, how):
    import plugin_samples
    import torch
    from helpers import Recorder

    from tiered_ckpt import CheckpointEngine

    plugin = plugin_samples if how == "module" else plugin_samples.as_object
    pm = PluginManager(load_entry_points=False, extra_plugins=(plugin,))
    rec = Recorder()
    config = _worker_config(tmp_path, shm_root)
    with CheckpointEngine(config, plugin_manager=pm, observers=[rec]) as engine:
        handle = engine.save(1, {"state": {"w": torch.arange(4.0)}})
        handle.wait(timeout=120)  # raises if a tier failed (before: the worker had no kind "mirror")
    assert (tmp_path / "disk" / "iter_0000001" / "tiered_ckpt" / "manifest.json").is_file()
    # The worker's events reach this engine's observers, with its run_id.
    assert [(e.run_id, e.step) for e in rec.kinds("commit", tier="disk")] == [(config["run_id"], 1)]


def test_the_worker_rebuilds_the_plugins_from_the_spec(monkeypatch):
    import plugin_samples

    from tiered_ckpt import plugins
    from tiered_ckpt.plugins import manager_for_worker

    monkeypatch.setattr(plugins, "_default", plugins._default)  # manager_for_worker makes its own the default

    for plugin in (plugin_samples, plugin_samples.as_object):
        pm = PluginManager(load_entry_points=False, extra_plugins=(plugin,))
        rebuilt = manager_for_worker(pm.spec())
        assert rebuilt.registries.tiers.get("mirror") is plugin_samples.MirrorTier
        assert plugins.get_plugin_manager() is rebuilt  # what a kind looking up other kinds finds there
        assert "faulty" not in rebuilt.registries.tiers  # the same plugins: no entry points here either
    # A hook under another attribute name (specname) is a registration hook all the same.
    pm = PluginManager(load_entry_points=False, extra_plugins=(plugin_samples.more_kinds,))
    assert "swept" in manager_for_worker(pm.spec()).registries.tiers
    with pytest.raises(PluginError, match="runs only when the plugin manager starts"):
        pm.register(types.SimpleNamespace(register_more_tiers=plugin_samples.register_more_tiers))


def test_a_plugin_the_worker_cannot_import_is_an_error_at_engine_construction(tmp_path, shm_root):
    from tiered_ckpt import CheckpointEngine

    class LocalKind(LocalTier):  # a local class: the worker process could never import it
        kind = "mirror"

    @hookimpl
    def tiered_ckpt_register_tiers(registry):
        registry.add("mirror", LocalKind)

    plugin = types.SimpleNamespace(tiered_ckpt_register_tiers=tiered_ckpt_register_tiers)
    pm = PluginManager(load_entry_points=False, extra_plugins=(plugin,), )
    with pytest.raises(PluginError) as info:
        CheckpointEngine(_worker_config(tmp_path, shm_root), plugin_manager=pm)
    msg = str(info.value)
    assert "cannot reach the drain worker process" in msg and "cannot be pickled" in msg
    assert "importable module" in msg and "drain: {mode: thread}" in msg
    # The same plugin drains in threads of this process.
    with CheckpointEngine({**_worker_config(tmp_path, shm_root), "drain": {"mode": "thread"}},
                          plugin_manager=pm) as engine:
        import torch

        engine.save(1, {"state": {"w": torch.ones(2)}}).wait()


def test_a_plugin_from_main_is_named_as_such(monkeypatch):
    import sys

    import plugin_samples

    from tiered_ckpt.plugins import _worker_safe_pickle

    main = types.ModuleType("__main__")
    main.MirrorTier = plugin_samples.MirrorTier
    monkeypatch.setattr(plugin_samples.MirrorTier, "__module__", "__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    data, why = _worker_safe_pickle(types.SimpleNamespace(cls=plugin_samples.MirrorTier))
    assert data is None and "__main__.MirrorTier" in why and "does not import" in why


def test_the_spec_names_entry_points_and_the_worker_loads_just_those(monkeypatch):
    from tiered_ckpt import plugins
    from tiered_ckpt.plugins import manager_for_worker

    monkeypatch.setattr(plugins, "_default", plugins._default)  # manager_for_worker makes its own the default

    spec = PluginManager().spec()
    assert ("faults", "entry_point", "faults") in spec.plugins and not spec.unreachable
    assert all(name != "tiered_ckpt.builtin" for name, _, _ in spec.plugins)  # the worker adds the built-ins itself
    rebuilt = manager_for_worker(spec)
    assert rebuilt.registries.tiers.provider_of("faulty") == "faults"
    assert rebuilt.registries.tiers.provider_of("shm") == "tiered_ckpt.builtin"


# ----- a plugin kind gets what the built-ins get, through the Tier interface ---------------------------------------
def test_a_plugin_kind_decides_enabled_auto(tmp_path):
    import plugin_samples
    from helpers import Recorder

    from tiered_ckpt import CheckpointEngine

    pm = PluginManager(load_entry_points=False, extra_plugins=(plugin_samples.more_kinds,))
    rec = Recorder()
    cfg = {"run_id": "part-time", "drain": {"mode": "thread"},
           "tiers": [{"name": "d", "kind": "local", "path": str(tmp_path / "d")},
                     {"name": "p", "kind": "part_time", "enabled": "auto", "path": str(tmp_path / "p")}]}
    with CheckpointEngine(cfg, plugin_manager=pm, observers=[rec]) as engine:
        assert engine.tiers == ["d"]
    assert [e.tier for e in rec.kinds("tier_disabled")] == ["p"]


def test_gc_finds_and_removes_a_plugin_kinds_temporary_files(tmp_path):
    import os

    import plugin_samples

    from tiered_ckpt.config import load_config
    from tiered_ckpt.housekeeping import find_debris, remove_debris
    from tiered_ckpt.parallel import RankCoords
    from tiered_ckpt.pipeline import build_stores

    pm = PluginManager(load_entry_points=False, extra_plugins=(plugin_samples.more_kinds,))
    config = load_config({"tiers": [{"name": "s", "kind": "swept", "path": str(tmp_path / "s")}]},
                         registries=pm.registries)
    store = build_stores(config, pm, RankCoords(rank=0), 0, ["s"], lambda e: None)["s"]
    store.tier.write_blob("iter_0000001/rank_00000/state.flat", [b"kept"])
    leftover = tmp_path / "s" / "iter_0000001" / "rank_00000" / ".state.flat.tmp-0123456789abcdef"
    from tiered_ckpt.tiers._files import is_temp_name

    assert is_temp_name(leftover.name), "the sample must look like the tier's own temporary names"
    leftover.write_bytes(b"half a write")
    assert not hasattr(store.tier, "files")  # gc must go through the Tier interface
    assert find_debris(store) == []  # just written: within gc's grace period (the kind's modified() says so)
    os.utime(leftover, (1, 1))  # written long ago
    debris = find_debris(store)
    assert [(d.what, d.key) for d in debris] == [("temporary file", "iter_0000001/rank_00000/" + leftover.name)]
    remove_debris(store, debris)
    assert not leftover.exists() and store.tier.exists("iter_0000001/rank_00000/state.flat")


def test_the_cli_says_when_a_plugin_kinds_location_is_missing(tmp_path, capsys, monkeypatch):
    import plugin_samples

    from tiered_ckpt import plugins
    from tiered_ckpt.cli import main

    monkeypatch.setattr(plugins, "_default",
                        PluginManager(load_entry_points=False, extra_plugins=(plugin_samples.more_kinds,)))
    config = tmp_path / "tiers.yaml"
    config.write_text(f"tiers:\n  - {{name: v, kind: vault, path: {tmp_path / 'nowhere'}}}\n")
    code = main(["ls", "--config", str(config)])
    captured = capsys.readouterr()
    assert code == 3, captured  # nothing there
    assert "no such vault 'nowhere'" in captured.out + captured.err
    assert not (tmp_path / "nowhere").exists()  # a read-only command created nothing


def test_a_plugin_kinds_options_load_from_yaml_with_the_same_checks(tmp_path):
    import plugin_samples

    from tiered_ckpt.config import load_config
    from tiered_ckpt.errors import ConfigError

    pm = PluginManager(load_entry_points=False, extra_plugins=(plugin_samples,))
    path = tmp_path / "tiers.yaml"
    path.write_text(f"tiers:\n  - {{name: m, kind: mirror, path: {tmp_path}/m, fsync: false}}\n")
    tier = load_config(str(path), registries=pm.registries).tiers[0]
    assert (tier.options.path, tier.options.fsync) == (f"{tmp_path}/m", False)
    path.write_text(f"tiers:\n  - {{name: m, kind: mirror, path: {tmp_path}/m, fsyn: false}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), registries=pm.registries)
    assert str(info.value).startswith(f"{path}: tiers[0].fsyn: unknown key (allowed for a mirror tier: ")
    assert str(info.value).endswith("did you mean 'fsync'?")


def test_two_installed_plugins_under_one_entry_point_name_are_refused(monkeypatch):
    """A plugin author's trial: a plugin whose pyproject.toml kept the entry point name of tiered-ckpt-faults hid
    it (its kinds vanished, exit 0), whichever came first on the path winning. The same plugin seen twice on the
    path (an editable install beside its built one) is still one plugin."""
    from importlib.metadata import EntryPoint

    import tiered_ckpt.plugins as plugins

    ours = EntryPoint("faults", "tiered_ckpt_faults", "tiered_ckpt")
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ours, EntryPoint("faults", "tiered_ckpt_faults",
                                                                                 group)])
    assert "faulty" in PluginManager().registries.tiers
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ours, EntryPoint("faults", "my_tier.plugin", group)])
    with pytest.raises(PluginError, match=r"two plugins .* name 'faults' .*tiered_ckpt_faults and my_tier\.plugin"):
        PluginManager()


def _registering(cls: object) -> types.SimpleNamespace:
    @hookimpl
    def tiered_ckpt_register_tiers(registry):
        registry.add("mine", cls)

    return types.SimpleNamespace(tiered_ckpt_register_tiers=tiered_ckpt_register_tiers)


def _abstract_left() -> type:
    from tiered_ckpt.tiers.base import Tier

    class Half(Tier):  # write_blob and the rest left out
        kind = "mine"

    return Half


def _options_not_a_dataclass() -> type:
    class Plain(LocalTier):
        class Options:
            path: str = "/x"

    return Plain


@pytest.mark.parametrize(("cls", "says"), [
    (object, "must be a subclass of tiered_ckpt.tiers.base.Tier, got <class 'object'>"),
    ("not a class", "must be a subclass of tiered_ckpt.tiers.base.Tier, got 'not a class'"),
    (object.__new__(LocalTier), "got an instance of LocalTier (register the class itself)"),
    (_abstract_left(), "does not implement delete, exists, list, read_blob, size, write_blob"),
    (_options_not_a_dataclass(), "has an Options that is not a dataclass"),
])
def test_a_registered_kind_that_cannot_work_is_refused_naming_the_plugin(cls, says):
    """A plugin author's trial: a non-Tier class, an instance, a class missing a primitive or with a plain Options
    were registered, and failed later with a bare AttributeError or TypeError (`tiered-ckpt plugins` crashed)."""
    with pytest.raises(PluginError, match="tier kind 'mine'") as info:
        PluginManager(load_entry_points=False, extra_plugins=(_registering(cls),))
    assert says in str(info.value)


def test_a_hook_function_given_as_the_plugin_says_so():
    """A plugin author's trial: `extra_plugins=(fn,)` said the plugin "implements 'plugin', which is no hook"."""
    @hookimpl
    def tiered_ckpt_register_tiers(registry):
        registry.add("mine", LocalTier)

    with pytest.raises(PluginError, match=r"is the function .*tiered_ckpt_register_tiers, not a plugin: .*module"):
        PluginManager(load_entry_points=False, extra_plugins=(tiered_ckpt_register_tiers,))
