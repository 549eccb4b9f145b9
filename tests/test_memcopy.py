"""All-core host copies (memcopy.py): the save's copy_into, the load's copies, fresh memory; the pool after a fork."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import uuid

import pytest
import torch

from tiered_ckpt import CheckpointEngine, memcopy
from tiered_ckpt import checksum as checksum_mod
from tiered_ckpt import load_into as load_into_mod
from tiered_ckpt.checksum import snapshot_checksum
from tiered_ckpt.codecs.flat import copy_into, decode_header, encode_header, plan_snapshot, restore
from tiered_ckpt.load_into import copy_out, copy_out_verified, copy_pairs, copy_verified


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def split_small(request, monkeypatch):
    """Copies split over ``param`` threads even when tiny, in pieces whose edges fall inside tensors."""
    monkeypatch.setattr(memcopy, "SPLIT_MIN", 0)
    monkeypatch.setattr(memcopy, "PIECE_MIN", 1)
    monkeypatch.setattr(memcopy, "threads", lambda: request.param)
    return request.param


def _odd_state() -> dict:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 33, generator=g)
    return {
        "f32": torch.randn(1001, generator=g),
        "f64": torch.randn(3, 5, dtype=torch.float64, generator=g),
        "bf16": torch.randn(77, generator=g).to(torch.bfloat16),
        "f16": torch.randn(13, generator=g).half(),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "i64": torch.randint(0, 1 << 50, (11,), generator=g),
        "bool": torch.rand(17, generator=g) > 0.5,
        "c64": torch.randn(6, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "offset_view": base[5:9],  # contiguous, at a storage offset
        "transposed": base.t(),  # not contiguous: copy_
        "strided": base[:, ::3],  # not contiguous: copy_
        "conj": torch.randn(4, dtype=torch.complex64, generator=g).conj(),  # its bytes are not its values
        "neg": torch.randn(4, dtype=torch.complex64, generator=g).conj().imag,  # a negative view
        "param": torch.nn.Parameter(torch.randn(5, 7, generator=g)),
        "tiny": [torch.full((1,), float(i)) for i in range(300)],
        "bytes": b"\x01\x02" * 3000,
        "step": 12,
    }


def _assert_tree_equal(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.detach().resolve_conj().resolve_neg(), b.detach().resolve_conj().resolve_neg()), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_tree_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("lead", [0, 64, 4096], ids=["at-0", "at-64", "at-4096"])
def test_copy_into_moves_the_exact_bytes_of_every_kind_of_source(split_small, lead):
    state = _odd_state()
    plan = plan_snapshot(state)
    store = torch.full((lead + plan.total_bytes + 64,), 0xAB, dtype=torch.uint8)
    dest = store[lead:lead + plan.total_bytes]
    copy_into(plan, dest)
    _assert_tree_equal(state, restore(decode_header(encode_header(plan)), dest, copy=True))
    assert bool((store[:lead] == 0xAB).all()) and bool((store[lead + plan.total_bytes:] == 0xAB).all())
    # again into the same destination (cached copies), after the sources changed in place
    state["f32"].add_(1)
    state["tiny"][7].fill_(-1)
    copy_into(plan, dest)
    _assert_tree_equal(state, restore(decode_header(encode_header(plan)), dest, copy=True))


def test_copy_into_of_a_large_tensor_on_several_threads_is_exact(monkeypatch):
    monkeypatch.setattr(memcopy, "threads", lambda: 4)
    t = torch.randint(0, 255, (memcopy.SPLIT_MIN * 3 + 12345,), dtype=torch.uint8)
    plan = plan_snapshot({"t": t, "u": t[1:]})  # an odd length at an odd source address
    dest = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, dest)
    out = restore(decode_header(encode_header(plan)), dest, copy=True)
    assert torch.equal(out["t"], t) and torch.equal(out["u"], t[1:])


def test_pieces_gather_spans_in_order_into_equal_pieces():
    spans = [(1000, 5000, 7), (2000, 6000, 0), (3000, 7000, 10), (4000, 8000, 3)]
    cut = memcopy.pieces(spans, 4)
    assert [sum(n for _, _, n in p) for p in cut] == [4, 4, 4, 4, 4]
    assert cut[1] == [(1004, 5004, 3), (3000, 7000, 1)]  # a span's end and the next one's start share a piece
    flat = [(d + i, s + i) for p in cut for d, s, n in p for i in range(n)]
    assert flat == [(d + i, s + i) for d, s, n in spans for i in range(n)]
    assert memcopy.pieces([(1, 2, 0)], 4) == []
    assert len(memcopy.pieces([(0, 0, 1)] * 1000, 100)) == 10  # many short spans: few hand-offs


def test_coalesce_merges_only_spans_that_are_neighbours_on_both_sides():
    spans = [(0, 100, 8), (8, 108, 8), (16, 200, 8), (24, 208, 8), (40, 216, 8), (48, 224, 0), (48, 224, 4)]
    assert memcopy.coalesce(spans) == [(0, 100, 16), (16, 200, 16), (40, 216, 12)]
    assert memcopy.coalesce([]) == []


def test_views_of_one_flat_buffer_are_copied_as_one_span_and_exactly(monkeypatch):
    """Parameters that are views of one buffer (Megatron's DDP keeps them so) cost one copy, not one per view."""
    flat_params = torch.arange(64 * 40, dtype=torch.float32)
    state = {f"p{i}": flat_params[i * 64:(i + 1) * 64] for i in range(40)}  # 256 B each: no alignment gaps
    moved: list = []
    real = memcopy.move_all
    monkeypatch.setattr(memcopy, "move_all", lambda share: (moved.append(list(share)), real(share)))
    plan = plan_snapshot(state)
    dest = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, dest)
    assert moved == [[(dest.data_ptr(), flat_params.data_ptr(), flat_params.nbytes)]]
    out = restore(decode_header(encode_header(plan)), dest, copy=True)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_copy_spans_hands_pieces_to_every_thread(monkeypatch):
    monkeypatch.setattr(memcopy, "PIECE_MIN", 1 << 20)
    src = torch.randint(0, 255, (memcopy.SPLIT_MIN * 5 + 4321,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    calls = []
    real = memcopy.parallel_map

    def recording(fn, items, nthreads=None):
        calls.append((len(items), nthreads))
        return real(fn, items, nthreads)

    monkeypatch.setattr(memcopy, "parallel_map", recording)
    half = src.numel() // 2
    memcopy.copy_spans([(dst.data_ptr(), src.data_ptr(), half),
                        (dst.data_ptr() + half, src.data_ptr() + half, src.numel() - half)], nthreads=2)
    assert torch.equal(dst, src)
    (count, nthreads), = calls
    assert nthreads == 2 and count == 2 * memcopy.PIECES_PER_THREAD  # taken in turn by both threads


def test_parallel_map_keeps_the_order_and_raises_the_first_error():
    assert memcopy.parallel_map(lambda x: x * x, list(range(50)), nthreads=3) == [x * x for x in range(50)]

    def boom(x: int) -> int:
        if x == 7:
            raise ValueError("seven")
        return x

    with pytest.raises(ValueError, match="seven"):
        memcopy.parallel_map(boom, list(range(20)), nthreads=3)


def test_copy_pairs_copies_contiguous_and_other_pairs(split_small):
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(100, generator=g), torch.randn(8, 9, generator=g).t(), torch.randn(3, generator=g),
            torch.randn(5, dtype=torch.complex64, generator=g).conj(), torch.empty(0)]
    dsts = [torch.zeros(100), torch.zeros(9, 8), torch.zeros(3, dtype=torch.float64),
            torch.zeros(5, dtype=torch.complex64), torch.zeros(0)]
    copy_pairs(list(zip(srcs, dsts, strict=True)))
    assert torch.equal(dsts[0], srcs[0]) and torch.equal(dsts[1], srcs[1])
    assert torch.equal(dsts[2], srcs[2].double())  # another dtype: copy_ converts, as before
    assert torch.equal(dsts[3], srcs[3].resolve_conj())


@pytest.mark.parametrize("huge", [False, True], ids=["4k-pages", "huge-pages"])
def test_fresh_buffer_is_zeroed_writable_and_aligned(monkeypatch, huge):
    monkeypatch.setattr(memcopy, "HUGE_PAGES", huge)
    for n in (0, 1, 4095, memcopy.HUGE + 3):
        buf = memcopy.fresh_buffer(n)
        assert buf.dtype == torch.uint8 and buf.numel() == n
        if n:
            assert int(buf.max()) == 0
            buf.fill_(7)
            assert int(buf.min()) == 7
    assert memcopy.fresh_buffer(memcopy.HUGE).data_ptr() % memcopy.HUGE == 0


def _failing_madvise(err: int):
    def madvise(addr: int, length: int, advice: int) -> int:
        ctypes.set_errno(err)  # what the real call leaves for ctypes.get_errno() (use_errno=True)
        return -1
    return madvise


def test_fresh_buffer_touches_the_pages_where_the_kernel_refuses_populate(monkeypatch):
    monkeypatch.setattr(memcopy, "madvise", _failing_madvise(errno.EINVAL))  # a kernel before 5.14
    buf = memcopy.fresh_buffer(3 * mmap.PAGESIZE + 5)
    assert buf.numel() == 3 * mmap.PAGESIZE + 5 and int(buf.max()) == 0


@pytest.mark.parametrize("err", [errno.ENOMEM, errno.EFAULT])
def test_fresh_buffer_raises_when_populating_finds_no_memory(monkeypatch, err):
    # Touching the pages instead would bring the OOM killer, not an error the caller can report.
    monkeypatch.setattr(memcopy, "madvise", _failing_madvise(err))
    with pytest.raises(MemoryError, match=f"could not populate 12.0 MiB of fresh host memory: {os.strerror(err)}"):
        memcopy.fresh_buffer(12 << 20)


_ADDRESS_SPACE_CAPPED = """
import resource, sys
import tiered_ckpt.memcopy as memcopy
from tiered_ckpt.errors import CapacityError
from tiered_ckpt.tiers.gpu import GpuOptions, GpuTier
with open("/proc/self/statm") as f:
    vsz = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vsz + (256 << 20),) * 2)  # room for 256 MiB more, no more
try:
    memcopy.fresh_buffer(1 << 30)
except MemoryError as exc:
    print("fresh_buffer:", exc)
tier = GpuTier("staging", GpuOptions(device="cpu"))
try:
    tier.allocate_slot("step_1/rank_0", 1 << 30)
except CapacityError as exc:
    print("allocate_slot:", exc)
print("small:", int(memcopy.fresh_buffer(1 << 20).sum()))
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="RLIMIT_AS and /proc/self/statm are Linux's")
def test_host_memory_refused_by_the_kernel_is_a_clear_error_not_a_crash():
    # A real refusal: the child caps its own address space, then asks for more than fits.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ADDRESS_SPACE_CAPPED], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("fresh_buffer: the host refused 1.00 GiB of fresh memory"), out.stdout
    assert lines[1].startswith("allocate_slot: ") and "1.00 GiB" in lines[1], out.stdout
    assert "tier 'staging'" in lines[1] and "step_1/rank_0" in lines[1] and "free some" in lines[1], out.stdout
    assert lines[2] == "small: 0", out.stdout  # what fits is still given


@pytest.fixture
def small_pieces(monkeypatch):
    """Snapshot checksums of 1 MiB + 3 byte pieces and 64 KiB sub-blocks: several pieces on small data."""
    piece = (1 << 20) + 3
    monkeypatch.setattr(checksum_mod, "SNAPSHOT_PIECE", piece)
    monkeypatch.setattr(load_into_mod, "SNAPSHOT_PIECE", piece)
    monkeypatch.setattr(load_into_mod, "_SUB", 64 << 10)
    return piece


@pytest.mark.parametrize("n", [0, 1, (1 << 20) + 3, 3 * ((1 << 20) + 3) + 999])
def test_copy_out_verified_returns_the_bytes_it_verified(small_pieces, n):
    data = torch.randint(0, 255, (n,), dtype=torch.uint8)
    out = copy_out_verified(data, snapshot_checksum(data))
    assert out is not None and torch.equal(out, data)
    assert n == 0 or out.data_ptr() != data.data_ptr()
    assert torch.equal(copy_out(data), data)


def test_copy_out_verified_refuses_any_damaged_byte(small_pieces):
    data = torch.randint(0, 255, (3 * small_pieces + 999,), dtype=torch.uint8)
    good = snapshot_checksum(data)
    for at in (0, small_pieces - 1, small_pieces, data.numel() - 1):
        bad = data.clone()
        bad[at] ^= 1
        assert copy_out_verified(bad, good) is None
    assert copy_out_verified(data[:-1], good) is None  # another number of pieces
    plain = f"{checksum_mod.ALGORITHM}:{checksum_mod.digest(data)}"  # a whole-buffer checksum
    assert torch.equal(copy_out_verified(data, plain), data)
    assert copy_out_verified(data, "md5:00") is None


def test_copy_verified_into_targets_across_pieces(small_pieces, split_small):
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(small_pieces // 4 + 5, generator=g), "b": torch.randn(7, generator=g),
             "c": torch.randn(small_pieces // 2, generator=g)}
    plan = plan_snapshot(state)
    data = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, data)
    views = restore(decode_header(encode_header(plan)), data, copy=False)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    pairs = [(views[k], targets[k]) for k in state]
    good = snapshot_checksum(data)
    assert copy_verified(data, good, pairs)
    for k in state:
        assert torch.equal(targets[k], state[k])
    data[data.numel() - 70] ^= 1  # in the last piece
    assert not copy_verified(data, good, pairs)


def test_the_copy_pool_works_in_a_forked_child():
    src = torch.randint(0, 255, (memcopy.SPLIT_MIN * 2 + 17,), dtype=torch.uint8)
    dst, out = torch.zeros_like(src), torch.zeros_like(src)
    memcopy.copy_spans([(dst.data_ptr(), src.data_ptr(), src.numel())], nthreads=2)  # the pool exists now
    assert torch.equal(dst, src)
    expected = bytes(src.numpy())
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool threads are gone; a copy must still finish, on a new pool
        # (no torch op here: torch's own OpenMP pool may hang in a forked child, whatever this package does)
        try:
            memcopy.copy_spans([(out.data_ptr(), src.data_ptr(), src.numel())], nthreads=2)
            ok = memcopy.parallel_map(lambda x: x + 1, [1, 2, 3], nthreads=2) == [2, 3, 4]
            os._exit(0 if ok and ctypes.string_at(out.data_ptr(), out.numel()) == expected else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="streaming stores are x86-64's")
def test_the_streaming_copy_is_built_by_the_install():
    """``make`` (pip install -e .) compiles the C helper here; an install that lost it would copy at memmove's
    speed with every other test still passing."""
    assert memcopy.STREAMING


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "memmove"])
@pytest.mark.parametrize("n", [0, 1, 15, 63, 64, 65, 4097, (64 << 10) - 1, 64 << 10, (1 << 20) + 77])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 3), (7, 13), (15, 1)])
def test_move_copies_exactly_the_bytes_asked_at_any_alignment(monkeypatch, streaming, n, dst_off, src_off):
    """Heads before a 16-byte boundary, whole cache lines, tails; nothing written outside the range."""
    if streaming and not memcopy.STREAMING:
        pytest.skip("the C helper is not built here")
    monkeypatch.setattr(memcopy, "STREAMING", streaming)
    monkeypatch.setattr(memcopy, "STREAM_MIN", 0)  # even a byte goes through the streaming routine
    src = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    dst = torch.full((n + 64,), 0xA5, dtype=torch.uint8)
    memcopy.move(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n)
    assert torch.equal(dst[dst_off:dst_off + n], src[src_off:src_off + n])
    assert bool((dst[:dst_off] == 0xA5).all()) and bool((dst[dst_off + n:] == 0xA5).all())


@pytest.mark.parametrize("page_phase", [0, 16, 64, 4032, 4095])
@pytest.mark.parametrize("n", [4 * 4096 - 1, 4 * 4096, 4 * 4096 * 5 + 4096 * 3 + 77, (1 << 20) + 12345])
@pytest.mark.parametrize("src_off", [0, 3])
def test_the_streaming_copy_is_exact_across_its_page_groups(monkeypatch, page_phase, n, src_off):
    """The streaming copy goes line by line up to a page boundary of the destination, then copies groups of
    pages side by side, then the rest line by line: every way a range can fall across those parts."""
    if not memcopy.STREAMING:
        pytest.skip("the C helper is not built here")
    monkeypatch.setattr(memcopy, "STREAM_MIN", 0)
    src = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    dst = torch.full((n + 3 * 4096,), 0xA5, dtype=torch.uint8)
    start = (-dst.data_ptr()) % 4096 + page_phase  # ``page_phase`` bytes past a page boundary
    memcopy.move(dst.data_ptr() + start, src.data_ptr() + src_off, n)
    assert torch.equal(dst[start:start + n], src[src_off:src_off + n])
    assert bool((dst[:start] == 0xA5).all()) and bool((dst[start + n:] == 0xA5).all())


@pytest.mark.parametrize("shift", [16, -16, 1, -1])
def test_move_of_overlapping_ranges_is_memmove_s_at_every_size(monkeypatch, shift):
    """Streaming stores copy forward; overlapping ranges must still come out as memmove makes them."""
    monkeypatch.setattr(memcopy, "STREAM_MIN", 0)
    for n in (100, (64 << 10) + 5):
        buf = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        want = buf.clone()
        src_off, dst_off = 32, 32 + shift
        ctypes.memmove(want.data_ptr() + dst_off, want.data_ptr() + src_off, n)
        memcopy.move(buf.data_ptr() + dst_off, buf.data_ptr() + src_off, n)
        assert torch.equal(buf, want), (shift, n)


def test_the_streaming_copy_refuses_a_negative_count_a_null_or_an_impossible_address():
    if not memcopy.STREAMING:
        pytest.skip("the C helper is not built here")
    from tiered_ckpt import _streamcopy

    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="negative"):
        _streamcopy.copy(buf.data_ptr(), buf.data_ptr(), -1)
    with pytest.raises(ValueError, match="null"):
        _streamcopy.copy(0, buf.data_ptr(), 8)
    for bad in (-4096, 1 << 64):  # never wrapped around into some other address
        with pytest.raises(OverflowError):
            _streamcopy.copy(bad, buf.data_ptr(), 8)
    _streamcopy.copy(0, 0, 0)  # nothing to move: no address is touched


@pytest.mark.parametrize("way", ["streaming", "c-memcpy", "python"])
def test_move_all_copies_every_span_exactly_and_nothing_else(monkeypatch, way):
    """Many spans in one call of the C helper: small ones (memcpy), ones above STREAM_MIN (streamed, or not when
    streaming is off), any alignment, an empty one, and an overlapping one (memmove's result); and the same one
    span at a time where the helper is not built."""
    if way != "python" and memcopy._copy_many is None:
        pytest.skip("the C helper is not built here")
    streaming = way != "python"
    monkeypatch.setattr(memcopy, "STREAMING", way == "streaming")
    monkeypatch.setattr(memcopy, "STREAM_MIN", 4096)
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    dst = torch.full((1 << 20,), 0xA5, dtype=torch.uint8)
    want = dst.clone()
    spans, at = [], 0
    for k, n in enumerate([1, 63, 64, 4095, 4096, 4097, 0, 20000, 7, 100_000]):
        d, s = at + k % 16, 5000 + at * 2 + k
        spans.append((dst.data_ptr() + d, src.data_ptr() + s, n))
        want[d:d + n] = src[s:s + n]
        at += n + 100
    real, calls = memcopy._copy_many, []
    if streaming:
        monkeypatch.setattr(memcopy, "_copy_many", lambda *a: (calls.append(a), real(*a))[1])
    else:  # an install without the C helper: one move() per span
        monkeypatch.setattr(memcopy, "_copy_many", None)
    memcopy.move_all(spans)
    assert torch.equal(dst, want)
    assert len(calls) == (1 if streaming else 0)  # one hand-off of the GIL for all of them
    buf = torch.arange(256, dtype=torch.uint8).repeat(4)
    expect = buf.clone()
    ctypes.memmove(expect.data_ptr() + 10, expect.data_ptr(), 600)
    memcopy.move_all([(buf.data_ptr() + 10, buf.data_ptr(), 600), (buf.data_ptr(), buf.data_ptr(), 0)])
    assert torch.equal(buf, expect)


def test_copy_many_refuses_a_malformed_list_a_null_or_an_impossible_length():
    if not memcopy.STREAMING:
        pytest.skip("the C helper is not built here")
    import array

    from tiered_ckpt import _streamcopy

    buf = torch.zeros(64, dtype=torch.uint8)
    p = buf.data_ptr()
    with pytest.raises(ValueError, match="triples"):
        _streamcopy.copy_many(array.array("Q", [p, p]), 0)
    with pytest.raises(ValueError, match="span 1 has a null address"):
        _streamcopy.copy_many(array.array("Q", [p, p + 8, 8, 0, p, 8]), 0)
    with pytest.raises(ValueError, match="span 0 is"):
        _streamcopy.copy_many(array.array("Q", [p, p + 32, 1 << 63]), 0)
    assert bool((buf == 0).all())  # a refused list copies nothing, not even its good spans
    _streamcopy.copy_many(array.array("Q", [0, 0, 0]), 0)  # nothing to move: no address is touched


def test_a_snapshot_of_many_small_tensors_is_copied_in_few_calls(monkeypatch):
    """A model without the distributed optimizer holds thousands of tensors: the copy of a save must not pay a
    call (and a hand-off of the GIL) per tensor."""
    if memcopy._copy_many is None:
        pytest.skip("the C helper is not built here")
    real, calls = memcopy._copy_many, []
    monkeypatch.setattr(memcopy, "_copy_many", lambda *a: (calls.append(1), real(*a))[1])
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(2000)}
    plan = plan_snapshot(state)
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, buf)
    assert 0 < len(calls) <= 2 * memcopy.threads() * memcopy.PIECES_PER_THREAD
    back = restore(decode_header(encode_header(plan)), buf)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_memmove_releases_the_gil():
    # What the threads rely on: ctypes' foreign calls run without the GIL (a PyDLL function would not).
    assert not (ctypes.memmove._flags_ & ctypes._FUNCFLAG_PYTHONAPI)


@pytest.mark.parametrize("mode", ["thread"])
def test_engine_round_trip_of_odd_state_from_shm(shm_root, tmp_path, mode, split_small):
    state = _odd_state()
    cfg = {"run_id": f"mc{uuid.uuid4().hex[:8]}", "drain": {"mode": mode},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"state": state}).wait()
        copied = engine.load(copy=True)
        assert copied.verified and copied.tier == "shm"
        _assert_tree_equal(state, copied.items["state"])
        into = {"state": {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) and k not in ("conj", "neg")
                              else v) for k, v in state.items()}}
        loaded = engine.load(into=into)
        assert loaded.verified
        _assert_tree_equal(state, loaded.items["state"])
        assert loaded.items["state"]["f32"] is into["state"]["f32"]


def test_load_copy_gives_every_item_memory_of_its_own(shm_root):
    """load(copy=True) with several items: each item's tensors keep their values when the slot is saved over
    (before, every item after the first came back as views of a mapping of the slot)."""
    cfg = {"run_id": f"mc{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root), "slots": 1}]}
    items = {"first": {"w": torch.arange(1000.0)}, "second": {"w": torch.arange(1000.0) * 2},
             "third": {"w": torch.arange(1000.0) * 3}}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, items).wait()
        loaded = engine.load(copy=True)
        assert loaded.verified
        for it in items.values():
            it["w"].fill_(-1)
        engine.save(2, items).wait()  # the only slot, written over in place
        for k, mult in (("first", 1), ("second", 2), ("third", 3)):
            assert torch.equal(loaded.items[k]["w"], torch.arange(1000.0) * mult), k
