"""The streamed torch.save writer (byte-identical to torch.save) and the range-reading lazy loader."""

from __future__ import annotations

import argparse
import io
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from megatron_fixtures import all_dirs, distrib_optim_path, model_path

from tiered_ckpt.errors import DecodeError, UnsafePickleError
from tiered_ckpt.megatron import safe_load, torch_zip
from tiered_ckpt.megatron.lazy_torch import materialize, open_lazy
from tiered_ckpt.megatron.torch_zip import StreamedTensor, iter_torch_save
from tiered_ckpt.tiers.local import LocalOptions, LocalTier


def saved(obj, archive: str = "archive") -> bytes:
    return b"".join(bytes(c) for c in iter_torch_save(obj, archive=archive))


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize(("config", "subdir"), all_dirs())
def test_megatron_files_are_rewritten_byte_for_byte(config: str, subdir: str) -> None:
    """Megatron's own files, loaded and written again by the streaming writer: the same bytes (zip layout,
    pickle memoization, storage sharing, CRCs, serialization id)."""
    for path, archive in ((distrib_optim_path(config, subdir), "distrib_optim"),
                          (model_path(config, subdir), "model_optim_rng")):
        assert saved(safe_load.load(path), archive) == path.read_bytes(), path.name


def test_streamed_tensors_give_the_same_bytes_as_real_ones() -> None:
    t = torch.arange(10_000, dtype=torch.float32)
    real = {"w": t, "b": [t[:10].clone().to(torch.bfloat16)], 0: {(torch.float32, torch.float32): {"n": 3}}}
    streamed = {"w": StreamedTensor(torch.float32, (10_000,), lambda: (t[i:i + 999] for i in range(0, 10_000, 999))),
                "b": [StreamedTensor(torch.bfloat16, (10,), lambda: [t[:10].to(torch.bfloat16)])],
                0: {(torch.float32, torch.float32): {"n": 3}}}
    assert saved(streamed) == saved(real) == torch_saved(real)


@pytest.mark.parametrize("n", [0, 1, 9, 10, 24, 40, 130])
def test_serialization_id_matches_torch_for_many_records(n: int) -> None:
    obj = [torch.full((2,), float(i)) for i in range(n)]
    assert saved(obj) == torch_saved(obj)


def test_odd_objects_match_torch() -> None:
    od: OrderedDict = OrderedDict(a=torch.ones(2, 3).t(), b=None)
    od._metadata = {"": {"version": 1}}  # what nn.Module state dicts carry
    base = torch.arange(12.0)
    obj = {"od": od, "views": [base[2:5], base[4:]], "empty": torch.zeros(0, 4), "ns": argparse.Namespace(x=1),
           "scalar": torch.tensor(3, dtype=torch.int64), "shared": (base, base),
           "dtypes": [torch.bfloat16, torch.uint8]}
    assert saved(obj) == torch_saved(obj)


UNTYPED_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", UNTYPED_DTYPES, ids=str)
def test_dtypes_without_a_typed_storage_match_torch(dtype: torch.dtype) -> None:
    """Found by a new-user trial: FP8 and unsigned 16-64 bit tensors were a PicklingError in the drain (torch.save
    writes them as an UntypedStorage counted in bytes, rebuilt with _rebuild_tensor_v3 and the dtype)."""
    base = torch.arange(24, dtype=torch.float32).to(dtype) if dtype.is_floating_point else \
        torch.arange(24).to(dtype)
    streamed = StreamedTensor(dtype, (24,), lambda: [base])
    obj = {"w": base.view(4, 6), "view": base[3:9], "t": base.view(4, 6).t(), "s": streamed}
    real = {**obj, "s": base.clone()}
    assert saved(obj) == torch_saved(real)
    back = torch.load(io.BytesIO(saved(obj)), weights_only=True)
    assert back["w"].dtype == dtype and torch.equal(back["w"].view(torch.uint8), base.view(4, 6).view(torch.uint8))
    assert torch.equal(back["view"].view(torch.uint8), base[3:9].view(torch.uint8))


def test_wrong_sizes_are_refused() -> None:
    short = {"w": StreamedTensor(torch.float32, (4,), lambda: [torch.zeros(3)])}
    with pytest.raises(ValueError, match="12 bytes produced, 16 announced"):
        saved(short)
    long = {"w": StreamedTensor(torch.float32, (2,), lambda: [torch.zeros(3)])}
    with pytest.raises(ValueError, match="more than the announced 8 bytes"):
        saved(long)


def test_zip64_records_read_back_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records and offsets past 4 GiB use zip64 extra fields; checked by lowering the threshold."""
    monkeypatch.setattr(torch_zip, "ZIP64_FROM", 100)
    obj = {"a": torch.arange(1000, dtype=torch.float32), "b": [torch.ones(3, dtype=torch.bfloat16)],
           "c": torch.arange(50)}
    data = saved(obj)
    z = zipfile.ZipFile(io.BytesIO(data))
    assert z.testzip() is None  # CRCs and sizes as Python's zipfile reads them
    (tmp_path / "x.pt").write_bytes(data)
    for kw in ({}, {"mmap": True}):
        back = torch.load(tmp_path / "x.pt", weights_only=True, **kw)
        assert torch.equal(back["a"], obj["a"]) and torch.equal(back["c"], obj["c"])
    lazy = open_lazy(LocalTier("t", LocalOptions(path=str(tmp_path))), "x.pt").obj
    assert torch.equal(lazy["a"][990:1000], obj["a"][990:]) and torch.equal(lazy["b"][0].load(), obj["b"][0])


def test_lazy_reads_only_the_pickle_and_the_slices(tmp_path: Path) -> None:
    t = torch.randn(1 << 20)
    (tmp_path / "f.pt").write_bytes(saved({"big": t, "small": torch.arange(6).view(2, 3).t(), "args": {"lr": 0.1}}))
    f = open_lazy(LocalTier("t", LocalOptions(path=str(tmp_path))), "f.pt")
    assert f.reader.bytes_read < 70_000 and f.obj["args"] == {"lr": 0.1}
    big = f.obj["big"]
    assert (big.dtype, tuple(big.shape), big.numel(), big.dim()) == (torch.float32, (1 << 20,), 1 << 20, 1)
    before = f.reader.bytes_read
    assert torch.equal(big[1000:1010], t[1000:1010]) and torch.equal(big[-3:], t[-3:])
    assert f.reader.bytes_read - before < 200
    small = f.obj["small"]  # a non-contiguous view: loadable, not sliceable
    assert torch.equal(small.load(), torch.arange(6).view(2, 3).t())
    with pytest.raises(DecodeError, match="not contiguous"):
        small[0:1]
    assert torch.equal(materialize(f.obj)["big"], t)


def test_a_lazy_copy_reads_its_ranges_several_at_once_into_the_right_places(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket's shard copied out of a file on an object store was read one range at a time (a reshard from S3
    at one request's speed). Now up to READ_AHEAD ranges are in flight; each lands at its own place, and every
    byte is read once."""
    import threading
    import time
    import warnings

    from tiered_ckpt.megatron import lazy_torch

    monkeypatch.setattr(lazy_torch, "READ_PIECE", 4096)
    t = torch.randn(10_000)  # ten ranges of 4 KiB
    (tmp_path / "f.pt").write_bytes(saved({"t": t}))
    tier = LocalTier("t", LocalOptions(path=str(tmp_path)))
    in_flight, most = 0, 0
    lock = threading.Lock()
    read_range = tier.read_range

    def slow_read_range(key: str, offset: int, length: int) -> bytes:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.05)  # a request's round trip
        try:
            return read_range(key, offset, length)
        finally:
            with lock:
                in_flight -= 1

    monkeypatch.setattr(tier, "read_range", slow_read_range)
    f = open_lazy(tier, "f.pt")
    assert torch.equal(f.obj["t"][0:1], t[0:1])  # the record's place is found (its local header read)
    before, most = f.reader.bytes_read, 0
    out = torch.empty(9_000)
    filters = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the threads (torch's "buffer is not writable", say)
        lazy_torch.copy_range(out, f.obj["t"], 500, 9_500)
        wider = torch.empty(9_000, dtype=torch.float64)
        lazy_torch.copy_range(wider, f.obj["t"], 500, 9_500)  # a cast on the way
    assert warnings.filters == filters  # the threads never touch the process's warning filters
    assert torch.equal(out, t[500:9_500]) and torch.equal(wider, t[500:9_500].double())
    assert f.reader.bytes_read - before == 2 * 9_000 * 4
    assert most == lazy_torch.READ_AHEAD


def test_a_lazy_copy_from_a_tier_that_reads_ranges_as_whole_blobs_reads_one_range_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin kind may keep Tier's fallback read_range, which reads the whole blob for each range: several of
    them at once would hold several whole files (a distrib_optim.pt of many GB). Such a tier gets one at a time."""
    import threading

    from tiered_ckpt.megatron import lazy_torch
    from tiered_ckpt.tiers.base import Tier

    class WholeBlobTier(LocalTier):
        read_range = Tier.read_range

    monkeypatch.setattr(lazy_torch, "READ_PIECE", 4096)
    t = torch.randn(10_000)
    (tmp_path / "f.pt").write_bytes(saved({"t": t}))
    tier = WholeBlobTier("t", LocalOptions(path=str(tmp_path)))
    in_flight, most = 0, 0
    lock = threading.Lock()

    def counted(key: str, offset: int, length: int) -> bytes:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        try:
            return Tier.read_range(tier, key, offset, length)
        finally:
            with lock:
                in_flight -= 1

    monkeypatch.setattr(tier, "read_range", counted)
    f = open_lazy(tier, "f.pt")
    out = torch.empty(9_000)
    lazy_torch.copy_range(out, f.obj["t"], 500, 9_500)
    assert torch.equal(out, t[500:9_500]) and most == 1


def test_lazy_refuses_garbage_and_unsafe_pickles(tmp_path: Path) -> None:
    tier = LocalTier("t", LocalOptions(path=str(tmp_path)))
    (tmp_path / "junk.pt").write_bytes(b"hello" * 100)
    with pytest.raises(DecodeError, match="junk.pt"):
        open_lazy(tier, "junk.pt")
    buf = io.BytesIO()
    torch.save({"f": print}, buf)
    (tmp_path / "evil.pt").write_bytes(buf.getvalue())
    with pytest.raises(UnsafePickleError, match="refusing to unpickle builtins.print"):
        open_lazy(tier, "evil.pt")
