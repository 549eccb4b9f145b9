"""Bad input: fuzzed configurations, malformed manifests, paths that try to leave the tier, and pickles that
would run code.

* A configuration, however mangled (hypothesis mutates a valid one that uses every section and tier kind, and
  writes random YAML), is either accepted or refused with a :class:`ConfigError` naming the key path; nothing
  else ever comes out.
* A manifest is data: malformed ones (each rule, then hypothesis) are a :class:`CorruptionError` naming the
  file; keys with ``..``, absolute paths, backslashes or NUL are refused before any file is opened, and the
  engine falls back to another tier's copy.
* A checkpoint file whose pickle would call anything outside Megatron's allow-list is refused by default with a
  message naming the file and the globals; ``load: {trust_pickles: true}`` loads a trusted legacy file and logs
  that it did.
"""

from __future__ import annotations

import copy as copylib
import datetime
import io
import json
import logging
import os
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_ckpt import CheckpointEngine, CheckpointUnreadableError
from tiered_ckpt.checksum import ALGORITHM, digest
from tiered_ckpt.config import load_config
from tiered_ckpt.errors import ConfigError, CorruptionError, UnsafePickleError
from tiered_ckpt.manifest import content_digest, load_checkpoint, load_rank
from tiered_ckpt.tiers.base import check_key

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 500))  # per fuzz test; raise it to search harder
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENV = {"S3_ENDPOINT": "http://127.0.0.1:9"}

# A valid configuration using every section, every common tier key and every built-in kind (and the plugin's).
BASE = {
    "run_id": "fuzz",
    "layout": "megatron",
    "drain": {"mode": "thread", "close_timeout_s": "5m", "commit_timeout_s": 30},
    "load": {"copy": True, "verify": True, "trust_pickles": False},
    "events": {"jsonl": "/tmp/events.jsonl", "log": False},
    "tiers": [
        {"name": "hbm", "kind": "gpu", "enabled": "auto", "max_bytes": "8GiB", "device": "cpu"},
        {"name": "host", "kind": "shm", "path": "/dev/shm/tiered_ckpt", "slots": 2, "when_full": "skip",
         "min_free": "1GiB"},
        {"name": "nvme", "kind": "local", "path": "/local/ckpt", "every": 1, "keep": 2, "fsync": True},
        {"name": "s3", "kind": "fsspec", "url": "s3://bucket/run", "options": {"endpoint_url": "${S3_ENDPOINT}"},
         "every": 10, "keep": 5, "part_size": "64MiB", "timeout_s": "30s",
         "compression": {"codec": "zstd", "level": 3, "threads": 2, "byte_grouping": True},
         "retry": {"attempts": 8, "initial_s": 0.5, "max_s": 30, "deadline_s": 900}},
        {"name": "flaky", "kind": "faulty", "inner": {"kind": "local", "path": "/tmp/flaky"},
         "transient_errors": 1, "ops": ["write_blob"], "disk_full_after": "1MiB", "latency_s": "10ms"},
    ],
}

TRICKY = ["", " ", "0", "-1", "1e999", "1e999s", "nan", "inf", "-inf", "8GiB", "8 parsecs", "30s", "5m", "auto",
          "wait", "skip", "thread", "process", "zstd", "none", "megatron", "rank_sharded", "gpu", "shm", "local",
          "fsspec", "faulty", "nosuch", "${S3_ENDPOINT}", "${NOPE}", "${NOPE:-x}", "${", "../../etc", "/abs/path",
          "a\nb", "run\n", "\x00", "é", "s3://", "file:///tmp/x", "memory://x", "write_blob", "tiers", "name"]
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63, max_value=2**1100)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(TRICKY)
           | st.dates() | st.binary(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6) | st.sampled_from(TRICKY) | st.integers(), inner,
                                        max_size=3), max_leaves=6)


def _containers(node, out):
    if isinstance(node, dict | list):
        out.append(node)
        for child in node.values() if isinstance(node, dict) else node:
            _containers(child, out)
    return out


def mutate(data, cfg) -> None:
    """Apply 1-4 random edits anywhere in ``cfg``: replace a value, delete a key or item, add one."""
    for _ in range(data.draw(st.integers(1, 4))):
        node = data.draw(st.sampled_from(_containers(cfg, [])))
        op = data.draw(st.sampled_from(["set", "set", "delete", "add"]))
        if isinstance(node, dict):
            if op == "add" or not node:
                node[data.draw(st.text(max_size=8) | st.sampled_from(TRICKY) | st.integers())] = data.draw(VALUES)
            else:
                key = data.draw(st.sampled_from(sorted(node, key=repr)))
                if op == "delete":
                    del node[key]
                else:
                    node[key] = data.draw(VALUES)
        else:
            if op == "add" or not node:
                node.append(data.draw(VALUES))
            else:
                i = data.draw(st.integers(0, len(node) - 1))
                if op == "delete":
                    del node[i]
                else:
                    node[i] = data.draw(VALUES)


def test_the_fuzzed_configuration_is_valid_to_begin_with():
    config = load_config(BASE, env=ENV)
    assert [t.kind for t in config.tiers] == ["gpu", "shm", "local", "fsspec", "faulty"]


@FUZZ
@given(data=st.data())
def test_a_mangled_configuration_raises_only_config_errors_naming_the_key_path(data):
    cfg = copylib.deepcopy(BASE)
    mutate(data, cfg)
    try:
        load_config(cfg, env=ENV)
    except ConfigError as exc:
        assert exc.key_path, f"no key path in: {exc}"
        assert str(exc).startswith(f"{exc.key_path}: "), str(exc)


YAML_PIECES = ["tiers:", "- name: a", "  kind: local", "  path: /tmp/x", "run_id: r", "every: 2", "&a", "*a",
               "<<: *a", "!!python/object:os.system", "!!binary", "!!set", "!!float", "? [a]", "2024-02-30",
               "2001-13-45", "1e999", "{", "}", "[", "]", ": ", "- ", "\t", "'", '"', "\\", "%YAML 1.1", "---",
               "...", "#", "|", ">", "é", "\x00", "\x85", "\ufeff", "~", "null", "yes", "0x1F", "0o17", ".inf"]


@FUZZ
@given(text=st.lists(st.sampled_from(YAML_PIECES) | st.text(max_size=10), max_size=12).map("\n".join)
       | st.text(max_size=200),
       raw=st.none() | st.binary(max_size=64))
def test_random_yaml_files_raise_only_config_errors(tmp_path_factory, text, raw):
    path = tmp_path_factory.getbasetemp() / f"fuzz-{uuid.uuid4().hex}.yaml"
    if raw is None:
        path.write_text(text)
    else:
        path.write_bytes(raw)
    try:
        load_config(str(path), env=ENV)
    except ConfigError as exc:
        assert str(path) in str(exc)
    finally:
        path.unlink()


# ----- regressions the fuzzing found ------------------------------------------------------------------------
@pytest.mark.parametrize("yaml_text,expected", [
    ("tiers: [{name: a, kind: shm, min_free: 1e999}]", "tiers[0].min_free: expected a byte size"),  # OverflowError
    ("tiers: [{name: a, kind: local, path: 2001-13-45}]", "not valid YAML: ValueError: month"),  # a bad date
    ("run_id: 2024-02-30\ntiers: []", "not valid YAML: ValueError: day is out of range"),
    ("tiers: !!float", "not valid YAML: IndexError"),
    ("tiers: &a [*a]", "<root>: the configuration contains itself"),  # RecursionError
    ("a: &x {b: *x}\ntiers: [{name: a, kind: local, path: p}]", "the configuration contains itself"),
    ("run_id: \"abc\\n\"\ntiers: [{name: a, kind: local, path: p}]", "run_id: expected letters"),  # accepted
    ("tiers: [{name: \"a\\n\", kind: local, path: p}]", "tiers[0].name: expected letters"),  # accepted
    ("tiers: [{name: a, kind: local, path: p, retry: {deadline_s: .nan}}]",  # accepted NaN
     "tiers[0].retry.deadline_s: expected a finite, non-negative duration"),
    ("tiers: [{name: a, kind: local, path: p, retry: {max_s: 1e999s}}]", "tiers[0].retry.max_s: expected a"),
    ("tiers: [{name: a, kind: faulty, slots: 2, inner: {kind: nosuch}}]",  # key path was "inner.kind"
     "tiers[0].inner.kind: unknown tier kind 'nosuch'"),
])
def test_config_regressions(tmp_path, yaml_text, expected):
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    assert str(info.value).startswith(f"{path}: "), str(info.value)
    assert expected in str(info.value)


def test_unreadable_configuration_files(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"run_id: caf\xe9\ntiers: []\n")  # was a UnicodeDecodeError
    with pytest.raises(ConfigError, match="latin1.yaml: cannot read the configuration: .*utf-8"):
        load_config(str(latin1))
    with pytest.raises(ConfigError, match="cannot read the configuration: embedded null byte"):
        load_config("tiers\0.yaml")  # was a ValueError
    deep = tmp_path / "deep.yaml"
    deep.write_text("tiers: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match="deep.yaml"):
        load_config(str(deep))


# ----- manifests ----------------------------------------------------------------------------------------------
def _manifest(**changes) -> dict:
    doc = {"format": "tiered_ckpt.manifest", "version": 1, "step": 10, "layout": "rank_sharded",
           "parallel": {"tp": 1, "pp": 1, "dp": 2, "ep": 1, "cp": 1, "order": "tp-cp-ep-dp-pp", "world_size": 2},
           "files": [{"key": "iter_0000010/rank_00000/state.flat", "item": "state", "rank": 0, "codec": "flat",
                      "size": 100, "checksum": "xxh3_128:00", "compression": None, "raw_size": None, "meta": {}}],
           "run_id": "r", "created": 1.5, "extra": {"ranks": [0, 1], "scope": "job"}}
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return doc


DELETE = object()


def _bytes(doc, with_digest: bool = True) -> bytes:
    if with_digest and isinstance(doc, dict):
        doc = {**doc, "digest": content_digest(doc)}
    return json.dumps(doc).encode()


MALFORMED = {
    "not JSON": (b"{", "not valid JSON"),
    "not UTF-8": (b"\xff\xfe{}", "not valid JSON"),
    "a 5000-digit number": (b'{"step": ' + b"1" * 5000 + b"}", "not valid JSON"),  # was a bare ValueError
    "nested too deeply": (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # was a RecursionError
    "a list": (_bytes([1, 2]), "expected a JSON object"),
    "wrong format": (_bytes(_manifest(format="tiered_ckpt.rank_manifest")), "format: expected"),
    "newer version": (_bytes(_manifest(version=2)), "written by a newer tiered_ckpt"),
    "no step": (_bytes(_manifest(step=DELETE)), "step is missing"),
    "step a string": (_bytes(_manifest(step="10")), "step: expected int, got str"),
    "step a bool": (_bytes(_manifest(step=True)), "step: expected int, got bool"),
    "negative step": (_bytes(_manifest(step=-1)), "step: negative"),
    "unknown field": (_bytes(_manifest(extra_field=1)), "unknown field 'extra_field'"),
    "files not a list": (_bytes(_manifest(files={})), "files: expected list"),
    "file not an object": (_bytes(_manifest(**{"files.0": "x"})), "files[0]: expected an object"),
    "file without key": (_bytes(_manifest(**{"files.0.key": DELETE})), "files[0].key is missing"),
    "negative size": (_bytes(_manifest(**{"files.0.size": -5})), "files[0].size: negative"),
    "size a float": (_bytes(_manifest(**{"files.0.size": 1.5})), "files[0].size: expected int"),
    "checksum without algorithm": (_bytes(_manifest(**{"files.0.checksum": "abc"})), "files[0].checksum"),
    "unknown file field": (_bytes(_manifest(**{"files.0.owner": "me"})), "files[0].owner: unknown field"),
    "rank outside the world": (_bytes(_manifest(**{"files.0.rank": 2})), "files[0].rank: 2 is outside a world of 2"),
    "bad parallel order": (_bytes(_manifest(**{"parallel.order": "tp-tp"})), "parallel: ParallelLayout.order"),
    "parallel size zero": (_bytes(_manifest(**{"parallel.dp": 0})), "parallel: ParallelLayout.dp"),
    "world size inconsistent": (_bytes(_manifest(**{"parallel.world_size": 3})), "parallel.world_size"),
    "digest mismatch": (_bytes(_manifest(step=11))[:-1] + b', "digest": "xxh3_128:0"}', "does not match its digest"),
    "parent directory": (_bytes(_manifest(**{"files.0.key": "../../etc/passwd"})), "'..' path components"),
    "parent in the middle": (_bytes(_manifest(**{"files.0.key": "iter_0000010/../../x"})), "'..' path components"),
    "absolute path": (_bytes(_manifest(**{"files.0.key": "/etc/passwd"})), "absolute paths"),
    "backslash": (_bytes(_manifest(**{"files.0.key": "..\\..\\x"})), "backslashes"),
    "NUL": (_bytes(_manifest(**{"files.0.key": "a\x00b"})), "NUL"),
    "empty key": (_bytes(_manifest(**{"files.0.key": ""})), "non-empty relative path"),
    "dot component": (_bytes(_manifest(**{"files.0.key": "./x"})), "'.'"),
    "double slash": (_bytes(_manifest(**{"files.0.key": "a//b"})), "empty"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_manifest_is_a_corruption_error_naming_the_file(name):
    data, expected = MALFORMED[name]
    with pytest.raises(CorruptionError) as info:
        load_checkpoint(data, "iter_0000010/tiered_ckpt/manifest.json", "nvme")
    message = str(info.value)
    assert message.startswith("tier 'nvme', file 'iter_0000010/tiered_ckpt/manifest.json': "), message
    assert expected in message


def test_a_valid_manifest_parses_with_and_without_its_digest():
    assert load_checkpoint(_bytes(_manifest())).files[0].key == "iter_0000010/rank_00000/state.flat"
    assert load_checkpoint(_bytes(_manifest(), with_digest=False)).step == 10  # written before digests


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=10)
FIELD = st.sampled_from(["format", "version", "step", "layout", "parallel", "files", "run_id", "created", "extra",
                         "rank", "coords", "key", "item", "codec", "size", "checksum", "meta", "raw_size"])


@FUZZ
@given(base=st.sampled_from(["checkpoint", "rank"]), data=st.data())
def test_fuzzed_manifests_are_refused_cleanly_or_hold_only_safe_keys(base, data):
    doc = _manifest()
    if base == "rank":
        doc.update(format="tiered_ckpt.rank_manifest", rank=0, coords={"rank": 0})
    for _ in range(data.draw(st.integers(1, 4))):
        node = data.draw(st.sampled_from(_containers(doc, [])))
        if isinstance(node, dict):
            node[data.draw(FIELD | st.text(max_size=5))] = data.draw(JSON | st.sampled_from(TRICKY))
        elif node:
            node[data.draw(st.integers(0, len(node) - 1))] = data.draw(JSON | st.sampled_from(TRICKY))
    parse = load_rank if base == "rank" else load_checkpoint
    try:
        manifest = parse(_bytes(doc, with_digest=data.draw(st.booleans())), "m.json", "t")
    except CorruptionError as exc:
        assert str(exc).startswith("tier 't', file 'm.json': ")
        return
    for f in manifest.files:
        assert check_key(f.key) == f.key and not f.key.startswith("/") and ".." not in f.key.split("/")


# ----- paths that try to leave the tier, end to end ------------------------------------------------------------
def _rewrite_manifest(path: Path, change) -> None:
    """Edit a committed manifest as an attacker (or a buggy tool) would, digest and all."""
    doc = json.loads(path.read_text())
    change(doc)
    doc["digest"] = content_digest(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("evil", ["../../outside/state.flat", "/ABS/outside/state.flat"])
def test_manifest_pointing_outside_the_tier_is_refused_and_the_next_tier_used(tmp_path, evil, recorder):
    local, shared = tmp_path / "local", tmp_path / "shared"
    cfg = {"run_id": f"evil-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "local", "kind": "local", "path": str(local), "fsync": False},
                     {"name": "shared", "kind": "fsspec", "url": f"file://{shared}"}]}
    state = {"state": {"w": torch.arange(8.0)}}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, state).wait(timeout=60)
    # A file outside the tier, with exactly the bytes and checksum the manifest will claim.
    outside = tmp_path / "outside"
    outside.mkdir()
    stolen = (local / "iter_0000001/rank_00000/state.flat").read_bytes()
    (outside / "state.flat").write_bytes(stolen)
    key = evil.replace("/ABS", str(tmp_path))

    def point_outside(doc):
        doc["files"][0]["key"] = key

    _rewrite_manifest(local / "iter_0000001/tiered_ckpt/manifest.json", point_outside)
    with CheckpointEngine(cfg) as engine:
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (1, "shared")
        assert_same(state, loaded.items)
        (fallback,) = recorder.kinds("fallback", "local")
        assert "malformed manifest" in fallback.message and repr(key) in fallback.message
    assert f"{ALGORITHM}:{digest(stolen)}"  # the outside file was a perfect forgery: only the path gave it away


# ----- pickles ---------------------------------------------------------------------------------------------------
class _RunsCode:
    """Unpickling this runs ``os.system`` (a classic payload); here it would only create a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _megatron_checkpoint(tmp_path: Path, model_item) -> tuple[dict, Path]:
    """A committed step whose Megatron model file (a torch pickle) is replaced by ``model_item`` pickled,
    with the manifest made to match (a legacy or tampered file: its checksum is right)."""
    root = tmp_path / "ckpt"
    cfg = {"run_id": f"pickle-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "layout": "megatron",
           "tiers": [{"name": "disk", "kind": "local", "path": str(root), "fsync": False}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(5, {"model_optim_rng": {"iteration": 5, "model": {"w": torch.ones(3)}}}).wait(timeout=60)
    (entry_key,) = [f["key"] for f in json.loads((root / "iter_0000005/tiered_ckpt/manifest.json").read_text())
                    ["files"]]
    buf = io.BytesIO()
    torch.save(model_item, buf)
    payload = buf.getvalue()
    (root / entry_key).write_bytes(payload)

    def match(doc):
        doc["files"][0].update(size=len(payload), raw_size=len(payload), checksum=f"{ALGORITHM}:{digest(payload)}")

    _rewrite_manifest(root / "iter_0000005/tiered_ckpt/manifest.json", match)
    return cfg, root / entry_key


def test_a_pickle_that_would_run_code_is_refused_by_default(tmp_path):
    marker = tmp_path / "pwned"
    cfg, path = _megatron_checkpoint(tmp_path, {"iteration": 5, "evil": _RunsCode(marker)})
    with CheckpointEngine(cfg) as engine:
        with pytest.raises(UnsafePickleError) as info:
            engine.load()
    message = str(info.value)
    assert "iter_0000005/mp_rank_00/model_optim_rng.pt" in message
    assert "posix.system" in message and "trust_pickles=True" in message
    assert not marker.exists(), "the payload ran"


def test_trust_pickles_loads_a_trusted_legacy_file_and_logs_it(tmp_path, caplog):
    legacy = {"iteration": 5, "when": datetime.date(2024, 1, 2), "model": {"w": torch.ones(3)}}
    cfg, _ = _megatron_checkpoint(tmp_path, legacy)
    with CheckpointEngine(cfg) as engine, pytest.raises(UnsafePickleError, match="datetime.date"):
        engine.load()  # not on the allow-list: refused by default
    with CheckpointEngine({**cfg, "load": {"trust_pickles": True}}) as engine:
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            loaded = engine.load()
    assert loaded.items["model_optim_rng"]["when"] == datetime.date(2024, 1, 2)
    assert torch.equal(loaded.items["model_optim_rng"]["model"]["w"], torch.ones(3))
    assert any("trust_pickles=True" in r.getMessage() and "datetime.date" in r.getMessage() for r in caplog.records)


def test_no_tier_left_after_refusals_is_a_clear_error(tmp_path):
    """Every copy of every step unusable: CheckpointUnreadableError names what was wrong with each."""
    root = tmp_path / "ckpt"
    cfg = {"run_id": f"none-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(root), "fsync": False}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"state": {"w": torch.ones(2)}}).wait(timeout=60)
    _rewrite_manifest(root / "iter_0000001/tiered_ckpt/manifest.json",
                      lambda doc: doc["files"][0].update(key="../escape"))
    with CheckpointEngine(cfg) as engine, pytest.raises(CheckpointUnreadableError) as info:
        engine.load()
    assert "tier 'disk' step 1" in str(info.value) and "'..' path components" in str(info.value)
