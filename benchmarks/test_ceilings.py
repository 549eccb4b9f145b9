"""Checks of the ceilings' own code (they are what every ratio is divided by): the copies move exactly the
state's bytes, the threaded way splits them without gaps or overlaps, the direct I/O round trip returns the
bytes it wrote, and the report picks the faster copy way. Not part of ``make test`` (benchmarks/ is not
collected there); run with ``.venv/bin/python -m pytest -q benchmarks/test_ceilings.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))

import _common as c  # noqa: E402
import limits  # noqa: E402
import report  # noqa: E402


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    # odd sizes, so ranges and pieces never line up with a tensor or a page
    return [torch.randn(n, generator=gen) for n in (1, 1000, 123_457, 33, 70_001)]


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_parallel_copy_moves_every_byte_once(threads):
    src = [t.view(torch.uint8) for t in _tensors()]
    dst = [torch.zeros_like(s) for s in src]
    pc = limits.ParallelCopy(list(zip(src, dst, strict=True)), threads=threads)
    try:
        pc.threaded()
        assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
        for d in dst:
            d.zero_()
        pc.single()
        assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
        if "streaming" in limits.COPY_WAYS:
            for d in dst:
                d.zero_()
            pc.streaming()
            assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
        assert sum(n for job in pc.jobs for _, _, n in job) == sum(s.numel() for s in src)
    finally:
        pc.close()


@pytest.mark.parametrize("ring", [1 << 12, 1 << 20])  # smaller and larger than the state: wrapping, and not
def test_copy_baseline_in_and_out_keep_the_state(ring):
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    base = c.CopyBaseline(tensors, ring=ring, threads=3)
    try:
        for _ in range(2):
            assert base.copy_in() > 0 and base.copy_out() > 0
        assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))
        if ring >= base.nbytes:  # no wrap: after a single-way copy the buffer holds the state, in order
            base.par_in.single()
            flat = torch.cat([t.view(torch.uint8) for t in tensors])
            assert torch.equal(base.buf[:base.nbytes], flat)
        rep = base.report()
        assert {k: len(v["single"]) for k, v in rep.items() if k != "threads"} == {"in": 2, "out": 2}
    finally:
        base.close()


def test_direct_io_round_trip(tmp_path):
    tensors = _tensors()
    d = limits.DirectIO(tensors, str(tmp_path))
    try:
        want = bytes(d.view[:d.nbytes])
        try:
            assert d.write_fsync(threads=2) > 0
            assert d.read(threads=1) > 0  # the first read writes its file from the buffer, untimed
            d.view[:d.nbytes] = b"\0" * d.nbytes
            assert d.read(threads=3) > 0
        except OSError as exc:
            pytest.skip(f"no O_DIRECT here: {exc}")
        got = bytes(d.view[:d.nbytes])  # outside the assert: pytest's rewriting would keep the view alive
        assert got == want  # read back into the buffer it was written from
        assert d.size % limits.ALIGN == 0 and d.size >= d.nbytes
        assert not os.path.exists(tmp_path / "raw_direct.bin")
    finally:
        d.close()


def test_limit_stats_takes_the_faster_way_by_median():
    runs = [{"limit_copy_ways": {"in": {"single": [1.0, 1.0, 9.0], "threaded": [2.0, 2.0, 0.1]}}},
            {"limit_copy_ways": {"in": {"single": [1.0], "threaded": [2.0]}}}, {"error": "failed"}]
    got = report.limit_stats(runs)["copy"]
    assert (got["way"], got["median"], got["n"]) == ("single", 1.0, 4)
    assert got["ways"] == {"single": 1.0, "threaded": 2.0}
