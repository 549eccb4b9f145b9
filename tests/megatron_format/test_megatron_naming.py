"""Megatron naming: step and rank directories, the tracker, rank order and writers, against the fixtures."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from megatron_fixtures import CONFIGS, ITER_DIR, RELOADS, folder, model_path, truth

from tiered_ckpt.errors import ConfigError, DecodeError, LayoutMismatchError
from tiered_ckpt.megatron import safe_load
from tiered_ckpt.megatron.naming import (
    RELEASE,
    TRACKER_FILENAME,
    MegatronTopology,
    RankDirCoords,
    format_tracker,
    iteration_dir_name,
    parse_iteration_dir,
    parse_rank_dir,
    parse_tracker,
    rank_dir_name,
    read_tracker,
    scan_rank_dirs,
    write_tracker,
)

# ----- step directories and tracker ------------------------------------------------------------------------


def test_iteration_dirs() -> None:
    assert iteration_dir_name(10) == "iter_0000010" == ITER_DIR
    assert iteration_dir_name(0) == "iter_0000000"
    assert iteration_dir_name(12_345_678) == "iter_12345678"  # more digits, never truncated
    assert iteration_dir_name(RELEASE) == "release"
    for n in (0, 10, 9_999_999, 10**7, 123_456_789):
        assert parse_iteration_dir(iteration_dir_name(n)) == n
    assert parse_iteration_dir("release") == RELEASE
    for other in ("iter_10", "iter_000001x", "iter_00000010", "mp_rank_00", "iter_-000001", "latest"):
        assert parse_iteration_dir(other) is None
    for bad in (-1, True, "3", 1.0):
        with pytest.raises(ConfigError):
            iteration_dir_name(bad)


@pytest.mark.parametrize("config", CONFIGS)
def test_fixture_tracker(config: str) -> None:
    """docs/megatron-format.md, "Directories and the tracker file": ``str(iteration)``, no padding, no newline
    (confirmed on Megatron's own file)."""
    assert (folder(config) / TRACKER_FILENAME).read_bytes() == b"10"
    assert read_tracker(folder(config)) == 10
    assert (folder(config) / iteration_dir_name(read_tracker(folder(config)))).is_dir()


def test_tracker_text() -> None:
    assert format_tracker(10) == "10" and format_tracker(0) == "0" and format_tracker(RELEASE) == "release"
    assert parse_tracker("10") == 10
    assert parse_tracker(" 10\n") == 10  # Megatron strips
    assert parse_tracker(b"release\n") == RELEASE
    assert parse_tracker(bytearray(b"0042")) == 42


@pytest.mark.parametrize(
    "garbage",
    ["", "  \n", "ten", "-5", "+10", "1_0", "10 20", "1e3", "\u0661\u0660", "Release", "10\x00", b"\xff\xfe"],
)
def test_tracker_garbage_is_a_decode_error_naming_the_file(garbage: str | bytes) -> None:
    with pytest.raises(DecodeError, match="/ckpt/latest_checkpointed_iteration.txt"):
        parse_tracker(garbage, source="/ckpt/latest_checkpointed_iteration.txt")


def test_write_tracker(tmp_path: Path) -> None:
    assert read_tracker(tmp_path) is None
    path = write_tracker(tmp_path, 10)
    assert Path(path).read_bytes() == b"10"
    write_tracker(tmp_path, RELEASE)
    assert read_tracker(tmp_path) == RELEASE
    assert sorted(os.listdir(tmp_path)) == [TRACKER_FILENAME]  # no temp files left
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    with pytest.raises(ConfigError):
        write_tracker(tmp_path, -1)
    (tmp_path / TRACKER_FILENAME).write_text("garbage")
    with pytest.raises(DecodeError, match=str(tmp_path)):
        read_tracker(tmp_path)


# ----- rank directories -----------------------------------------------------------------------------------


def test_rank_dir_names() -> None:
    assert rank_dir_name(0) == "mp_rank_00"
    assert rank_dir_name(3, 1, pp_size=2) == "mp_rank_03_001"
    assert rank_dir_name(3, ep=5, ep_size=8) == "mp_rank_03_005"
    assert rank_dir_name(3, 1, 5, pp_size=2, ep_size=8) == "mp_rank_03_001_005"
    assert rank_dir_name(0, 0, 0, pp_size=2, ep_size=2) == "mp_rank_00_000_000"
    assert rank_dir_name(123, 1000, pp_size=1001) == "mp_rank_123_1000"
    with pytest.raises(ConfigError):
        rank_dir_name(0, 2, pp_size=2)
    with pytest.raises(ConfigError):
        rank_dir_name(-1)


@pytest.mark.parametrize(("pp_size", "ep_size"), [(1, 1), (4, 1), (1, 4), (4, 4)])
def test_rank_dir_names_round_trip(pp_size: int, ep_size: int) -> None:
    for tp, pp, ep in itertools.product((0, 7, 100), range(pp_size), range(ep_size)):
        name = rank_dir_name(tp, pp, ep, pp_size=pp_size, ep_size=ep_size)
        assert parse_rank_dir(name, pp_size=pp_size, ep_size=ep_size) == RankDirCoords(tp, pp, ep)


def test_the_mp_rank_00_001_ambiguity() -> None:
    with pytest.raises(DecodeError, match="ambiguous"):
        parse_rank_dir("mp_rank_00_001")
    assert parse_rank_dir("mp_rank_00_001", pp_size=2) == RankDirCoords(0, pp=1)
    assert parse_rank_dir("mp_rank_00_001", ep_size=2) == RankDirCoords(0, ep=1)
    assert parse_rank_dir("mp_rank_00_001", pp_size=1) == RankDirCoords(0, ep=1)  # PP = 1: must be EP
    assert parse_rank_dir("mp_rank_00_001", ep_size=1) == RankDirCoords(0, pp=1)
    with pytest.raises(LayoutMismatchError, match="both > 1"):
        parse_rank_dir("mp_rank_00_001", pp_size=2, ep_size=2)
    with pytest.raises(LayoutMismatchError, match="PP = EP = 1"):
        parse_rank_dir("mp_rank_00_001", pp_size=1, ep_size=1)
    with pytest.raises(LayoutMismatchError, match="outside"):
        parse_rank_dir("mp_rank_00_004", pp_size=4)
    with pytest.raises(LayoutMismatchError, match="no suffix"):
        parse_rank_dir("mp_rank_00", pp_size=2)
    for bad in ("mp_rank_0", "mp_rank_00_01", "mp_rank_00_001_002_003", "rank_00001", "mp_rank_00_001x"):
        with pytest.raises(DecodeError):
            parse_rank_dir(bad, pp_size=2)


def test_scan_fixture_dirs_with_the_checkpoints_own_args() -> None:
    step = folder("dp2_tp1_pp2") / ITER_DIR
    names = os.listdir(step)
    with pytest.raises(DecodeError, match="ambiguous"):
        scan_rank_dirs(names)
    args = safe_load.load(model_path("dp2_tp1_pp2", "mp_rank_00_000"))["args"]
    scan = scan_rank_dirs(names, args=args)
    assert (scan.tp_size, scan.pp_size, scan.ep_size) == (1, 2, 1)
    assert scan.dirs == {"mp_rank_00_000": RankDirCoords(0, 0), "mp_rank_00_001": RankDirCoords(0, 1)}
    assert scan_rank_dirs(names, ep_size=1) == scan  # a known EP size settles it too
    assert (
        scan_rank_dirs(names, pp_size=1).ep_size == 2
    )  # ... or the opposite reading, if that is what's true
    assert scan.name_of(0, 1) == "mp_rank_00_001"
    one = scan_rank_dirs(os.listdir(folder("dp4_tp1_pp1") / ITER_DIR))
    assert (one.tp_size, one.pp_size, one.ep_size) == (1, 1, 1)


def test_scan_checks_the_grid() -> None:
    full = [
        rank_dir_name(t, p, e, pp_size=2, ep_size=3) for t in range(2) for p in range(2) for e in range(3)
    ]
    scan = scan_rank_dirs(full + ["tiered_ckpt", "rank_00003", "metadata.json"])
    assert (scan.tp_size, scan.pp_size, scan.ep_size) == (2, 2, 3) and len(scan.dirs) == 12
    with pytest.raises(LayoutMismatchError, match="missing"):
        scan_rank_dirs(full[1:])
    with pytest.raises(LayoutMismatchError, match="missing"):
        scan_rank_dirs(["mp_rank_00_000", "mp_rank_00_001"], pp_size=4)
    with pytest.raises(LayoutMismatchError, match="mix"):
        scan_rank_dirs(["mp_rank_00", "mp_rank_00_001"], pp_size=2)
    with pytest.raises(LayoutMismatchError):
        scan_rank_dirs(full, ep_size=1)
    with pytest.raises(DecodeError, match="no mp_rank"):
        scan_rank_dirs(["iter_0000010"])
    assert scan_rank_dirs(["mp_rank_00", "mp_rank_01"]).tp_size == 2


# ----- rank order, groups, writers ------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "reload_dp"), [(c, None) for c in CONFIGS] + list(RELOADS))
def test_topology_matches_megatrons_rank_map(config: str, reload_dp: int | None) -> None:
    t = truth(config, reload_dp)
    topo = MegatronTopology(tp=t["tp"], pp=t["pp"], dp=t["dp"], ep=t["ep"], cp=t["cp"])
    assert topo.world_size == t["world_size"]
    for rank, info in t["rank_map"].items():
        r = int(rank)
        pos = topo.position(r)
        assert (pos.tp, pos.pp, pos.dp) == (info["tp"], info["pp"], info["dp"])
        assert r == info["tp"] + t["tp"] * (info["dp"] + t["dp"] * info["pp"])
        assert topo.rank_of(tp=pos.tp, pp=pos.pp, dp=pos.dp) == r
        assert topo.tp_group(r) == info["tp_group"]
        assert topo.pp_group(r) == info["pp_group"]
        assert topo.dp_group(r) == topo.dp_group(r, with_cp=True) == info["dp_group"]
        assert topo.rank_dir(r) == info["checkpoint_subdir"]
        assert topo.writes_model_optim_rng(r) == info["writes_model_optim_rng"]
        assert topo.writes_distrib_optim(r) == info["writes_distrib_optim"]


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep", "pp-dp-ep-cp-tp"])
def test_general_order_is_a_bijection(order: str) -> None:
    topo = MegatronTopology(tp=2, pp=3, dp=2, ep=2, cp=2, order=order)
    positions = [topo.position(r) for r in range(topo.world_size)]
    assert len({(p.tp, p.pp, p.dp, p.ep, p.cp) for p in positions}) == topo.world_size == 48
    for p in positions:
        assert topo.rank_of(tp=p.tp, pp=p.pp, dp=p.dp, ep=p.ep, cp=p.cp) == p.rank
    first = order.split("-")[0]
    assert getattr(topo.position(1), first) == 1  # the first dim varies fastest
    # Groups partition the world.
    for dims in ("tp", "pp", ["ep", "dp"], "ep", "dp"):
        groups = {tuple(topo.group(r, dims)) for r in range(topo.world_size)}
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))


def test_default_order_formula_with_cp_and_ep() -> None:
    topo = MegatronTopology(tp=2, pp=2, dp=3, ep=2, cp=2)
    for r in range(topo.world_size):
        p = topo.position(r)
        assert r == p.tp + 2 * (p.cp + 2 * (p.ep + 2 * (p.dp + 3 * p.pp)))
    r = topo.rank_of(tp=1, pp=1, dp=2, ep=1, cp=1)
    assert topo.dp_group(r) == sorted(
        topo.rank_of(tp=1, pp=1, dp=d, ep=e, cp=1) for d in range(3) for e in range(2)
    )
    assert len(topo.dp_group(r, with_cp=True)) == 12 and len(topo.expert_dp_group(r)) == 3
    assert len(topo.ep_group(r)) == 2
    # One model_optim_rng.pt writer per rank directory; distrib_optim.pt writers are the same ranks.
    writers = [x for x in range(topo.world_size) if topo.writes_model_optim_rng(x)]
    assert sorted(topo.rank_dir(x) for x in writers) == sorted(
        rank_dir_name(t, p, e, pp_size=2, ep_size=2) for t in range(2) for p in range(2) for e in range(2)
    )
    assert writers == [x for x in range(topo.world_size) if topo.writes_distrib_optim(x)]


def test_topology_errors_and_from_layout() -> None:
    with pytest.raises(ConfigError, match="leaves out"):
        MegatronTopology(tp=2, order="cp-ep-dp-pp")
    assert MegatronTopology(dp=4, order="dp").position(3).dp == 3  # dims of size 1 may be left out
    with pytest.raises(ConfigError, match="distinct"):
        MegatronTopology(order="tp-tp-dp")
    with pytest.raises(ConfigError, match="distinct"):
        MegatronTopology(order="tp-xx")
    with pytest.raises(ConfigError):
        MegatronTopology(tp=0)
    with pytest.raises(ConfigError, match="outside"):
        MegatronTopology(dp=2).position(2)
    with pytest.raises(ConfigError, match="unknown dims"):
        MegatronTopology().group(0, "zz")
    layout = SimpleNamespace(tp=2, pp=2, dp=2, ep=1, cp=1, order="tp-cp-ep-dp-pp")
    assert MegatronTopology.from_layout(layout) == MegatronTopology(tp=2, pp=2, dp=2)
