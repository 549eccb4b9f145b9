"""Behaviour of each built-in tier kind beyond the shared contract (tests/test_tier_contract.py)."""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import uuid
import warnings

import pytest
import torch

from tiered_ckpt.errors import (
    CapacityError,
    ConfigError,
    CorruptionError,
    PermanentTierError,
    TierError,
    TransientTierError,
)
from tiered_ckpt.testing.contract import TierContract, host_bytes, raw_files
from tiered_ckpt.tiers import _files, _s3_split, gpu, shm
from tiered_ckpt.tiers.base import TierContext, as_memoryview
from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier
from tiered_ckpt.tiers.gpu import GpuOptions, GpuTier, resolve_enabled
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.shm import ShmTier, filesystem_type
from tiered_ckpt.validate import build_dataclass

MiB = 1 << 20


def failing_chunks(nbytes: int):
    yield b"p" * nbytes
    raise RuntimeError("producer failed")


# ----- registry and options -------------------------------------------------------------------------------
def test_builtin_kinds_are_registered(tier_registry):
    for kind, cls in [("gpu", GpuTier), ("shm", ShmTier), ("local", LocalTier), ("fsspec", FsspecTier)]:
        assert tier_registry.get(kind) is cls
        assert cls.kind == kind
        assert tier_registry.provider_of(kind) == "tiered_ckpt.builtin"


@pytest.mark.parametrize("cls, data, message", [
    (LocalTier, {}, "tiers[2].path: required key is missing"),
    (LocalTier, {"path": "/x", "fsync": "yes"}, "tiers[2].fsync: expected true or false"),
    (LocalTier, {"path": "/x", "compress": 1}, "tiers[2].compress: unknown key"),
    (ShmTier, {"min_free": "lots"}, "tiers[2].min_free: expected a byte size"),
    (GpuTier, {"device": "tpu-ish"}, "expected a torch device"),
    (GpuTier, {"max_bytes": -5}, "tiers[2].max_bytes"),
    (FsspecTier, {}, "tiers[2].url: required key is missing"),
    (FsspecTier, {"url": "s3://b/p", "options": [1]}, "tiers[2].options: expected a mapping"),
    # keys a tier would ignore are refused (a new-user trial tuned them on a file:// tier and saw no effect)
    (FsspecTier, {"url": "file:///x", "part_size": "32MiB"}, "part_size: only plain S3 URLs"),
    (FsspecTier, {"url": "memory://x", "max_concurrency": 4}, "max_concurrency: only plain S3 URLs"),
    (FsspecTier, {"url": "gs://b/p", "timeout_s": "5s"}, "timeout_s: only plain S3 URLs"),
    (FsspecTier, {"url": "simplecache::s3://b/p", "request_attempts": 5}, "request_attempts: only plain S3 URLs"),
    (FsspecTier, {"url": "s3://b/p", "block_size": "1MiB"}, "block_size: S3 tiers read and write in part_size"),
    # an endpoint without its scheme failed every save with botocore's "Invalid endpoint" (an S3 user's trial)
    (FsspecTier, {"url": "s3://b/p", "options": {"endpoint_url": "127.0.0.1:9000"}},
     "options.endpoint_url: '127.0.0.1:9000' is not an endpoint URL: write it with its scheme, http://127.0.0.1:9000"),
    (FsspecTier, {"url": "s3://b/p", "options": {"client_kwargs": {"endpoint_url": "minio:9000"}}},
     "options.client_kwargs.endpoint_url: 'minio:9000' is not an endpoint URL"),
])
def test_options_are_validated(cls, data, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_dataclass(cls.Options, data, "tiers[2]", "tiers.yaml")


def test_options_parse_units():
    assert build_dataclass(ShmTier.Options, {"min_free": "2GiB"}).min_free == 2 << 30
    assert build_dataclass(GpuTier.Options, {"max_bytes": "8GiB", "device": "cpu"}).max_bytes == 8 << 30
    opts = build_dataclass(FsspecTier.Options,
                           {"url": "memory://x", "block_size": "5MiB", "options": {"a": 1}})
    assert opts.block_size == 5 * MiB and dict(opts.options) == {"a": 1}


# ----- gpu ------------------------------------------------------------------------------------------------
def test_gpu_reads_are_the_stored_tensor(make_tier):
    tier = make_tier("gpu", device="cpu")
    tier.write_blob("k", [b"abc"])
    assert tier.read_blob("k").data_ptr() == tier.read_blob("k").data_ptr()
    slot = tier.allocate_slot("s", 100)
    assert tier.read_blob("s").data_ptr() == slot.data_ptr()
    assert not tier.capabilities.survives_process and tier.capabilities.memory


def test_gpu_keeps_tensor_chunks_on_their_device_and_copies_them(make_tier):
    tier = make_tier("gpu", device="cpu")
    src = torch.arange(10, dtype=torch.float32)
    tier.write_blob("t", [src])
    src.zero_()  # the tier holds a copy, not the caller's tensor
    assert host_bytes(tier.read_blob("t")) == host_bytes(torch.arange(10, dtype=torch.float32))
    assert tier.read_blob("t").device == torch.device("cpu")


def test_gpu_max_bytes(make_tier):
    tier = make_tier("gpu", device="cpu", max_bytes=10_000)
    tier.write_blob("a", [b"x" * 6000])
    with pytest.raises(CapacityError) as info:
        tier.write_blob("b", [b"y" * 6000])
    msg = str(info.value)
    assert "tier 'gpu0'" in msg and "key 'b'" in msg and "6000 bytes" in msg and "max_bytes" in msg
    assert not tier.exists("b")
    tier.write_blob("a", [b"z" * 9000])  # replacing a blob counts only the new size
    with pytest.raises(CapacityError):
        tier.allocate_slot("slot", 2000)
    with pytest.raises(CapacityError):
        tier.write_blob("c", (b"q" * 600 for _ in range(5)))  # a stream is checked as it grows
    tier.delete("a")
    assert tier.allocate_slot("slot", 10_000).numel() == 10_000
    assert tier.held_bytes() == 10_000


def test_gpu_checks_free_cuda_memory_before_allocating(monkeypatch):
    tier = GpuTier("hbm", GpuOptions(device="cuda:0"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    with pytest.raises(CapacityError, match=r"needs 2.00 MiB .* but cuda:0 has 1.00 MiB"):
        tier.allocate_slot("snap/0", 2 * MiB)


def test_gpu_availability_and_resolve_enabled(monkeypatch, caplog):
    cpu = GpuOptions(device="cpu")
    assert GpuTier.availability(cpu)[0] is True
    assert GpuTier.resolve_enabled("auto", cpu) is True
    assert resolve_enabled(True, cpu) is True and resolve_enabled("auto", cpu) is True
    assert resolve_enabled(False, GpuOptions()) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, reason = GpuTier.availability(GpuOptions(device="cuda"))
    assert not ok and "CUDA is not available" in reason
    with caplog.at_level(logging.INFO, logger=gpu.__name__):
        assert resolve_enabled("auto", GpuOptions(), name="hbm") is False
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "hbm" in caplog.text and "enabled: auto" in caplog.text
    with pytest.raises(ConfigError, match="enabled is true but the device cannot be used: CUDA is not"):
        resolve_enabled(True, GpuOptions(device="cuda:0"), name="hbm")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestGpuTierOnCuda(TierContract):
    large_blob_bytes = 64 * MiB

    @pytest.fixture
    def tier(self, make_tier):
        return make_tier("gpu", device="cuda")

    def test_device_chunks_stay_on_the_device(self, tier):
        src = torch.arange(1000, dtype=torch.float16, device="cuda")
        tier.write_blob("d", [src])
        out = tier.read_blob("d")
        assert out.is_cuda and torch.equal(out.view(torch.float16), src)
        slot = tier.allocate_slot("s", 4096)
        assert slot.is_cuda


# ----- shm ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_shm_filesystem_type_of_dev_shm():
    assert filesystem_type("/dev/shm") in shm.MEMORY_FILESYSTEMS
    assert filesystem_type("/dev/shm/does/not/exist/yet") in shm.MEMORY_FILESYSTEMS


def test_shm_filesystem_type_uses_the_longest_mount_prefix(monkeypatch):
    table = [("/", "ext4"), ("/dev/shm", "tmpfs"), ("/data", "xfs"), ("/data/fast", "tmpfs"),
             ("/data", "nfs")]
    monkeypatch.setattr(shm, "_mount_table", lambda: table)
    assert filesystem_type("/dev/shm/x") == "tmpfs"
    assert filesystem_type("/dev/shmx") == "ext4"
    assert filesystem_type("/data/fast/a") == "tmpfs"
    assert filesystem_type("/data/slow") == "nfs"  # the later mount hides the earlier one
    monkeypatch.setattr(shm, "_mount_table", lambda: [])
    assert filesystem_type("/anything") == "unknown"


def test_shm_mountinfo_parsing(monkeypatch, tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:26 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=1g\n"
        "31 22 0:27 / /mnt/with\\040space rw master:7 - ramfs none rw\n")
    real_open = open
    monkeypatch.setattr("builtins.open",
                        lambda p, *a, **k: real_open(info if p == "/proc/self/mountinfo" else p, *a, **k))
    assert shm._mount_table() == [("/", "ext4"), ("/dev/shm", "tmpfs"), ("/mnt/with space", "ramfs")]


def test_shm_on_tmpfs_does_not_warn(make_tier, shm_root, caplog):
    if filesystem_type(shm_root) not in shm.MEMORY_FILESYSTEMS:
        pytest.skip(f"shm_root {shm_root} is not on tmpfs here")
    with caplog.at_level(logging.WARNING, logger=shm.__name__):
        tier = make_tier("shm", path=shm_root)
    assert tier.filesystem_type == "tmpfs" and not caplog.records


def test_shm_on_disk_warns_loudly(make_tier, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(shm, "_mount_table", lambda: [("/", "ext4")])
    with caplog.at_level(logging.WARNING, logger=shm.__name__):
        tier = make_tier("shm", path=tmp_path / "fake-shm")
    assert tier.filesystem_type == "ext4"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert str(tmp_path / "fake-shm") in record.getMessage() and "ext4" in record.getMessage()
    assert "50 s" in record.getMessage() and "tmpfs" in record.getMessage()
    tier.write_blob("still/works", [b"ok"])  # a warning, not a failure
    assert host_bytes(tier.read_blob("still/works")) == b"ok"


def test_shm_directories_and_file_modes(make_tier, shm_root, tier_context):
    tier = make_tier("shm", path=shm_root)
    user_dir = os.path.join(shm_root, tier_context.user)
    assert tier.root == os.path.join(user_dir, tier_context.run_id)
    tier.write_blob("iter_0000001/blob", [b"x"])
    tier.publish("manifest.json", b"{}")
    tier.allocate_slot("snap/0", 4096)
    for d in [user_dir, tier.root, os.path.join(tier.root, "iter_0000001"), os.path.join(tier.root, "snap")]:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for f in ["iter_0000001/blob", "manifest.json", "snap/0"]:
        assert stat.S_IMODE(os.stat(os.path.join(tier.root, f)).st_mode) == 0o600, f


def test_shm_tightens_a_loose_user_directory(shm_root, tier_context, caplog):
    user_dir = os.path.join(shm_root, tier_context.user)
    os.mkdir(user_dir)
    os.chmod(user_dir, 0o755)
    with caplog.at_level(logging.WARNING, logger=shm.__name__):
        ShmTier("host", ShmTier.Options(path=shm_root), tier_context)
    assert stat.S_IMODE(os.stat(user_dir).st_mode) == 0o700
    assert "0700" in caplog.text


def test_shm_refuses_a_user_directory_it_does_not_own(shm_root, tier_context, monkeypatch):
    os.mkdir(os.path.join(shm_root, tier_context.user), 0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(shm_root).st_uid + 4242)
    with pytest.raises(PermanentTierError, match="belongs to uid"):
        ShmTier("host", ShmTier.Options(path=shm_root), tier_context)


def test_shm_refuses_a_symlinked_user_directory(shm_root, tier_context, tmp_path):
    os.symlink(tmp_path, os.path.join(shm_root, tier_context.user))
    with pytest.raises(PermanentTierError, match="not a directory"):
        ShmTier("host", ShmTier.Options(path=shm_root), tier_context)


def test_shm_capacity_is_checked_before_writing(make_tier, shm_root):
    tier = make_tier("shm", path=shm_root)
    free = tier.free_bytes()
    tier.write_blob("ckpt", [b"old"])
    tight = make_tier("shm", path=shm_root, min_free=free - 8 * MiB, context=tier.context)
    with pytest.raises(CapacityError) as info:
        tight.write_blob("ckpt", (b"z" * (4 * MiB) for _ in range(6)))  # the third chunk does not fit
    msg = str(info.value)
    assert "tier 'shm1'" in msg and "key 'ckpt'" in msg and "needs 4.00 MiB" in msg and "free" in msg
    assert "min_free" in msg and "lower min_free" in msg
    # the filesystem's free space is told apart from the reserve (it read as "only 0 bytes are free" on a tmpfs
    # with gigabytes free): the message gives both
    assert re.search(r"GiB \(\d+ bytes\) free, less min_free \d", msg), msg
    assert host_bytes(tight.read_blob("ckpt")) == b"old"
    assert raw_files(tier.root) == ["ckpt"], "no temporary file left behind"
    with pytest.raises(CapacityError, match="needs 64.00 MiB"):
        tight.allocate_slot("snap/0", 64 * MiB)
    assert not tight.exists("snap/0") or tight.size("snap/0") == 0


def test_shm_slot_is_allocated_up_front(make_tier):
    tier = make_tier("shm")
    slot = tier.allocate_slot("snap/0", 5 * MiB + 123)
    st = os.stat(os.path.join(tier.root, "snap/0"))
    assert st.st_size == slot.numel() == 5 * MiB + 123
    assert st.st_blocks * 512 >= st.st_size, "pages reserved by posix_fallocate, not left sparse"


def test_shm_reads_are_private_zero_copy_mappings(make_tier):
    tier = make_tier("shm")
    tier.write_blob("blob", [b"a" * 10_000])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable buffer" warning from torch
        view = tier.read_blob("blob")
    view[:5] = torch.tensor(list(b"HELLO"), dtype=torch.uint8)  # copy-on-write: the stored blob is untouched
    assert host_bytes(view[:6]) == b"HELLOa"
    assert host_bytes(tier.read_blob("blob")) == b"a" * 10_000


def test_shm_slot_survives_the_tier_and_is_reused_with_its_content(make_tier, shm_root, tier_context):
    first = make_tier("shm", path=shm_root)
    slot = first.allocate_slot("snap/0", 3 * 4096)
    slot.copy_(torch.arange(3 * 4096, dtype=torch.int64).remainder(256).to(torch.uint8))
    expected = host_bytes(slot)
    first.close()
    del slot
    second = make_tier("shm", path=shm_root)  # a restarted process, same run_id
    assert host_bytes(second.read_blob("snap/0")) == expected
    again = second.allocate_slot("snap/0", 4096)  # an existing, larger file: kept, content and all
    assert again.numel() == 3 * 4096 and host_bytes(again) == expected


def test_shm_slot_notices_a_file_replaced_by_another_instance(make_tier, shm_root):
    a = make_tier("shm", path=shm_root)
    b = make_tier("shm", path=shm_root, context=a.context)
    old = a.allocate_slot("snap/0", 8192)
    b.write_blob("snap/0", [b"x" * 10_000])
    new = a.allocate_slot("snap/0", 8192)
    assert new.data_ptr() != old.data_ptr()
    new[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert host_bytes(b.read_blob("snap/0")[:4]) == b"\x01\x02\x03x"


def test_shm_failed_write_leaves_no_temporary_file(make_tier):
    tier = make_tier("shm")
    with pytest.raises(RuntimeError):
        tier.write_blob("a/b", failing_chunks(MiB))
    assert raw_files(tier.root) == []


# ----- local ----------------------------------------------------------------------------------------------
def _record_fsyncs(monkeypatch) -> list[str]:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_local_fsyncs_file_directory_and_new_parents(make_tier, tmp_path, monkeypatch):
    tier = make_tier("local", path=tmp_path / "ckpt")
    synced = _record_fsyncs(monkeypatch)
    tier.write_blob("iter_0000010/mp_rank_00/model_optim_rng.pt", [b"data"])
    root = tier.root
    assert synced[0].startswith(os.path.join(root, "iter_0000010/mp_rank_00/.model_optim_rng.pt.tmp-"))
    assert synced[1:] == [os.path.join(root, "iter_0000010/mp_rank_00"), os.path.join(root, "iter_0000010"),
                          root]
    synced.clear()
    tier.publish("latest_checkpointed_iteration.txt", b"10")
    assert len(synced) == 2 and synced[1] == root


def test_local_without_fsync_does_not_sync(make_tier, tmp_path, monkeypatch):
    tier = make_tier("local", path=tmp_path / "ckpt", fsync=False)
    synced = _record_fsyncs(monkeypatch)
    tier.write_blob("a/b", [b"data"])
    assert synced == []


def test_local_disk_full_is_permanent_and_cleans_up(make_tier, tmp_path, monkeypatch):
    tier = make_tier("local", path=tmp_path / "ckpt")
    tier.write_blob("a/file.pt", [b"old"])

    def enospc(fd, views):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "_write_all", enospc)
    with pytest.raises(PermanentTierError) as info:
        tier.write_blob("a/file.pt", [b"new" * 1000])
    msg = str(info.value)
    assert "disk full" in msg and "tier 'local0'" in msg and "key 'a/file.pt'" in msg and "ENOSPC" in msg
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert raw_files(tier.root) == ["a/file.pt"]
    assert host_bytes(tier.read_blob("a/file.pt")) == b"old"


def test_local_producer_errors_propagate_unchanged(make_tier, tmp_path):
    tier = make_tier("local", path=tmp_path / "ckpt")

    def chunks():
        yield b"x"
        raise OSError(errno.EIO, "the source tier failed")  # not this tier's error: not wrapped

    with pytest.raises(OSError, match="the source tier failed") as info:
        tier.write_blob("a", chunks())
    assert not isinstance(info.value, TierError)
    assert raw_files(tier.root) == []


def test_local_lists_no_temporary_files(make_tier, tmp_path):
    tier = make_tier("local", path=tmp_path / "ckpt")
    tier.write_blob("iter_1/x.pt", [b"x"])
    stale = os.path.join(tier.root, "iter_1", _files.temp_name("y.pt"))
    open(stale, "wb").close()  # left by a crash
    assert _files.is_temp_name(stale) and not _files.is_temp_name("iter_1/x.pt")
    assert not _files.is_temp_name("notes.tmp-file") and not _files.is_temp_name(".hidden")
    assert tier.list() == ["iter_1/x.pt"]
    with pytest.raises(RuntimeError):
        tier.write_blob("iter_1/z.pt", failing_chunks(2 * MiB))
    assert raw_files(tier.root) == sorted(["iter_1/x.pt", os.path.relpath(stale, tier.root)])


def test_local_delete_removes_emptied_directories(make_tier, tmp_path):
    tier = make_tier("local", path=tmp_path / "ckpt")
    tier.write_blob("iter_1/mp_rank_00/a.pt", [b"a"])
    tier.write_blob("iter_2/mp_rank_00/a.pt", [b"a"])
    tier.delete("iter_1/mp_rank_00/a.pt")
    tier.delete_prefix("iter_2")
    assert os.listdir(tier.root) == []
    assert os.path.isdir(tier.root)


def test_local_root_must_be_a_directory(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    # a configuration mistake, named at the tier's path key (the engine places it at tiers[i].path)
    with pytest.raises(ConfigError, match=r"^tier 'nvme'\.path: .*file is a file, not a directory"):
        LocalTier("nvme", LocalTier.Options(path=str(tmp_path / "file")))
    LocalTier("nvme", LocalTier.Options(path=str(tmp_path / "new" / "nested")))
    assert (tmp_path / "new" / "nested").is_dir()


def test_local_reads_into_one_buffer(make_tier, tmp_path):
    tier = make_tier("local", path=tmp_path / "ckpt")
    tier.write_blob("big", [torch.ones(3 * MiB, dtype=torch.uint8)])
    out = tier.read_blob("big")
    assert out.is_contiguous() and out.numel() == 3 * MiB and bool((out == 1).all())
    assert not tier.capabilities.zero_copy_read


# ----- fsspec ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, atomic_rename, survives_process, node_local", [
    ("memory://x/y", False, False, True),
    ("s3://bucket/run", False, True, False),
    ("gs://bucket/run", False, True, False),
    ("file:///shared/ckpt", True, True, False),
    ("/shared/ckpt", True, True, False),
    ("simplecache::s3://bucket/run", False, True, False),
])
def test_fsspec_capabilities_follow_the_store(url, atomic_rename, survives_process, node_local):
    caps = FsspecTier.capabilities_for(FsspecOptions(url=url))
    assert (caps.atomic_rename, caps.survives_process, caps.node_local) == (atomic_rename, survives_process,
                                                                            node_local)
    assert not caps.memory and not caps.zero_copy_read


def test_fsspec_instance_capabilities(make_tier, tmp_path):
    assert make_tier("fsspec", url=f"file://{tmp_path}/r").capabilities.atomic_rename
    assert not make_tier("fsspec", url=f"memory://{uuid.uuid4().hex}/r").capabilities.atomic_rename


@pytest.mark.parametrize("url, match", [("memory://", "names no directory"),
                                        ("nosuchprotocol://x/y", "cannot open"),
                                        # taken for bucket "prefix" until the first save failed (a docs trial)
                                        ("s3:///prefix/only", r"names no bucket .* write s3://BUCKET/prefix")])
def test_fsspec_bad_urls(url, match):
    with pytest.raises(ConfigError, match=match):
        FsspecTier("remote", FsspecOptions(url=url))


def test_fsspec_file_writes_via_a_temporary_name(make_tier, tmp_path):
    tier = make_tier("fsspec", url=f"file://{tmp_path}/root")
    seen = {}

    def chunks():
        yield b"x" * MiB
        seen["raw"] = raw_files(tmp_path / "root")
        yield b"y"

    tier.write_blob("d/blob", chunks())
    (tmp_name,) = seen["raw"]
    assert tmp_name.startswith("d/.blob.tmp-") and _files.is_temp_name(tmp_name)
    assert raw_files(tmp_path / "root") == ["d/blob"]
    with pytest.raises(RuntimeError):
        tier.write_blob("d/other", failing_chunks(MiB))
    assert raw_files(tmp_path / "root") == ["d/blob"]
    tier.delete("d/blob")
    assert os.listdir(tmp_path / "root") == []


def test_fsspec_memory_is_written_in_place_and_committed_at_the_end(make_tier):
    tier = make_tier("fsspec", url=f"memory://{uuid.uuid4().hex}/r")
    seen = {}

    def chunks():
        yield b"x"
        seen["paths"] = list(tier.fs.find(tier.root))
        yield b"y"

    tier.write_blob("k", chunks())
    assert seen["paths"] == []  # no temporary object either
    assert tier.fs.cat_file(f"{tier.root}/k") == b"xy"


def test_fsspec_keys_map_under_the_root(make_tier):
    root = f"memory://{uuid.uuid4().hex}/run"
    tier = make_tier("fsspec", url=root + "/")
    tier.write_blob("iter_1/a.pt", [b"a"])
    fs = tier.fs
    assert fs.cat_file(root + "/iter_1/a.pt") == b"a"
    fs.pipe_file(root + "-sibling/x", b"not ours")  # shares the string prefix, not the directory
    assert tier.list() == ["iter_1/a.pt"]


@pytest.mark.parametrize("exc, expected", [
    (ConnectionResetError("reset by peer"), TransientTierError),
    (TimeoutError("read timed out"), TransientTierError),
    (OSError(errno.EBUSY, "SlowDown"), TransientTierError),
    (OSError(errno.EREMOTEIO, "InternalError"), TransientTierError),
    (PermissionError("AccessDenied"), PermanentTierError),
    (OSError(errno.ENOSPC, "No space left on device"), PermanentTierError),
])
def test_fsspec_error_classification(make_tier, monkeypatch, exc, expected):
    tier = make_tier("fsspec")
    tier.write_blob("k", [b"v"])

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(tier.fs, "info", fail)
    with pytest.raises(expected) as info:
        tier.size("k")
    assert info.value.__cause__ is exc and "tier 'fsspec0'" in str(info.value)


def test_fsspec_other_library_errors_pass_through(make_tier, monkeypatch):
    tier = make_tier("fsspec")

    class BackendError(Exception):
        pass

    def fail(*args, **kwargs):
        raise BackendError("for the retry policy to classify")

    monkeypatch.setattr(tier.fs, "info", fail)
    with pytest.raises(BackendError):
        tier.size("k")


# ----- fsspec on S3 (moto, over HTTP: the s3_server / s3_bucket fixtures of tiered_ckpt.testing) -------------
class TestFsspecS3Contract(TierContract):
    """The S3 transfer path (single PUT, parallel multipart, ranged reads) against s3fs and a moto server."""

    large_blob_bytes = 12 * MiB  # still several 5 MiB multipart parts
    publish_rounds = 10

    @pytest.fixture
    def tier(self, make_tier, s3_server, s3_bucket):
        tier = make_tier("fsspec", url=f"s3://{s3_bucket}/{uuid.uuid4().hex}",
                         options=s3_server.storage_options(), part_size="5MiB", max_concurrency=2)
        yield tier
        uploads = s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        assert uploads == [], "an aborted upload was left behind"


class TestFsspecS3SplitContract(TierContract):
    """The same contract with ``split_blobs``, every blob written the way the engine writes its own files
    (``write_private_blob``): pieces and the key's object in place of a multipart upload."""

    large_blob_bytes = 12 * MiB
    publish_rounds = 10

    @pytest.fixture
    def tier(self, make_tier, s3_server, s3_bucket):
        prefix = uuid.uuid4().hex
        tier = make_tier("fsspec", url=f"s3://{s3_bucket}/{prefix}", options=s3_server.storage_options(),
                         part_size="5MiB", max_concurrency=2, split_blobs=True)
        tier.write_blob = tier.write_private_blob  # the contract writes with write_blob
        yield tier
        client = s3_server.client()
        assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix).get("Contents", [])]
        listed = {f"{prefix}/{k}" for k in tier.list()}
        assert [k for k in keys if k not in listed and not _s3_split.is_piece_name(k)] == []
        orphans = [k for k in keys if _s3_split.is_piece_name(k) and k.split(_s3_split.PIECE_MARK)[0] not in listed]
        assert orphans == [], "pieces left behind without their blob"


# ----- shared helpers -------------------------------------------------------------------------------------
def test_as_memoryview_rejects_non_contiguous_buffers():
    import numpy as np

    with pytest.raises(ValueError, match="C-contiguous"):
        as_memoryview(np.arange(16, dtype=np.float32).reshape(4, 4)[:, 1])
    assert len(as_memoryview(torch.tensor(3.0))) == 4  # a 0-d tensor is 4 bytes, not an error


def test_tier_context_is_threadsafe_to_share(make_tier, tier_context):
    tier = make_tier("shm", context=tier_context)
    barrier = threading.Barrier(4)
    sizes = []

    def slot(i):
        barrier.wait()
        sizes.append(tier.allocate_slot(f"snap/{i}", 4096 * (i + 1)).numel())

    threads = [threading.Thread(target=slot, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(sizes) == [4096, 8192, 12288, 16384]
    assert isinstance(tier.context, TierContext)


def test_make_tier_defaults_to_throwaway_locations(make_tier, shm_root, tmp_path):
    assert make_tier("shm").root.startswith(shm_root)
    assert make_tier("local").root.startswith(str(tmp_path))
    remote = make_tier("fsspec")
    assert remote.options.url.startswith("memory://") and remote.list() == []
    assert make_tier("gpu").device.type in ("cpu", "cuda")
    with pytest.raises(ConfigError, match=r"make_tier\('local'\)\.fsync: expected true or false"):
        make_tier("local", fsync="no")


@pytest.mark.parametrize("size", ["big", None, -1])
def test_fsspec_a_store_answer_without_a_byte_count_is_a_corruption_error(make_tier, monkeypatch, size):
    tier = make_tier("fsspec")
    tier.write_blob("k", [b"v"])
    monkeypatch.setattr(tier.fs, "info", lambda path, **kw: {"name": path, "type": "file", "size": size})
    for read in (tier.size, tier.read_blob, lambda k: tier.read_range(k, 0, 1)):
        with pytest.raises(CorruptionError, match="the store gives no byte count"):
            read("k")


def test_a_local_tier_made_under_a_missing_directory_says_it_may_be_an_unmounted_mount(tmp_path, caplog):
    """A review: a checkpoint path under a mount point that is not mounted was created on the disk below, every
    missing parent with it, and load() said "no checkpoint": the job would start over. The tier says so."""
    import logging

    from tiered_ckpt.tiers.local import LocalOptions, LocalTier

    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        LocalTier("ssd", LocalOptions(path=str(tmp_path / "mnt" / "nvme" / "ckpt")))
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and f"{tmp_path / 'mnt'} should be a mounted file system" in said[0], said
        caplog.clear()
        LocalTier("ssd", LocalOptions(path=str(tmp_path / "mnt" / "nvme" / "ckpt")))  # there now: nothing to say
        LocalTier("new", LocalOptions(path=str(tmp_path / "fresh")))  # only the directory itself is new: normal
        assert not caplog.records


def test_an_fsspec_file_tier_made_under_a_missing_directory_says_so_at_its_first_write(tmp_path, caplog):
    """The same for a file:// tier (a network file system mounted there, say), whose directory is made at its
    first write: it was made, parents and all, without a word."""
    import logging

    from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier

    tier = FsspecTier("nfs", FsspecOptions(url=f"file://{tmp_path / 'mnt' / 'nfs' / 'ckpt'}"))
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        tier.write_blob("a", [b"x"])
        tier.write_blob("b", [b"y"])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"{tmp_path / 'mnt'} should be a mounted file system" in said[0], said


def test_a_store_error_without_a_message_says_what_it_was():
    """An S3 user's trial: a stalled upload ended in "TimeoutError: " and nothing after it."""
    import asyncio

    from tiered_ckpt.errors import TransientTierError

    tier = FsspecTier("remote", FsspecOptions(url="memory://tc-exc/run"))
    err = tier._tier_exception(asyncio.TimeoutError(), "k", "upload", "tc-exc/run/k")
    assert isinstance(err, TransientTierError) and str(err).endswith("TimeoutError: no answer within the timeout")
    err = tier._tier_exception(ConnectionResetError(), "k", "upload", "tc-exc/run/k")
    assert str(err).endswith("ConnectionResetError: no detail given")
