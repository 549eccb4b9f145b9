"""The fast restore path of ``torch``-codec files from the ``local`` tier.

* ``hostmem.read_file``: parallel ``preadv`` into fresh memory, hashed in file order;
* ``FileStore.read_verified``: a local file read and hashed in one pass; damage still refused with a
  CorruptionError naming the file, read errors still tier errors (retried when transient);
* ``safe_load.load_views``: ``torch.load``'s result with storages as views of the buffer already read (no second
  copy), same allow-list, same errors; anything it does not handle goes through the copying path;
* what the engine returns is this process's own memory: deleting or overwriting the checkpoint afterwards
  changes nothing.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import assert_same
from megatron_synthetic import SyntheticJob

from tiered_ckpt import CheckpointEngine, CheckpointUnreadableError, hostmem
from tiered_ckpt.checksum import digest, hasher_for
from tiered_ckpt.errors import BlobNotFoundError, CorruptionError, DecodeError, PermanentTierError, UnsafePickleError
from tiered_ckpt.load_into import tensors
from tiered_ckpt.megatron import safe_load
from tiered_ckpt.tiers import _files as files_mod
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.local import LocalOptions, LocalTier

FIXTURES = Path(__file__).parent / "data" / "megatron"
MODEL_KEY = "iter_0000100/mp_rank_00/model_optim_rng.pt"


def _blob(data: bytes) -> torch.Tensor:
    """The bytes in fresh private memory, as a file tier's read returns them."""
    out = hostmem.populated_empty(len(data))
    if data:
        out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return out


def _inside(t: torch.Tensor, blob: torch.Tensor) -> bool:
    start = blob.data_ptr()
    return start <= t.untyped_storage().data_ptr() < start + blob.numel()


def _torch_save(obj, **kwargs) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


# ----- hostmem.read_file --------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 4096, 3 * 4096 + 17, 10 * 4096])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_read_file_returns_the_bytes_and_their_hash(tmp_path, size, threads, direct):
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    hasher = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        if direct:
            assert hostmem.direct_mode(fd), "the test's filesystem refuses O_DIRECT"
        out = hostmem.read_file(fd, size, hasher=hasher, piece=4096, threads=threads,
                                direct_block=4096 if direct else None)
    finally:
        os.close(fd)
    assert out.dtype == torch.uint8 and out.numel() == size
    assert bytes(out.numpy()) == data  # the last block's read past the end leaves nothing in the result
    assert hasher.hexdigest() == digest(data)


def test_read_file_in_direct_mode_goes_through_the_page_cache_when_a_read_is_refused(tmp_path):
    # Pieces of 1000 bytes: the kernel refuses the misaligned O_DIRECT reads (EINVAL), as a filesystem that takes
    # the flag but not the I/O would; the file is then read through the page cache, whole and hashed.
    data = os.urandom(5 * 4096 + 3)
    path = tmp_path / "f"
    path.write_bytes(data)
    hasher = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert hostmem.direct_mode(fd)
        out = hostmem.read_file(fd, len(data), hasher=hasher, piece=1000, threads=3, direct_block=4096)
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)
    assert bytes(out.numpy()) == data and hasher.hexdigest() == digest(data)


def test_the_local_tier_reads_large_files_with_o_direct_and_small_ones_buffered(tmp_path, monkeypatch):
    tier = LocalTier("local", LocalOptions(path=str(tmp_path / "t")))
    big, small = os.urandom((2 << 20) + 5), os.urandom(300)
    tier.write_blob("step_1/big", [big])
    tier.write_blob("step_1/small", [small])
    seen = []
    real = files_mod.read_file

    def spy(fd, size, **kw):
        seen.append((size, kw.get("direct_block"), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real(fd, size, **kw)

    monkeypatch.setattr(files_mod, "read_file", spy)
    assert bytes(tier.read_blob("step_1/big").numpy()) == big
    assert bytes(tier.read_blob("step_1/small").numpy()) == small
    assert seen == [(len(big), 4096, True), (len(small), None, False)]
    buffered = LocalTier("plain", LocalOptions(path=str(tmp_path / "t"), direct_io=False))
    assert bytes(buffered.read_blob("step_1/big").numpy()) == big
    assert seen[-1] == (len(big), None, False)


@pytest.mark.parametrize("size", [0, 1, 4096 * 3 + 5, (1 << 20) * 3 + 123])
def test_populating_empty_is_zeros_and_keeps_what_is_written_while_it_populates(size):
    """The background population never clobbers bytes the caller wrote ahead of it, and ends up with every page
    present (the mapping outlives the caller's reference while it runs)."""
    out = hostmem.populating_empty(size, chunk=1 << 20)
    assert out.numel() == size and out.dtype == torch.uint8
    if size:
        out[size // 2:] = 7  # written while the thread may still be populating the first half
        out[: size // 2].add_(0)
        assert int(out[: size // 2].sum()) == 0 and bool((out[size // 2:] == 7).all())
    del out  # dropped mid-population: the thread holds the mapping, so it never touches unmapped memory
    time.sleep(0.05)


def test_read_file_reports_a_file_that_ended_early(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(hostmem.FileShrankError) as info:
            hostmem.read_file(fd, 20000, piece=4096, threads=2)
    finally:
        os.close(fd)
    assert info.value.got == 10000 and info.value.size == 20000


def test_read_file_raises_read_errors(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # preadv on a directory: EISDIR
    try:
        with pytest.raises(OSError) as info:
            hostmem.read_file(fd, 3 * 4096, piece=4096, threads=2)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EISDIR


# ----- safe_load.load_views ------------------------------------------------------------------------------------
def test_load_views_equals_load_on_megatrons_own_files():
    files = sorted(FIXTURES.rglob("*.pt"))
    assert files
    for path in files:
        blob = _blob(path.read_bytes())
        got = safe_load.load_views(blob, where=str(path))
        assert_same(got, safe_load.load(path))
        found = [t for t in tensors(got) if t.numel()]
        assert found and all(_inside(t, blob) for t in found), f"{path}: a storage was copied"


def test_views_keep_their_memory_alive_and_are_independent_of_the_source():
    state = {"w": torch.randn(300, 7).to(torch.bfloat16), "b": torch.arange(1000, dtype=torch.int64),
             "shared": None, "empty": torch.empty(0)}
    state["shared"] = state["w"][3]  # one storage, two tensors
    data = _torch_save(state)
    blob = _blob(data)
    got = safe_load.load_views(blob, where="x")
    assert_same(got, state)
    assert got["shared"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
    del blob
    import gc

    gc.collect()
    filler = [torch.full((1 << 20,), 0xAB, dtype=torch.uint8) for _ in range(16)]  # reuse freed memory, if any
    assert_same(got, state)
    got["w"].add_(1)  # writable, and writes reach neither the saved bytes nor a second load
    assert_same(safe_load.load_views(_blob(data), where="x"), state)
    del filler


def test_load_views_takes_a_view_into_a_larger_buffer():
    state = {"a": torch.randn(64), "b": torch.arange(10)}
    data = _torch_save(state)
    big = _blob(b"\0" * 100 + data + b"\0" * 50)
    blob = big[100:100 + len(data)]
    got = safe_load.load_views(blob, where="x")
    assert_same(got, state)
    assert all(_inside(t, blob) for t in list(tensors(got)))


def test_load_views_refuses_what_the_allow_list_does_not_cover():
    data = _torch_save({"w": torch.ones(3), "evil": ExampleGlobal()})
    with pytest.raises(UnsafePickleError) as info:
        safe_load.load_views(_blob(data), where="evil.pt")
    assert "evil.pt" in str(info.value) and "ExampleGlobal" in str(info.value)
    trusted = safe_load.load_views(_blob(data), where="evil.pt", trust_pickles=True)  # the copying path
    assert isinstance(trusted["evil"], ExampleGlobal) and torch.equal(trusted["w"], torch.ones(3))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not_a_zip", "empty"])
def test_load_views_fails_as_load_bytes_does_naming_the_file(damage):
    data = _torch_save({"w": torch.randn(100)})
    bad = {"truncated": data[:len(data) // 2], "garbage": b"PK\x03\x04" + os.urandom(500),
           "not_a_zip": b"\x80\x02" + os.urandom(200), "empty": b""}[damage]
    with pytest.raises((DecodeError, UnsafePickleError)) as expected:
        safe_load.load_bytes(bad, where="broken.pt")
    with pytest.raises(type(expected.value)) as info:
        safe_load.load_views(_blob(bad), where="broken.pt")
    assert str(info.value) == str(expected.value) and "broken.pt" in str(info.value)
    if damage != "not_a_zip":  # random bytes after a pickle header may pass for an unsafe pickle
        assert isinstance(info.value, DecodeError)


def test_load_views_loads_the_legacy_format_by_copying():
    state = {"w": torch.randn(5, 5), "n": 3}
    blob = _blob(_torch_save(state, _use_new_zipfile_serialization=False))
    got = safe_load.load_views(blob, where="legacy.pt")
    assert_same(got, state)
    assert not _inside(got["w"], blob)


def test_load_views_never_byteswaps_the_buffer():
    """A file marked big-endian is swapped while loading: that goes through the copying path, so the buffer
    (possibly a tier's own bytes) is never written."""
    state = {"w": torch.arange(16, dtype=torch.int32)}
    src = zipfile.ZipFile(io.BytesIO(_torch_save(state)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info)
            z.writestr(info.filename, b"big" if info.filename.endswith("/byteorder") else data)
    blob = _blob(out.getvalue())
    before = blob.clone()
    got = safe_load.load_views(blob, where="be.pt")
    assert torch.equal(blob, before)
    assert torch.equal(got["w"], state["w"].view(torch.uint8).view(-1, 4).flip(1).reshape(-1).view(torch.int32))


def test_load_views_copies_a_file_without_a_byteorder_record():
    state = {"w": torch.arange(16, dtype=torch.int32)}
    src = zipfile.ZipFile(io.BytesIO(_torch_save(state)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            if not info.filename.endswith("/byteorder"):
                z.writestr(info.filename, src.read(info))
    blob = _blob(out.getvalue())
    got = safe_load.load_views(blob, where="old.pt")
    assert torch.equal(got["w"], state["w"]) and not _inside(got["w"], blob)


def test_without_torchs_internals_load_views_copies(monkeypatch):
    monkeypatch.setattr(safe_load, "_has_storage_hook", lambda: False)
    state = {"w": torch.randn(10)}
    blob = _blob(_torch_save(state))
    got = safe_load.load_views(blob, where="x")
    assert_same(got, state)
    assert not _inside(got["w"], blob)


def test_an_unexpected_failure_of_the_view_path_copies_and_says_so(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("internals changed")

    monkeypatch.setattr(safe_load, "_load_views", broken)
    state = {"w": torch.randn(10)}
    with caplog.at_level("WARNING", logger=safe_load.__name__):
        got = safe_load.load_views(_blob(_torch_save(state)), where="odd.pt")
    assert_same(got, state)
    assert "odd.pt: loaded with copies" in caplog.text and "internals changed" in caplog.text


def test_the_torch_codec_decodes_to_views_only_without_copy():
    from tiered_ckpt.codecs.file_codecs import TorchFileCodec

    state = {"w": torch.randn(10)}
    blob = _blob(_torch_save(state))
    views = TorchFileCodec().decode(blob, copy=False, where="x")
    copies = TorchFileCodec().decode(blob, copy=True, where="x")
    assert_same(views, state)
    assert_same(copies, state)
    assert _inside(views["w"], blob) and not _inside(copies["w"], blob)


class ExampleGlobal:
    """Not on any allow-list."""


# ----- through the engine ---------------------------------------------------------------------------------------
def _config(root: Path, run_id: str, *, shm: str | None = None, verify: bool = True) -> dict:
    tiers = [{"name": "shm", "kind": "shm", "path": shm}] if shm else []
    tiers.append({"name": "local", "kind": "local", "path": str(root / "local"), "fsync": False,
                  "retry": {"initial_s": 0.01, "max_s": 0.01}})
    return {"run_id": run_id, "layout": "rank_sharded", "drain": {"mode": "thread"}, "tiers": tiers,
            "load": {"verify": verify}}


@pytest.fixture
def saved(tmp_path, shm_root):
    """A Megatron rank's items (``torch`` codec files) committed on ``local``; returns (root, run id, items)."""
    items = dict(SyntheticJob().rank_items(0))
    run_id = f"fast{uuid.uuid4().hex[:6]}"
    with CheckpointEngine(_config(tmp_path, run_id, shm=shm_root)) as engine:
        engine.save(100, items).wait(timeout=60)
    return tmp_path, run_id, items


def _files(root: Path) -> dict[str, Path]:
    return {p.name: p for p in (root / "local").rglob("*.pt")}


def test_restore_from_local_is_bit_exact_verified_and_in_private_memory(saved):
    root, run_id, items = saved
    files = _files(root)
    assert set(files) == {"model_optim_rng.pt", "distrib_optim.pt"}
    with CheckpointEngine(_config(root, run_id)) as engine:
        res = engine.load(copy=True)
    assert res.tier == "local" and res.step == 100 and res.verified
    assert_same(res.items, items)
    # Deleting the step (retention) and overwriting its files in place change nothing already loaded.
    for path in files.values():
        with open(path, "r+b") as f:
            f.write(b"\xff" * os.path.getsize(path))
    for path in files.values():
        path.unlink()
    assert_same(res.items, items)


def test_store_reads_local_files_hashed_in_one_pass(saved, monkeypatch):
    root, run_id, items = saved
    hashed = []
    real = hostmem.read_file

    def spy(fd, size, *, hasher=None, **kw):
        hashed.append(hasher is not None)
        return real(fd, size, hasher=hasher, **kw)

    hashers = []

    class Counting:  # how many bytes each hasher the store makes is fed
        def __init__(self, inner):
            self.inner, self.nbytes = inner, 0
            hashers.append(self)

        def update(self, data):
            self.nbytes += len(memoryview(data).cast("B"))
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    def counting_hasher_for(checksum):
        inner = hasher_for(checksum)
        return None if inner is None else Counting(inner)

    monkeypatch.setattr("tiered_ckpt.tiers._files.read_file", spy)
    monkeypatch.setattr("tiered_ckpt.file_store_read.hasher_for", counting_hasher_for)
    monkeypatch.setattr("tiered_ckpt.tiers.base.Tier.read_blob_hashed",
                        lambda *a, **k: pytest.fail("the local tier hashes while it reads"))
    with CheckpointEngine(_config(root, run_id)) as engine:
        res = engine.load(copy=True)
    assert hashed.count(True) == 2 and res.verified  # the two .pt files (manifests are read unhashed)
    sizes = sorted(p.stat().st_size for p in _files(root).values())
    assert sorted(h.nbytes for h in hashers if h.nbytes) == sizes  # each file hashed once, while it was read
    assert_same(res.items, items)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_flipped_byte_in_a_torch_file_is_refused_naming_the_file(saved, where):
    root, run_id, _ = saved
    path = _files(root)["model_optim_rng.pt"]
    size = path.stat().st_size
    offset = {"start": 0, "middle": size // 2, "end": size - 1}[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    with CheckpointEngine(_config(root, run_id)) as engine:
        store = engine.pipeline.stores["local"]
        with pytest.raises(CorruptionError) as info:
            store.load_rank(store.read_manifest(100), engine.coords)
        assert info.value.key == MODEL_KEY and "checksum mismatch" in str(info.value)
        with pytest.raises(CheckpointUnreadableError) as no:
            engine.load()
    assert MODEL_KEY in str(no.value) and "checksum mismatch" in str(no.value)


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete", "directory"])
def test_other_damage_to_a_torch_file_is_refused_naming_the_file(saved, damage):
    root, run_id, _ = saved
    path = _files(root)["model_optim_rng.pt"]
    if damage == "truncate":
        os.truncate(path, path.stat().st_size - 10)
    elif damage == "empty":
        os.truncate(path, 0)
    else:
        path.unlink()
        if damage == "directory":
            path.mkdir()
    expected = {"truncate": "size is", "empty": "size is", "delete": "no such blob",
                "directory": "no such blob"}[damage]
    with CheckpointEngine(_config(root, run_id)) as engine, pytest.raises(CheckpointUnreadableError) as no:
        engine.load()
    assert MODEL_KEY in str(no.value) and expected in str(no.value)


def test_read_errors_are_tier_errors_and_transient_ones_are_retried(saved, monkeypatch):
    root, run_id, items = saved
    real = os.preadv
    failures = {"left": 1, "errno": errno.EAGAIN}

    def flaky(fd, buffers, offset):
        if failures["left"] and sum(len(b) for b in buffers) > 1 << 20:  # the .pt files, not the manifests
            failures["left"] -= 1
            raise OSError(failures["errno"], os.strerror(failures["errno"]))
        return real(fd, buffers, offset)

    monkeypatch.setattr(hostmem.os, "preadv", flaky)
    with CheckpointEngine(_config(root, run_id)) as engine:
        store = engine.pipeline.stores["local"]
        res = engine.load()
        assert failures["left"] == 0 and res.tier == "local"
        assert_same(res.items, items)
        failures.update(left=1, errno=errno.EIO)  # permanent: no retry, the tier is given up
        with pytest.raises(PermanentTierError) as info:
            store.load_rank(store.read_manifest(100), engine.coords)
    assert info.value.key.endswith(".pt")


def test_a_file_that_shrinks_while_read_is_a_tier_error(saved, monkeypatch):
    root, run_id, _ = saved

    def shrinking(fd, size, **kw):
        raise hostmem.FileShrankError(size // 2, size)

    monkeypatch.setattr("tiered_ckpt.tiers._files.read_file", shrinking)
    with CheckpointEngine(_config(root, run_id)) as engine:
        store = engine.pipeline.stores["local"]
        with pytest.raises(PermanentTierError, match="shrank while being read"):
            store.load_rank(store.read_manifest(100), engine.coords)


def test_without_verify_nothing_is_hashed(saved, monkeypatch):
    root, run_id, items = saved
    seen = []
    real = hostmem.read_file
    monkeypatch.setattr("tiered_ckpt.tiers._files.read_file",
                        lambda fd, size, *, hasher=None, **kw: seen.append(hasher) or real(fd, size, **kw))
    with CheckpointEngine(_config(root, run_id, verify=False)) as engine:
        res = engine.load()
    assert len(seen) >= 2 and seen == [None] * len(seen) and not res.verified
    assert_same(res.items, items)


def test_a_wrapped_local_tier_still_reads_through_read_blob(saved):
    """A tier without a hashing read of its own (the faulty plugin's wrapper, say) is read with its own
    read_blob, then hashed, so the faults it injects still reach verification."""
    root, run_id, _ = saved
    with CheckpointEngine(_config(root, run_id)) as engine:
        store = engine.pipeline.stores["local"]
        store.tier = _Wrapper(store.tier)
        with pytest.raises(BlobNotFoundError, match="wrapper says no"):
            store.read_verified(store.read_manifest(100).files[0], 100, 0)


class _Wrapper(Tier):
    kind = "wrapper"

    def __init__(self, inner):
        super().__init__(inner.name, inner.options)
        self.inner = inner
        self.capabilities = inner.capabilities

    def read_blob(self, key):
        raise BlobNotFoundError("wrapper says no", tier=self.name, key=key)

    def write_blob(self, key, chunks):
        return self.inner.write_blob(key, chunks)

    def size(self, key):
        return self.inner.size(key)

    def exists(self, key):
        return self.inner.exists(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)
