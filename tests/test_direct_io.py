"""The local tier's O_DIRECT write path (tiered_ckpt.tiers._direct_io) and its fallbacks."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.codecs.file_codecs import DATA_ALIGN, FlatFileCodec
from tiered_ckpt.errors import PermanentTierError
from tiered_ckpt.memory_store import ITEM_ALIGN, plan_items
from tiered_ckpt.testing.contract import host_bytes, raw_files
from tiered_ckpt.tiers import _direct_io
from tiered_ckpt.tiers._direct_io import BLOCK, BOUNCE, DirectWriter
from tiered_ckpt.tiers.base import StableChunks, StableStream


def _takes_o_direct(directory) -> bool:
    path = os.path.join(directory, ".probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)
    os.close(fd)
    return True


@pytest.fixture
def direct_dir(tmp_path):
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT (the fallback tests below still run)")
    return tmp_path


def _aligned(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    m = mmap.mmap(-1, max(nbytes, 1))
    return m, memoryview(m)[:nbytes]


def _pattern(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def _write_direct(path, pieces, stable: bool = False) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        w = DirectWriter(fd, stable=stable)
        try:
            for p in pieces:
                w.write(memoryview(p))
            w.finish()
        finally:
            w.close()
        return w.pos
    finally:
        os.close(fd)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * BOUNCE // 2), min_size=1, max_size=6), aligned=st.lists(st.booleans(),
       min_size=6, max_size=6), seed=st.integers(0, 1000), stable=st.booleans())
def test_any_stream_round_trips(tmp_path_factory, sizes, aligned, seed, stable):
    directory = tmp_path_factory.mktemp("direct")
    if not _takes_o_direct(directory):
        pytest.skip("no O_DIRECT here")
    keep, pieces = [], []
    for i, (n, al) in enumerate(zip(sizes, aligned, strict=False)):
        data = _pattern(n, seed + i)
        if al:  # a page-aligned source (the zero-copy path when the file offset is aligned too)
            m, mv = _aligned(n)
            mv[:] = data
            keep.append(m)
            pieces.append(mv)
        else:
            pieces.append(data)
    path = directory / "f"
    written = _write_direct(path, pieces, stable)
    expect = b"".join(bytes(p) for p in pieces)
    assert written == len(expect)
    assert path.read_bytes() == expect  # exact size: the tail was not padded


def test_aligned_bulk_is_written_without_the_bounce_buffer(direct_dir, monkeypatch):
    m, mv = _aligned(8 * BLOCK + (3 << 20))
    mv[:] = _pattern(len(mv), 1)
    calls = []
    real = os.pwrite

    def pwrite(fd, data, pos):
        calls.append((len(data), pos))
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    path = direct_dir / "f"
    _write_direct(path, [b"h" * BLOCK, mv])
    assert path.read_bytes() == b"h" * BLOCK + bytes(mv)
    # the header block, then the whole aligned piece in one write straight from its buffer
    assert calls == [(BLOCK, 0), (len(mv), BLOCK)]


def test_a_stable_stream_s_piece_is_left_writing_while_the_next_is_made(direct_dir, monkeypatch):
    """With stable memory, write() returns while the piece it was given is still being written (the disk stays
    busy while the caller makes the next one); finish() waits for it. Without, write() waits for it."""
    m, mv = _aligned(4 * BOUNCE)
    mv[:] = _pattern(len(mv), 5)
    real = os.pwrite
    release = threading.Event()
    started = threading.Event()

    def pwrite(fd, data, pos):
        if len(data) >= BOUNCE:
            started.set()
            assert release.wait(10)
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    fd = os.open(direct_dir / "f", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        w = DirectWriter(fd, stable=True)
        w.write(mv)  # returns with the piece's write still blocked
        assert started.wait(10) and not release.is_set()
        done = threading.Event()
        finisher = threading.Thread(target=lambda: (w.finish(), done.set()))
        finisher.start()
        assert not done.wait(0.2)  # finish() waits for the running write
        release.set()
        finisher.join(10)
        assert done.is_set()
    finally:
        os.close(fd)
    assert (direct_dir / "f").read_bytes() == bytes(mv)

    release.clear()
    started.clear()
    fd = os.open(direct_dir / "g", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        w = DirectWriter(fd)  # not stable: the caller may reuse its buffer once write() returns
        writer = threading.Thread(target=w.write, args=(mv,))
        writer.start()
        assert started.wait(10)
        writer.join(0.2)
        assert writer.is_alive()  # still inside write(), waiting for its own piece
        release.set()
        writer.join(10)
        w.finish()
    finally:
        os.close(fd)
    assert (direct_dir / "g").read_bytes() == bytes(mv)


def test_a_stable_write_failing_on_the_helper_fails_the_file(direct_dir, make_tier, monkeypatch):
    """An error of a write left running reaches the caller (at the next piece or at finish), as a tier error
    naming the key, and the old file stays."""
    tier = make_tier("local", path=direct_dir / "ckpt")
    tier.write_blob("a/file.flat", [b"old"])
    m, mv = _aligned(4 * BOUNCE)
    mv[:] = _pattern(len(mv), 6)
    real = os.pwrite

    def pwrite(fd, data, pos):
        if len(data) >= BOUNCE and threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(PermanentTierError, match="disk full") as info:
        tier.write_blob("a/file.flat", StableChunks([b"h" * BLOCK, mv]))
    monkeypatch.undo()
    assert "key 'a/file.flat'" in str(info.value)
    assert raw_files(tier.root) == ["a/file.flat"]
    assert host_bytes(tier.read_blob("a/file.flat")) == b"old"


def test_open_refused_falls_back_to_buffered(tmp_path, make_tier, monkeypatch, caplog):
    tier = make_tier("local", path=tmp_path / "ckpt")
    assert tier.files.direct_io
    real = os.open

    def open_(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            fd = real(path, flags & ~os.O_DIRECT, mode)  # as some filesystems do: create, then refuse
            os.close(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", open_)
    data = _pattern(3 << 20, 2)
    with caplog.at_level("INFO"):
        tier.write_blob("a/b.bin", iter([data[:12345], data[12345:]]))
    monkeypatch.undo()
    assert not tier.files.direct_io
    assert "does not take O_DIRECT" in caplog.text
    assert host_bytes(tier.read_blob("a/b.bin")) == data
    assert raw_files(tier.root) == ["a/b.bin"]  # no temporary file left by the refused open


@pytest.mark.parametrize("stable", [False, True])
def test_write_refused_midway_finishes_buffered(direct_dir, monkeypatch, stable):
    real = os.pwrite
    refused = []

    def pwrite(fd, data, pos):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and pos + len(data) > BOUNCE:
            refused.append(pos)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    data = _pattern(3 * BOUNCE + 1000, 3)
    m, mv = _aligned(len(data))
    mv = mv[100:]  # congruent with its file offset: written in place (on the helper when stable)
    mv[:] = data[100:]
    path = direct_dir / "f"
    _write_direct(path, [data[:100], mv, mv[:0]], stable)
    assert refused and path.read_bytes() == data


def test_disk_full_in_the_helper_thread_is_permanent_and_cleans_up(direct_dir, make_tier, monkeypatch):
    tier = make_tier("local", path=direct_dir / "ckpt")
    tier.write_blob("a/file.pt", [b"old"])
    real = os.pwrite

    def pwrite(fd, data, pos):
        if pos >= BOUNCE:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(PermanentTierError, match="disk full") as info:
        tier.write_blob("a/file.pt", iter([_pattern(4 * BOUNCE, 4)]))
    monkeypatch.undo()
    assert "key 'a/file.pt'" in str(info.value)
    assert raw_files(tier.root) == ["a/file.pt"]
    assert host_bytes(tier.read_blob("a/file.pt")) == b"old"


def test_small_lists_go_through_the_page_cache(direct_dir, make_tier, monkeypatch):
    tier = make_tier("local", path=direct_dir / "ckpt")
    seen = []
    real = _direct_io.DirectWriter.write
    monkeypatch.setattr(_direct_io.DirectWriter, "write", lambda self, mv: (seen.append(len(mv)), real(self, mv)))
    tier.publish("latest_checkpointed_iteration.txt", b"10")
    assert seen == [] and host_bytes(tier.read_blob("latest_checkpointed_iteration.txt")) == b"10"


@pytest.mark.parametrize("setting, expect", [("auto", True), (False, False), (True, True)])
def test_direct_io_option(tmp_path, make_tier, setting, expect):
    tier = make_tier("local", path=tmp_path / "ckpt", direct_io=setting)
    assert tier.files.direct_io is expect
    assert ("O_DIRECT" in tier.describe()) is expect


def test_auto_is_off_without_fsync(tmp_path, make_tier):
    assert not make_tier("local", path=tmp_path / "ckpt", fsync=False).files.direct_io


def test_flat_files_put_the_data_on_a_page_boundary_and_slot_items_on_pages(tmp_path, shm_root):
    items = {"a": {"w": torch.arange(1000, dtype=torch.float32)}, "b": {"v": torch.ones(7, dtype=torch.bfloat16)}}
    placed, _ = plan_items(items)
    assert all(off % ITEM_ALIGN == 0 for _, _, off in placed)
    cfg = {"run_id": "direct", "layout": "rank_sharded", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root), "slots": 1},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "local")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(5, items).wait(timeout=60)
    files = [p for p in (tmp_path / "local").rglob("*.flat")]
    assert len(files) == 2
    for path in files:
        blob = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        header, data = FlatFileCodec.split(blob, str(path))
        assert (blob.numel() - data.numel()) % DATA_ALIGN == 0
    with CheckpointEngine({**cfg, "tiers": cfg["tiers"][1:]}) as engine:
        got = engine.load(copy=True).items
    assert torch.equal(got["a"]["w"], items["a"]["w"]) and torch.equal(got["b"]["v"], items["b"]["v"])


def test_flat_files_with_the_old_64_byte_alignment_still_decode():
    from tiered_ckpt.codecs import flat
    from tiered_ckpt.codecs.file_codecs import _PREFIX, ALIGN, FLAT_MAGIC

    value = {"w": torch.arange(10, dtype=torch.int64)}
    plan = flat.plan_snapshot(value)
    header = flat.encode_header(plan)
    buf = torch.empty(plan.total_bytes, dtype=torch.uint8)
    flat.copy_into(plan, buf)
    head = _PREFIX.pack(FLAT_MAGIC, len(header)) + header
    blob = head + b"\0" * ((-len(head)) % ALIGN) + host_bytes(buf)
    got = FlatFileCodec().decode(torch.frombuffer(bytearray(blob), dtype=torch.uint8), where="old.flat")
    assert torch.equal(got["w"], value["w"])


def test_a_producer_failing_waits_for_the_writes_still_running_from_its_memory(direct_dir, make_tier, monkeypatch):
    """A stable producer that raises while a write from its memory still runs: write_blob raises its error only
    once that write has returned (the memory may be released right after), and leaves no file."""
    tier = make_tier("local", path=direct_dir / "ckpt")
    m, mv = _aligned(4 * BOUNCE)
    mv[:] = _pattern(len(mv), 7)
    real = os.pwrite
    running = threading.Event()
    returned = []

    def pwrite(fd, data, pos):
        if len(data) >= BOUNCE:
            running.set()
            time.sleep(0.3)
            try:
                return real(fd, data, pos)
            finally:
                returned.append(time.monotonic())
        return real(fd, data, pos)

    def chunks():
        yield mv
        assert running.wait(10)
        raise RuntimeError("the producer broke")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(RuntimeError, match="the producer broke"):
        tier.write_blob("a/file.flat", StableStream(chunks()))
    failed_at = time.monotonic()
    monkeypatch.undo()
    assert returned and returned[0] <= failed_at
    assert raw_files(tier.root) == []


def test_a_failed_running_write_is_reported_at_the_next_piece(direct_dir, monkeypatch):
    """The error of a write left running reaches the caller at its next write() once it is known, not only at
    finish(): the producer stops making pieces that would be thrown away."""
    m, mv = _aligned(4 * BOUNCE)
    real = os.pwrite

    def pwrite(fd, data, pos):
        if len(data) >= BOUNCE:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    fd = os.open(direct_dir / "f", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        w = DirectWriter(fd, stable=True)
        try:
            w.write(mv[:2 * BOUNCE])
            for _ in range(200):  # let the helper fail
                if w._running[0].done():
                    break
                time.sleep(0.01)
            with pytest.raises(OSError, match="Input/output error"):
                w.write(memoryview(b"x" * 100))
        finally:
            w.close()
    finally:
        os.close(fd)


def test_two_running_writes_refused_at_once_both_finish_buffered(direct_dir, monkeypatch):
    """Two writes from stable memory refused with EINVAL at the same time, on the two threads: the descriptor is
    switched to the page cache once and both are written again through it."""
    data = _pattern(4 * BOUNCE, 8)
    m, mv = _aligned(len(data))
    mv[:] = data
    real = os.pwrite
    barrier = threading.Barrier(2, timeout=10)
    refused = []

    def pwrite(fd, piece, pos):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and len(piece) >= BOUNCE:
            barrier.wait()  # both in flight before either is refused
            refused.append(pos)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, piece, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    path = direct_dir / "f"
    _write_direct(path, [mv[:2 * BOUNCE], mv[2 * BOUNCE:]], stable=True)
    assert sorted(refused) == [0, 2 * BOUNCE] and path.read_bytes() == data


def test_the_torch_codec_s_stream_is_stable_and_written_with_writes_left_running(tmp_path, shm_root, monkeypatch):
    """An item saved in the torch codec (Megatron's files) reaches the local tier as a stable stream through the
    drain's wrappers, its tensors are written from the slot with writes left running, and torch.load reads it."""
    if not _takes_o_direct(tmp_path):
        pytest.skip("no O_DIRECT here")
    seen = []
    real_init = DirectWriter.__init__

    def init(self, fd, start=0, *, stable=False):
        seen.append(stable)
        real_init(self, fd, start, stable=stable)

    monkeypatch.setattr(DirectWriter, "__init__", init)
    state = {"w": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(7), "step": 3}
    cfg = {"run_id": "torch-stable", "layout": "megatron", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "ckpt")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"model_optim_rng": state}).wait(timeout=60)
    assert True in seen
    files = list((tmp_path / "ckpt").rglob("model_optim_rng.pt"))
    assert len(files) == 1
    loaded = torch.load(files[0], weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["step"] == 3


def test_a_streamed_tensor_is_refused_where_the_torch_stream_is_promised_stable():
    from tiered_ckpt.errors import EncodeError
    from tiered_ckpt.megatron.torch_zip import StreamedTensor, iter_torch_save

    reused = bytearray(16)
    obj = {"t": StreamedTensor(torch.uint8, (16,), lambda: [reused])}
    assert len(b"".join(bytes(c) for c in iter_torch_save(obj))) > 16  # allowed where nothing is promised
    with pytest.raises(EncodeError, match="promised stable"):
        next(iter(iter_torch_save(obj, tensors_only=True)))


@pytest.mark.parametrize("entry", ["shm", "staging"])
def test_the_megatron_layout_places_optimizer_shards_so_their_ranges_are_written_from_the_slot(
        tmp_path, shm_root, monkeypatch, entry):
    """With the megatron layout on a local tier, the snapshot places each optimizer shard in the slot congruent,
    modulo a page, with its offset in Megatron's ``distrib_optim.pt``: the positional writer sends every whole
    page of the rank's ranges from the slot (none through a bounce buffer), and the file is Megatron's own. The
    same where the local tier comes first (the hidden staging tier's slots in this process's memory)."""
    if not _takes_o_direct(tmp_path):
        pytest.skip("no O_DIRECT here")
    from megatron_synthetic import SyntheticJob, spec_for_bytes, write_checkpoint

    from tiered_ckpt.tiers import _positional

    sent = {"bounced": [], "from_slot": 0}

    class Counting(DirectWriter):
        def _copy(self, mv):
            if len(mv):
                sent["bounced"].append(len(mv))
            super()._copy(mv)

        def _write_in_place(self, mv):
            sent["from_slot"] += len(mv)
            super()._write_in_place(mv)

    monkeypatch.setattr(_positional, "DirectWriter", Counting)
    job = SyntheticJob(spec=spec_for_bytes(48 << 20, ddp_bucket_size=1_500_000), dp=1)
    items = job.rank_items(0)
    disk = {"name": "disk", "kind": "local", "path": str(tmp_path / "ckpt")}
    cfg = {"run_id": "placed", "layout": "megatron", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}, disk] if entry == "shm" else [disk]}
    with CheckpointEngine(cfg) as engine:
        engine.prepare(items)
        for step in (job.iteration, job.iteration + 1):  # the second save reuses the first one's placement
            sent["bounced"], sent["from_slot"] = [], 0
            engine.save(step, items).wait(timeout=60)
            # only a range's last pages, too few for a write of their own, may go through a bounce buffer
            assert sent["bounced"] and max(sent["bounced"]) < _direct_io._ZERO_COPY_MIN, sent["bounced"]
            assert sent["from_slot"] > 20 << 20
    reference = tmp_path / "reference"
    write_checkpoint(job, str(reference), layout="megatron", manifest=False)
    name = f"iter_{job.iteration:07d}/mp_rank_00/distrib_optim.pt"
    assert (tmp_path / "ckpt" / name).read_bytes() == (reference / name).read_bytes()
