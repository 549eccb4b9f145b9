"""Configuration: golden files parse to the expected values; one test per validation rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tiered_ckpt.config import Config, load_config
from tiered_ckpt.errors import ConfigError

DATA = Path(__file__).parent / "data" / "config"


def _tiers(*tiers: dict, **top) -> dict:
    return {"tiers": list(tiers), **top}


LOCAL = {"name": "disk", "kind": "local", "path": "/tmp/x"}


def _err(cfg: dict, env: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cfg, env=env or {})
    return str(info.value)


# ----- golden files ---------------------------------------------------------------------------------------
def test_full_golden_file():
    cfg = load_config(DATA / "full.yaml", env={"S3_ENDPOINT": "http://127.0.0.1:9000"})
    assert cfg.source == str(DATA / "full.yaml")
    assert cfg.run_id == "gpt-16b" and cfg.layout == "megatron"
    assert cfg.drain.mode == "thread" and cfg.drain.close_timeout_s == 300.0
    assert cfg.load.copy is True and cfg.load.list_timeout_s == 120 and cfg.events.jsonl == "/tmp/events.jsonl"
    hbm, host, nvme, s3 = cfg.tiers
    assert (hbm.kind, hbm.enabled, hbm.options.max_bytes, hbm.options.device) == ("gpu", "auto", 8 << 30, "cuda")
    assert (host.slots, host.when_full, host.options.path) == (2, "skip", "/dev/shm/tiered_ckpt")
    assert (nvme.every, nvme.keep, nvme.options.path) == (1, 2, "/local/ckpt")
    assert s3.options.url == "s3://bucket/gpt-16b"
    assert s3.options.options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert (s3.every, s3.keep) == (10, 5)
    assert (s3.compression.codec, s3.compression.level, s3.compression.threads) == ("zstd", 3, 2)
    assert (s3.retry.attempts, s3.retry.initial_s, s3.retry.max_s, s3.retry.deadline_s) == (8, 0.5, 30.0, 900.0)


def test_minimal_golden_file_defaults():
    cfg = load_config(DATA / "minimal.yaml")
    assert cfg.run_id == "default" and cfg.layout == "rank_sharded" and cfg.drain.mode == "process"
    (disk,) = cfg.tiers
    assert (disk.every, disk.keep, disk.enabled, disk.compression) == (1, None, True, None)
    assert disk.retry.attempts == 5


def test_env_defaults_and_values():
    cfg = load_config(DATA / "env_default.yaml", env={})
    assert cfg.run_id == "fallback-run" and cfg.tiers[0].options.path == "/tmp/ckpt/run"
    cfg = load_config(DATA / "env_default.yaml", env={"RUN_NAME": "r1", "CKPT_ROOT": "/data"})
    assert cfg.run_id == "r1" and cfg.tiers[0].options.path == "/data/run"


def test_dict_and_config_accepted_and_frozen():
    cfg = load_config(_tiers(LOCAL))
    assert load_config(cfg) is cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run_id = "x"  # type: ignore[misc]
    assert isinstance(cfg, Config)


# ----- one test per rule ----------------------------------------------------------------------------------
def test_missing_env_var_names_key_path_and_variable():
    msg = _err(_tiers({**LOCAL, "path": "${NOPE_NOT_SET}/x"}))
    assert "tiers[0].path" in msg and "NOPE_NOT_SET" in msg


def test_unknown_top_level_key():
    msg = _err(_tiers(LOCAL, retention=3))
    assert "retention: unknown key" in msg


def test_unknown_tier_key_names_index():
    msg = _err(_tiers(LOCAL, {"name": "b", "kind": "local", "path": "/x", "evry": 2}))
    assert "tiers[1].evry: unknown key" in msg


def test_unknown_nested_key():
    msg = _err(_tiers({**LOCAL, "retry": {"attempts": 3, "backoff": 2}}))
    assert "tiers[0].retry.backoff: unknown key" in msg


def test_tiers_missing_or_empty():
    assert "tiers: expected a non-empty list of tiers, got nothing" in _err({})
    assert "tiers: expected a non-empty list" in _err({"tiers": []})


def test_tier_not_a_mapping():
    assert "tiers[0]: expected a mapping" in _err({"tiers": ["local"]})


def test_tier_name_and_kind_required():
    assert "tiers[0].name: required key is missing" in _err(_tiers({"kind": "local", "path": "/x"}))
    assert "tiers[0].kind: required key is missing" in _err(_tiers({"name": "a", "path": "/x"}))


def test_tier_name_characters():
    assert 'tiers[0].name: expected letters' in _err(_tiers({**LOCAL, "name": "a b/c"}))


def test_unknown_kind_lists_known_kinds():
    msg = _err(_tiers({"name": "a", "kind": "tape"}))
    assert "tiers[0].kind" in msg and "unknown tier kind 'tape'" in msg and "local" in msg
    assert "did you mean" not in msg
    assert _err(_tiers({"name": "a", "kind": "shmm"})).endswith("; did you mean 'shm'?")


def test_duplicate_tier_name():
    msg = _err(_tiers(LOCAL, {**LOCAL, "path": "/y"}))
    assert 'tiers[1].name: duplicate tier name "disk" (also tiers[0])' in msg


def test_a_memory_tier_after_a_file_tier_is_refused_when_loaded():
    """It built, then every save failed (a new user's trial): refused at load, naming both tiers."""
    msg = _err(_tiers(LOCAL, {"name": "host", "kind": "shm", "path": "/dev/shm/x"}))
    assert "tiers[1]: memory tier 'host' (kind 'shm') comes after file tier 'disk' (tiers[0])" in msg


def test_a_key_given_twice_in_yaml_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys, silently (a new user's trial: keep: 2 then keep: 3 loaded as 3);
    keys a merge (<<: *anchor) brings are overridden as YAML says."""
    path = tmp_path / "c.yaml"
    path.write_text("run_id: x\ntiers:\n  - name: d\n    kind: local\n    path: /tmp/q\n    keep: 2\n    keep: 3\n")
    with pytest.raises(ConfigError, match=r"line 7, column 5: key 'keep' is given twice \(first at line 6\)"):
        load_config(str(path))
    path.write_text("run_id: x\ntiers:\n  - &t {name: d, kind: local, path: /tmp/q}\n"
                    "  - {<<: *t, name: e, path: /tmp/r}\n")
    assert [(t.name, t.options.path) for t in load_config(str(path)).tiers] == [("d", "/tmp/q"), ("e", "/tmp/r")]
    # a chain of merges, the anchored mapping overriding what it merges (PyYAML merges it in place)
    path.write_text("run_id: x\ndefaults:\n  z: &Z {kind: local, path: /tmp/q}\n  y: &Y {<<: *Z, path: /tmp/r}\n"
                    "tiers:\n  - {<<: *Y, name: e}\n")
    with pytest.raises(ConfigError, match="defaults: unknown key"):  # parsed; only the key is not ours
        load_config(str(path))


@pytest.mark.parametrize("url", ["s3//bucket/run", "s3:/bucket/run", "file:/tmp/ckpt"])
def test_a_url_missing_its_slashes_is_refused_not_taken_for_a_local_path(url):
    """fsspec reads "s3//bucket/x" as a relative local path: saves committed into ./s3/bucket/x (a trial)."""
    msg = _err(_tiers({"name": "remote", "kind": "fsspec", "url": url}))
    assert "tiers[0]" in msg and "looks like a mistyped URL" in msg, msg


def test_every_must_be_positive_integer():
    assert 'tiers[0].every: expected a positive integer, got "ten"' in _err(_tiers({**LOCAL, "every": "ten"}))
    assert "tiers[0].every: expected a positive integer, got 0" in _err(_tiers({**LOCAL, "every": 0}))
    assert "got True" in _err(_tiers({**LOCAL, "every": True}))


def test_keep_must_be_positive_or_null():
    assert "tiers[0].keep: expected a positive integer" in _err(_tiers({**LOCAL, "keep": -1}))
    assert load_config(_tiers({**LOCAL, "keep": None})).tiers[0].keep is None


def test_slots_only_on_memory_tiers():
    assert "tiers[0].slots: only memory tiers hold slots" in _err(_tiers({**LOCAL, "slots": 2}))


def test_enabled_values():
    assert "tiers[0].enabled: expected true or false or one of 'auto'" in _err(_tiers({**LOCAL, "enabled": "yes"}))


def test_when_full_values():
    assert "tiers[0].when_full: expected one of 'wait', 'skip'" in _err(_tiers({**LOCAL, "when_full": "drop"}))


def test_compression_rules():
    assert "tiers[0].compression.codec: expected one of" in _err(_tiers({**LOCAL, "compression": {"codec": "lz4"}}))
    assert "level: expected an integer from -7 to 22, got 40" in _err(
        _tiers({**LOCAL, "compression": {"level": 40}}))


def test_retry_attempts_positive():
    assert "tiers[0].retry.attempts: expected a positive integer" in _err(_tiers({**LOCAL, "retry": {"attempts": 0}}))


def test_durations():
    assert load_config(_tiers({**LOCAL, "retry": {"deadline_s": "2m"}})).tiers[0].retry.deadline_s == 120.0
    assert "expected a duration such as 30s" in _err(_tiers({**LOCAL, "retry": {"max_s": "soon"}}))


def test_sizes():
    gpu = {"name": "g", "kind": "gpu", "device": "cpu", "max_bytes": "512 MiB"}
    assert load_config(_tiers(gpu)).tiers[0].options.max_bytes == 512 << 20
    assert "tiers[0].max_bytes: expected a byte size" in _err(_tiers({**gpu, "max_bytes": "8 parsecs"}))


def test_kind_required_option():
    assert "tiers[0].path: required key is missing" in _err(_tiers({"name": "d", "kind": "local"}))


def test_run_id_characters():
    assert 'run_id: expected letters' in _err(_tiers(LOCAL, run_id="../../etc"))


def test_unknown_layout():
    assert 'layout: unknown layout "zarr"' in _err(_tiers(LOCAL, layout="zarr"))


def test_drain_mode_values():
    assert "drain.mode: expected one of 'process', 'thread'" in _err(_tiers(LOCAL, drain={"mode": "fork"}))


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("tiers:\n  - {name: a, kind: local\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(p) in str(info.value) and "line" in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("tiers:\n  - {name: disk, kind: local, path: /x, every: ten}\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(info.value) == f'{p}: tiers[0].every: expected a positive integer, got "ten"'


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read the configuration"):
        load_config("/nonexistent/tiers.yaml")


def test_top_level_must_be_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(p)


# ----- codecs chosen in the configuration ---------------------------------------------------------------------
def test_codec_keys_load_and_choose_the_file_codec():
    from tiered_ckpt.layouts.rank_sharded import RankShardedLayout

    cfg = load_config(_tiers({**LOCAL, "codec": "torch", "codecs": {"rng": "flat"}}))
    tier = cfg.tiers[0]
    assert (tier.codec, tier.codecs) == ("torch", {"rng": "flat"})
    layout = RankShardedLayout()
    assert layout.file_codec("state", tier) == "torch" and layout.file_codec("rng", tier) == "flat"
    assert layout.file_codec("model_optim_rng", tier) == "torch"  # fixed by the layout
    assert layout.file_codec("state", load_config(_tiers(LOCAL)).tiers[0]) == "flat"  # the layout's default


def test_unknown_codec_lists_the_allowed_ones_and_the_closest():
    import re

    msg = _err(_tiers({**LOCAL, "codec": "flta"}))
    allowed = re.fullmatch(r'tiers\[0\]\.codec: unknown codec "flta" \(allowed: ([a-z, ]+)\); did you mean \'flat\'\?',
                           msg)
    assert allowed and {"flat", "torch"} <= set(allowed.group(1).split(", ")), msg
    assert _err(_tiers({**LOCAL, "codecs": {"state": "pickle"}})).startswith(
        'tiers[0].codecs.state: unknown codec "pickle" (allowed: ')


def test_a_compression_codec_in_the_codec_key_says_where_it_goes():
    assert "compression is set with compression: {codec: zstd}" in _err(_tiers({**LOCAL, "codec": "zstd"}))


def test_codec_on_a_memory_tier_is_an_error():
    msg = _err(_tiers({"name": "host", "kind": "shm", "codec": "torch"}, LOCAL))
    assert msg.startswith("tiers[0].codec: does not apply to a memory tier")


def test_a_layouts_own_codec_is_not_a_tiers_choice():
    # distcp encodes the items the dcp layout's writer builds: on another layout (or as a tier-wide codec) the
    # step would fail in the drain, so the configuration refuses it and the allowed list leaves it out.
    for tier, key in (({**LOCAL, "codec": "distcp"}, "codec"), ({**LOCAL, "codecs": {"state": "distcp"}},
                                                                 "codecs.state")):
        msg = _err(_tiers(tier))
        assert msg.startswith(f'tiers[0].{key}: codec "distcp" is the format of a layout\'s own files'), msg
        assert "(allowed: " in msg and "distcp," not in msg.split("allowed: ")[1]
    assert "distcp" not in _err(_tiers({**LOCAL, "codec": "flta"})).split("allowed: ")[1]
    msg = _err(_tiers({**LOCAL, "codec": "distcp"}, layout="dcp"))
    assert msg.startswith('tiers[0].codec: codec "distcp"'), msg
    assert load_config(_tiers({**LOCAL, "codecs": {"dcp": "distcp"}}, layout="dcp")).tiers[0].codecs  # its own


def test_keys_a_memory_tier_would_ignore_are_errors():
    msg = _err(_tiers({"name": "host", "kind": "shm", "retry": {"attempts": 3}}, LOCAL))
    assert msg.startswith("tiers[0].retry: does not apply to a memory tier"), msg
    msg = _err(_tiers({"name": "g", "kind": "gpu", "device": "cpu", "on_close": "release"}, LOCAL))
    assert msg.startswith("tiers[0].on_close: kind 'gpu' holds its slots in this process's memory"), msg
    assert load_config(_tiers({"name": "host", "kind": "shm", "on_close": "release"}, LOCAL)).tiers[0].on_close


def test_an_env_default_stands_in_for_an_empty_variable_as_in_the_shell():
    cfg = {"run_id": "${RUN:-fallback}", "tiers": [{**LOCAL, "path": "/tmp/${SUB}x"}]}
    assert load_config(cfg, env={"RUN": "", "SUB": ""}).run_id == "fallback"
    assert load_config(cfg, env={"RUN": "", "SUB": ""}).tiers[0].options.path == "/tmp/x"  # ${VAR}: empty
    assert load_config(cfg, env={"RUN": "r2", "SUB": ""}).run_id == "r2"


def test_the_layout_keeps_the_codec_of_megatrons_files(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text("layout: megatron\n"
                    "tiers:\n  - {name: disk, kind: local, path: /x, codecs: {model_optim_rng: flat}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}: tiers[0].codecs.model_optim_rng: layout \"megatron\" writes model_optim_rng "
                          'with codec "torch"') and "Megatron-LM loads" in msg
    assert load_config(_tiers({**LOCAL, "codecs": {"model_optim_rng": "torch"}})).tiers[0].codecs  # the same: ok


def test_a_tier_writes_its_items_with_the_chosen_codec(tmp_path):
    import torch

    from tiered_ckpt import CheckpointEngine

    cfg = {"run_id": "codec-choice", "drain": {"mode": "thread"},
           "tiers": [{"name": "pt", "kind": "local", "path": str(tmp_path / "pt"), "codec": "torch"}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(3, {"state": {"w": torch.arange(5.0)}}).wait()
        assert torch.equal(engine.load().items["state"]["w"], torch.arange(5.0))
    written = tmp_path / "pt" / "iter_0000003" / "rank_00000" / "state.pt"
    assert torch.equal(torch.load(written, weights_only=True)["w"], torch.arange(5.0))  # a plain torch file


def test_a_tier_copying_from_another_file_tier_writes_its_own_codec(tmp_path):
    import torch

    from tiered_ckpt import CheckpointEngine

    cfg = {"run_id": "codec-copy", "drain": {"mode": "thread"},
           "tiers": [{"name": "flat", "kind": "local", "path": str(tmp_path / "flat")},
                     {"name": "pt", "kind": "local", "path": str(tmp_path / "pt"), "codec": "torch",
                      "compression": {"codec": "zstd"}}]}
    items = {"state": {"w": torch.arange(5.0), "step": 3}}
    with CheckpointEngine(cfg) as engine:
        engine.save(3, items).wait()
    assert (tmp_path / "flat" / "iter_0000003" / "rank_00000" / "state.flat").is_file()
    assert not (tmp_path / "pt" / "iter_0000003" / "rank_00000" / "state.flat").exists()
    with CheckpointEngine({**cfg, "tiers": cfg["tiers"][1:]}) as engine:  # the torch files alone
        loaded = engine.load()
    assert loaded.verified and loaded.items["state"]["step"] == 3
    assert torch.equal(loaded.items["state"]["w"], items["state"]["w"])


def test_a_layouts_own_codec_choice_is_fixed():
    from tiered_ckpt.layouts.base import Layout

    class OwnFormat(Layout):
        def codec_for(self, item):
            return "torch" if item == "weights" else "flat"

    tier = load_config(_tiers({**LOCAL, "codec": "flat", "codecs": {"state": "torch"}})).tiers[0]
    layout = OwnFormat()
    assert layout.file_codec("weights", load_config(_tiers({**LOCAL, "codecs": {"weights": "flat"}})).tiers[0]) \
        == "torch"
    assert layout.file_codec("state", tier) == "torch" and layout.file_codec("other", tier) == "flat"


def test_the_dcp_layout_keeps_its_own_files_codec():
    from tiered_ckpt.plugins import get_plugin_manager

    if "dcp" not in get_plugin_manager().registries.layouts:
        pytest.skip("no dcp layout registered")
    msg = _err(_tiers({**LOCAL, "codecs": {"dcp": "flat"}}, layout="dcp"))
    assert msg.startswith('tiers[0].codecs.dcp: layout "dcp" writes dcp with codec "distcp" (the layout writes')


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_configuration_file_says_it_is_empty(tmp_path, text):
    """Trial: an empty tiers.yaml said "expected a mapping at the top level, got NoneType"."""
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="the file is empty .*it needs at least run_id and tiers") as info:
        load_config(str(path))
    assert str(path) in str(info.value)
