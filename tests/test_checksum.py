"""Checksums of memory snapshots: piecewise xxh3-128, verified on several cores; the older single-stream form."""

from __future__ import annotations

import os

import torch

from tiered_ckpt import checksum
from tiered_ckpt.checksum import ALGORITHM, SNAPSHOT_PIECE, digest, snapshot_checksum, snapshot_matches


def _data(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_one_digest_per_piece_in_order():
    data = _data(SNAPSHOT_PIECE + 100, 6)
    tag, _, value = snapshot_checksum(data).partition(":")
    assert tag == f"{ALGORITHM}*64MiB"
    assert value.split(",") == [digest(data[:SNAPSHOT_PIECE]), digest(data[SNAPSHOT_PIECE:])]


def test_pieces_cover_everything_and_any_flip_is_caught():
    n = 2 * SNAPSHOT_PIECE + 12345  # three pieces, the last one short
    data = _data(n, 1)
    good = snapshot_checksum(data)
    assert len(good.partition(":")[2].split(",")) == 3
    assert snapshot_matches(data, good)
    for pos in (0, SNAPSHOT_PIECE - 1, SNAPSHOT_PIECE, n - 1):
        data[pos] ^= 1
        assert not snapshot_matches(data, good), pos
        data[pos] ^= 1
    assert snapshot_matches(data, good)


def test_plain_xxh3_checksums_of_older_snapshots_still_verify():
    data = _data(5000, 2)
    assert snapshot_matches(data, f"{ALGORITHM}:{digest(data)}")
    assert not snapshot_matches(data, f"{ALGORITHM}:{digest(data[:-1])}")


def test_an_unknown_checksum_format_is_a_mismatch():
    data = _data(100, 3)
    assert not snapshot_matches(data, "md5:" + "0" * 32)
    assert not snapshot_matches(data, f"{ALGORITHM}*1MiB:{digest(data)}")  # another piece size: not ours


def test_empty_item():
    empty = torch.empty(0, dtype=torch.uint8)
    assert snapshot_matches(empty, snapshot_checksum(empty))


def test_the_pool_is_rebuilt_in_a_forked_child():
    snapshot_checksum(_data(3 * SNAPSHOT_PIECE // 2, 4))  # starts the pool here
    assert checksum._HASH_POOL._pool is not None
    pid = os.fork()
    if pid == 0:  # child: the parent's pool has no threads here; a fresh one must be made
        ok = checksum._HASH_POOL._pool is None and snapshot_matches(d := _data(3 * SNAPSHOT_PIECE // 2, 5),
                                                         snapshot_checksum(d))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
