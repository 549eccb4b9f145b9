"""The Store and Drain protocols: both stores implement every Store method with the protocol's parameters, the
drains implement Drain, and the callers named in docs/architecture.md never ask which store class they hold."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tiered_ckpt
from tiered_ckpt import drain_protocol, store
from tiered_ckpt.drain import DrainRuntime
from tiered_ckpt.file_store import FileStore
from tiered_ckpt.memory_store import MemoryStore
from tiered_ckpt.worker import ProcessDrain, SplitDrain

ROOT = Path(tiered_ckpt.__file__).parent
# Every module of the package is a caller, except the stores themselves (they may tell their classes apart).
STORES = {"memory_store.py", "file_store.py", "store.py"}
CALLERS = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if str(p.relative_to(ROOT)) not in STORES)
STORE_CLASSES = {"MemoryStore", "FileStore"}


def _members(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def _parameters(fn: object) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [MemoryStore, FileStore])
def test_each_store_implements_the_store_protocol(cls):
    for name, member in _members(store.Store).items():
        assert hasattr(cls, name), f"{cls.__name__} lacks Store.{name}"
        if callable(member) and callable(getattr(cls, name)):
            assert _parameters(getattr(cls, name)) == _parameters(member), f"{cls.__name__}.{name}"


def test_the_memory_store_implements_the_snapshot_part():
    for name, member in _members(store.SnapshotStore).items():
        assert hasattr(MemoryStore, name), f"MemoryStore lacks SnapshotStore.{name}"
        if callable(member):
            assert _parameters(getattr(MemoryStore, name)) == _parameters(member), name


@pytest.mark.parametrize("cls", [DrainRuntime, ProcessDrain, SplitDrain])
def test_each_drain_implements_the_drain_protocol(cls):
    for name, member in _members(drain_protocol.Drain).items():
        assert _parameters(getattr(cls, name)) == _parameters(member), f"{cls.__name__}.{name}"


def _store_class_checks(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
                and len(node.args) == 2:
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & STORE_CLASSES:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_covers_the_whole_package():
    assert {"dcp/reader.py", "dcp/writer.py", "cli.py", "engine.py", "megatron/torch_dist.py"} <= set(CALLERS)
    assert not STORES & set(CALLERS)


def test_callers_never_ask_which_store_class_they_hold():
    found = [hit for rel in CALLERS for hit in _store_class_checks(ROOT / rel)]
    assert not found, "isinstance on a store class outside the stores (use the Store protocol): " + "; ".join(found)


def test_the_check_finds_a_store_class_switch(tmp_path):
    sample = tmp_path / "switch.py"
    sample.write_text("def f(s, m):\n    return isinstance(s, MemoryStore | FileStore) or isinstance(s, m.FileStore)\n")
    assert _store_class_checks(sample, tmp_path) == ["switch.py:2: isinstance(s, MemoryStore | FileStore)",
                                                     "switch.py:2: isinstance(s, m.FileStore)"]
