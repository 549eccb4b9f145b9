"""The tier contract suite: what every tier kind must do, as pytest tests.

Subclass :class:`TierContract` in a test module and provide a ``tier`` fixture returning a fresh, empty
tier::

    from tiered_ckpt.testing import TierContract

    class TestMyTier(TierContract):
        @pytest.fixture
        def tier(self, tmp_path):
            tier = MyTier("mine", MyTier.Options(path=str(tmp_path)))
            yield tier
            tier.close()

Every test applies to every tier, except those about a capability the tier says it lacks (slots need
``capabilities.memory``, view semantics ``capabilities.zero_copy_read``): those are skipped with the
capability as the reason. The semantics tested are the ones :mod:`tiered_ckpt.tiers.base` documents (the blob
primitives, and what the engine, ``gc`` and the CLI ask of a kind: ``resolve_enabled``, ``check_usable``,
``staging_options``, ``location``, ``missing_location``, ``temp_files``, ``unfinished_uploads``, ``modified``),
plus one about configuration: the tier's ``options``, written into a ``tiers.yaml`` entry, load back equal
through :func:`~tiered_ckpt.config.load_config` (every field type is one a file can express, no field is hidden
by a common tier key such as ``keep``).

The slot and zero-copy tests are in :mod:`~tiered_ckpt.testing.slot_contract`, the interface tests in
:mod:`~tiered_ckpt.testing.interface_contract`; :class:`TierContract` includes both.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from ..errors import BlobNotFoundError, TierError
from ..tiers.base import Tier
from .interface_contract import InterfaceContract
from .slot_contract import SlotContract, _digest, host_bytes

MiB = 1 << 20

# Chunk types write_blob accepts, each with the bytes it stands for.
CHUNK_KINDS: dict[str, Any] = {
    "bytes": lambda: b"bytes|",
    "bytearray": lambda: bytearray(b"bytearray|"),
    "memoryview": lambda: memoryview(b"0123memoryview|")[4:],
    "numpy_uint8": lambda: np.arange(11, dtype=np.uint8),
    "numpy_float32": lambda: np.array([1.5, -2.0, 3.25], dtype=np.float32),
    "numpy_2d": lambda: np.arange(12, dtype=np.int16).reshape(3, 4),
    "tensor_uint8": lambda: torch.arange(7, dtype=torch.uint8),
    "tensor_float32": lambda: torch.tensor([1.0, 2.5, -3.0]),
    "tensor_bfloat16": lambda: torch.tensor([0.5, -1.25, 7.0], dtype=torch.bfloat16),
    "tensor_int64_scalar": lambda: torch.tensor(123456789, dtype=torch.int64),
    "tensor_2d": lambda: torch.arange(6, dtype=torch.int32).reshape(2, 3),
    "tensor_noncontiguous": lambda: torch.arange(16, dtype=torch.int16).reshape(4, 4)[:, 1],
    "tensor_requires_grad": lambda: torch.ones(3, requires_grad=True),
}

INVALID_KEYS = ["", "/abs/key", "../up", "a/../b", "a//b", "./a", "a/", "a\\b", "nul\x00byte"]


def raw_files(root: Any) -> list[str]:
    """Every file under ``root`` as the file system has it (temporary files included), relative and sorted."""
    out = []
    for dirpath, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in files]
    return sorted(out)


def yaml_value(value: Any) -> Any:
    """``value`` (an Options field) as a YAML file would hold it: paths as strings, tuples as lists,
    dataclasses as mappings."""
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: yaml_value(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [yaml_value(v) for v in value]
    if isinstance(value, dict):
        return {k: yaml_value(v) for k, v in value.items()}
    return value


class TierContract(InterfaceContract, SlotContract):
    """The contract tests; a subclass provides the ``tier`` fixture (a fresh, empty tier)."""

    large_blob_bytes = 48 * MiB  # big enough to cross buffer, part and block sizes
    publish_rounds = 40  # publishes while a reader polls

    @pytest.fixture
    def tier(self) -> Tier:  # pragma: no cover - subclasses override
        raise NotImplementedError("subclasses of TierContract provide a `tier` fixture")

    # ----- helpers -----------------------------------------------------------------------------------------
    @staticmethod
    def read(tier: Tier, key: str) -> bytes:
        return host_bytes(tier.read_blob(key))

    @staticmethod
    def require(tier: Tier, capability: str, why: str) -> None:
        """Skip unless ``tier.capabilities.<capability>`` is true; the reason names the capability."""
        if not getattr(tier.capabilities, capability):
            pytest.skip(f"{tier.kind} tier: capabilities.{capability} is False ({why})")

    # ----- write / read ------------------------------------------------------------------------------------
    @pytest.mark.parametrize("chunk_kind", sorted(CHUNK_KINDS))
    def test_round_trip_of_each_chunk_type(self, tier: Tier, chunk_kind: str) -> None:
        chunk = CHUNK_KINDS[chunk_kind]()
        expected = host_bytes(chunk)
        assert tier.write_blob(f"types/{chunk_kind}.bin", [chunk]) == len(expected)
        out = tier.read_blob(f"types/{chunk_kind}.bin")
        assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.dim() == 1
        assert host_bytes(out) == expected

    @pytest.mark.parametrize("as_stream", [False, True], ids=["list", "generator"])
    def test_round_trip_of_mixed_chunks(self, tier: Tier, as_stream: bool) -> None:
        chunks = [make() for _, make in sorted(CHUNK_KINDS.items())]
        expected = b"".join(host_bytes(c) for c in chunks)
        source = (c for c in chunks) if as_stream else chunks
        assert tier.write_blob("mixed/blob.bin", source) == len(expected)
        assert self.read(tier, "mixed/blob.bin") == expected
        assert tier.size("mixed/blob.bin") == len(expected)

    def test_producer_may_reuse_its_buffer(self, tier: Tier) -> None:
        buf = bytearray(64 * 1024)

        def produce():
            for i in range(5):
                buf[:] = bytes([i + 1]) * len(buf)
                yield buf

        assert tier.write_blob("reuse.bin", produce()) == 5 * len(buf)
        assert self.read(tier, "reuse.bin") == b"".join(bytes([i + 1]) * len(buf) for i in range(5))

    @pytest.mark.parametrize("chunks", [[], [b""], "generator"],
                             ids=["no_chunks", "empty_chunk", "empty_stream"])
    def test_empty_blob(self, tier: Tier, chunks: Any) -> None:
        source = iter(()) if chunks == "generator" else chunks
        assert tier.write_blob("empty", source) == 0
        assert tier.exists("empty")
        assert tier.size("empty") == 0
        out = tier.read_blob("empty")
        assert out.dtype == torch.uint8 and out.numel() == 0
        assert tier.list() == ["empty"]
        assert tier.read_range("empty", 0, 0) == b""

    def test_overwrite_replaces(self, tier: Tier) -> None:
        tier.write_blob("k", [b"x" * 5000])
        tier.write_blob("k", [b"short"])
        assert self.read(tier, "k") == b"short"
        assert tier.size("k") == 5
        tier.write_blob("k", [b"y" * 7000])
        assert self.read(tier, "k") == b"y" * 7000
        assert tier.list() == ["k"]

    @pytest.mark.parametrize("as_stream", [False, True], ids=["list", "generator"])
    def test_large_blob(self, tier: Tier, as_stream: bool) -> None:
        n = self.large_blob_bytes
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        step = 7 * MiB + 3  # pieces that align with nothing
        pieces = [data[i:i + step] for i in range(0, n, step)]
        written = tier.write_blob("big/blob.bin", (p for p in pieces) if as_stream else pieces)
        assert written == n
        assert tier.size("big/blob.bin") == n
        out = tier.read_blob("big/blob.bin")
        assert out.numel() == n
        assert _digest(out.cpu()) == _digest(data)
        mid = n // 2 - 12345
        assert tier.read_range("big/blob.bin", mid, 3 * MiB) == host_bytes(data[mid:mid + 3 * MiB])

    def test_read_result_is_not_changed_by_a_later_write(self, tier: Tier) -> None:
        tier.write_blob("k", [b"A" * 10000])
        first = tier.read_blob("k")
        tier.write_blob("k", [b"B" * 10000])
        tier.publish("k", b"C" * 20000)
        assert host_bytes(first) == b"A" * 10000
        assert self.read(tier, "k") == b"C" * 20000

    # ----- ranges, size, exists ----------------------------------------------------------------------------
    def test_read_range(self, tier: Tier) -> None:
        blob = bytes(range(256)) * 4
        tier.write_blob("r", [blob])
        assert tier.read_range("r", 0, 10) == blob[:10]
        assert tier.read_range("r", 1000, 24) == blob[1000:]
        assert tier.read_range("r", 300, 0) == b""
        assert isinstance(tier.read_range("r", 5, 5), bytes)
        for offset, length in [(1020, 10), (1025, 0), (-1, 5), (0, -1)]:
            with pytest.raises(TierError):
                tier.read_range("r", offset, length)

    def test_size_and_exists(self, tier: Tier) -> None:
        assert not tier.exists("d/x")
        tier.write_blob("d/x", [b"12345"])
        assert tier.exists("d/x")
        assert tier.size("d/x") == 5
        assert not tier.exists("d"), "a directory-like prefix is not a blob"
        with pytest.raises(BlobNotFoundError):
            tier.size("d")

    def test_missing_key(self, tier: Tier) -> None:
        tier.write_blob("present", [b"x"])
        for call in (lambda: tier.read_blob("absent"), lambda: tier.size("absent"),
                     lambda: tier.read_range("absent", 0, 1), lambda: tier.read_blob("present/below"),
                     lambda: tier.read_blob("no/such/dir/key")):
            with pytest.raises(BlobNotFoundError) as info:
                call()
            assert isinstance(info.value, KeyError)
        assert not tier.exists("absent")

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_keys_are_rejected(self, tier: Tier, key: str) -> None:
        consumed = []

        def chunks():
            consumed.append(True)
            yield b"x"

        calls = {
            "write_blob": lambda: tier.write_blob(key, chunks()),
            "publish": lambda: tier.publish(key, b"x"),
            "read_blob": lambda: tier.read_blob(key),
            "read_range": lambda: tier.read_range(key, 0, 1),
            "size": lambda: tier.size(key),
            "exists": lambda: tier.exists(key),
            "delete": lambda: tier.delete(key),
        }
        if tier.capabilities.memory:
            calls["allocate_slot"] = lambda: tier.allocate_slot(key, 16)
        for name, call in calls.items():
            with pytest.raises(ValueError):
                call()
                pytest.fail(f"{name}({key!r}) was accepted")
        assert not consumed, "write_blob consumed chunks before checking the key"
        assert tier.list() == []

    @pytest.mark.parametrize("prefix", ["../", "/abs", "a/../b/", "./"])
    def test_invalid_prefixes_are_rejected(self, tier: Tier, prefix: str) -> None:
        with pytest.raises(ValueError):
            tier.list(prefix)
        with pytest.raises(ValueError):
            tier.delete_prefix(prefix)

    # ----- list --------------------------------------------------------------------------------------------
    KEYS = ["a/b/c", "a/b/c2", "a/b/d", "a/e", "ab/f", "z", "iter_0000010/mp_rank_00/model_optim_rng.pt",
            "iter_0000002/mp_rank_00/model_optim_rng.pt", "dots.in.name/file-1_2.pt"]

    def _fill(self, tier: Tier) -> None:
        for key in reversed(self.KEYS):
            tier.write_blob(key, [key.encode()])

    def test_list_everything_sorted(self, tier: Tier) -> None:
        assert tier.list() == []
        self._fill(tier)
        assert tier.list() == sorted(self.KEYS)
        assert tier.list("") == sorted(self.KEYS)
        for key in self.KEYS:
            assert self.read(tier, key) == key.encode()

    @pytest.mark.parametrize("prefix, expected", [
        ("a/", ["a/b/c", "a/b/c2", "a/b/d", "a/e"]),
        ("a", ["a/b/c", "a/b/c2", "a/b/d", "a/e", "ab/f"]),
        ("a/b", ["a/b/c", "a/b/c2", "a/b/d"]),
        ("a/b/c", ["a/b/c", "a/b/c2"]),
        ("a/b/d", ["a/b/d"]),
        ("iter_", ["iter_0000002/mp_rank_00/model_optim_rng.pt",
                   "iter_0000010/mp_rank_00/model_optim_rng.pt"]),
        ("iter_0000010/", ["iter_0000010/mp_rank_00/model_optim_rng.pt"]),
        ("z", ["z"]),
        ("nothing/", []),
        ("q", []),
        ("a/b/c/", []),
    ])
    def test_list_prefix(self, tier: Tier, prefix: str, expected: list[str]) -> None:
        self._fill(tier)
        assert tier.list(prefix) == expected

    def test_write_in_progress_is_invisible(self, tier: Tier) -> None:
        tier.write_blob("old", [b"old content"])
        seen: dict[str, Any] = {}

        def chunks():
            yield b"n" * MiB
            seen["list"] = tier.list()
            seen["exists_new"] = tier.exists("new/blob")
            seen["exists_old"] = tier.exists("old")
            yield b"e" * MiB

        def overwrite():
            yield b"partial" * 1000
            seen["old_during_overwrite"] = self.read(tier, "old")
            seen["list_during_overwrite"] = tier.list()
            yield b"rest"

        tier.write_blob("new/blob", chunks())
        assert seen == {"list": ["old"], "exists_new": False, "exists_old": True}
        tier.write_blob("old", overwrite())
        assert seen["old_during_overwrite"] == b"old content"
        assert seen["list_during_overwrite"] == ["new/blob", "old"]
        assert tier.list() == ["new/blob", "old"]

    # ----- failure -----------------------------------------------------------------------------------------
    @staticmethod
    def _failing(after_bytes: int):
        class Boom(RuntimeError):
            pass

        def chunks():
            yield b"p" * after_bytes
            raise Boom("producer failed midway")

        return chunks(), Boom

    def test_failed_write_keeps_the_old_blob(self, tier: Tier) -> None:
        tier.write_blob("ckpt/file.pt", [b"good" * 1000])
        chunks, boom = self._failing(2 * MiB)
        with pytest.raises(boom, match="producer failed midway"):
            tier.write_blob("ckpt/file.pt", chunks)
        assert self.read(tier, "ckpt/file.pt") == b"good" * 1000
        assert tier.list() == ["ckpt/file.pt"]

    def test_failed_first_write_leaves_nothing(self, tier: Tier) -> None:
        chunks, boom = self._failing(MiB)
        with pytest.raises(boom):
            tier.write_blob("ckpt/new.pt", chunks)
        assert not tier.exists("ckpt/new.pt")
        assert tier.list() == []
        with pytest.raises(BlobNotFoundError):
            tier.read_blob("ckpt/new.pt")
        tier.write_blob("ckpt/new.pt", [b"retry works"])  # nothing left in the way
        assert self.read(tier, "ckpt/new.pt") == b"retry works"

    # ----- delete ------------------------------------------------------------------------------------------
    def test_delete(self, tier: Tier) -> None:
        tier.write_blob("x/one", [b"1"])
        tier.write_blob("x/two", [b"2"])
        tier.delete("x/one")
        assert not tier.exists("x/one")
        with pytest.raises(BlobNotFoundError):
            tier.read_blob("x/one")
        tier.delete("x/one")  # missing: not an error
        tier.delete("never/existed")
        tier.delete("x")  # a directory-like prefix is not a blob: nothing happens
        assert tier.list() == ["x/two"]
        assert self.read(tier, "x/two") == b"2"
        tier.delete("x/two")
        assert tier.list() == []
        tier.write_blob("x/one", [b"again"])  # the emptied directory does not get in the way
        assert self.read(tier, "x/one") == b"again"

    def test_delete_prefix(self, tier: Tier) -> None:
        for key in ["a/x", "a/y/z", "a/y/w/v", "ab/w", "b"]:
            tier.write_blob(key, [key.encode()])
        tier.delete_prefix("a")
        assert tier.list() == ["ab/w", "b"]
        tier.delete_prefix("missing/")
        tier.delete_prefix("ab/")
        assert tier.list() == ["b"]
        tier.write_blob("a/y/z", [b"new"])
        assert tier.list() == ["a/y/z", "b"]

    def test_stored_bytes(self, tier: Tier) -> None:
        """What a prefix holds, for the sizes ``ls`` and ``gc`` report: every blob under it, nothing beside it."""
        assert tier.stored_bytes("a") == 0
        for key, n in [("a/x", 3), ("a/y/z", 5), ("ab/w", 7), ("b", 11)]:
            tier.write_blob(key, [b"v" * n])
        big = self.large_blob_bytes
        tier.write_blob("a/big", [b"\x01" * big])
        assert tier.stored_bytes("a") == tier.stored_bytes("a/") == 8 + big
        assert tier.stored_bytes("ab") == 7
        tier.delete_prefix("a")
        assert tier.stored_bytes("a") == 0

    # ----- publish -----------------------------------------------------------------------------------------
    def test_publish(self, tier: Tier) -> None:
        tier.publish("latest_checkpointed_iteration.txt", b"10")
        assert self.read(tier, "latest_checkpointed_iteration.txt") == b"10"
        tier.publish("latest_checkpointed_iteration.txt", b"20")
        assert self.read(tier, "latest_checkpointed_iteration.txt") == b"20"
        tier.publish("iter_0000020/manifest.json", b"{}")
        assert tier.list() == ["iter_0000020/manifest.json", "latest_checkpointed_iteration.txt"]

    def test_publish_is_atomic_for_concurrent_readers(self, tier: Tier) -> None:
        a, b = b"A" * (256 * 1024), b"B" * (384 * 1024)
        tier.publish("manifest.json", a)
        done = threading.Event()
        bad: list[str] = []
        reads = [0]

        def reader() -> None:
            while not done.is_set() or reads[0] == 0:
                try:
                    data = self.read(tier, "manifest.json")
                except Exception as exc:  # any failure is a contract violation
                    bad.append(f"read raised {exc!r}")
                    return
                if data != a and data != b:
                    bad.append(f"saw {len(data)} bytes: {data[:8]!r}...{data[-8:]!r}")
                    return
                reads[0] += 1

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            for i in range(self.publish_rounds):
                tier.publish("manifest.json", b if i % 2 == 0 else a)
                if bad or time.monotonic() > deadline:
                    break
        finally:
            done.set()
            thread.join(30)
        assert not bad, bad[0]
        assert reads[0] > 0
        assert tier.list() == ["manifest.json"]

    def test_concurrent_writes_of_different_keys(self, tier: Tier) -> None:
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for i in range(5):
                    tier.write_blob(f"rank_{t:05d}/part{i}", [bytes([t * 10 + i]) * (64 * 1024 + t)])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors[0]
        assert len(tier.list()) == 20
        for t in range(4):
            for i in range(5):
                assert self.read(tier, f"rank_{t:05d}/part{i}") == bytes([t * 10 + i]) * (64 * 1024 + t)

    # ----- configuration ---------------------------------------------------------------------------------------
    def test_options_load_from_a_yaml_file(self, tier: Tier, tmp_path: Any) -> None:
        import yaml

        from ..config import _COMMON_TIER_KEYS, load_config
        from ..plugins import Registries, get_plugin_manager
        from ..registry import Registry

        cls = type(tier)
        options = tier.options
        if options is None or not dataclasses.is_dataclass(options):
            pytest.skip("the tier has no Options dataclass")
        fields = [f.name for f in dataclasses.fields(options) if f.init]
        hidden = sorted(set(fields) & _COMMON_TIER_KEYS)
        assert not hidden, f"{cls.__name__}.Options fields {hidden} can never be set: a tier entry's key of that " \
                           "name is the common tier key"
        entry = {"name": "contract", "kind": cls.kind, **{n: yaml_value(getattr(options, n)) for n in fields}}
        path = tmp_path / "tiers.yaml"
        path.write_text(yaml.safe_dump({"tiers": [entry]}))
        kinds = Registry("tier kind")
        kinds.add(cls.kind, cls)
        default = get_plugin_manager().registries
        config = load_config(str(path), registries=Registries(kinds, default.layouts, default.codecs))
        assert config.tiers[0].options == options
