"""Each fault of the `faulty` kind, its options, its controls, and its registration."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest
from tiered_ckpt_faults import FaultyOptions, FaultyTier, tiered_ckpt_register_tiers, write_control_file

from tiered_ckpt.errors import ConfigError, PermanentTierError, TransientTierError
from tiered_ckpt.registry import Registry
from tiered_ckpt.testing.contract import host_bytes, raw_files
from tiered_ckpt.testing.pytest_plugin import build_tier_registry
from tiered_ckpt.tiers.local import LocalOptions, LocalTier
from tiered_ckpt.validate import build_dataclass

MiB = 1 << 20


@pytest.fixture
def faulty(make_tier, tmp_path):
    """A factory of `faulty` tiers over a local directory (no fsync: these tests are about faults)."""

    def make(**faults):
        return make_tier("faulty", inner={"kind": "local", "path": str(tmp_path / "inner"), "fsync": False},
                         **faults)

    return make


# ----- registration and options ---------------------------------------------------------------------------
def test_registered_through_the_entry_point():
    registry = build_tier_registry()
    assert registry.get("faulty") is FaultyTier
    assert registry.provider_of("faulty") == "faults"


def test_hook_adds_the_kind():
    registry = Registry("tier kind")
    tiered_ckpt_register_tiers(registry=registry)
    assert list(registry) == ["faulty"]


@pytest.mark.parametrize("data, message", [
    ({}, r"tiers\[1\]\.inner: required key is missing"),
    ({"inner": {"path": "/x"}}, "inner: expected a mapping with the wrapped tier's kind"),
    ({"inner": {"kind": "local"}, "transient_errors": -1},
     r"tiers\[1\]\.transient_errors: expected a non-negative"),
    ({"inner": {"kind": "local"}, "ops": ["write_blob", "frobnicate"]}, "unknown primitive 'frobnicate'"),
    ({"inner": {"kind": "local"}, "fail_at": "end"}, r"tiers\[1\]\.fail_at: expected one of"),
    ({"inner": {"kind": "local"}, "latency_s": "soon"}, r"tiers\[1\]\.latency_s: expected a duration"),
])
def test_options_are_validated(data, message):
    with pytest.raises(ConfigError, match=message):
        build_dataclass(FaultyOptions, data, "tiers[1]", "tiers.yaml")


@pytest.mark.parametrize("inner, message", [
    ({"kind": "nope"}, r"inner\.kind: unknown tier kind 'nope'"),
    ({"kind": "local"}, r"inner\.path: required key is missing"),
    ({"kind": "local", "path": "/x", "bogus": 1}, r"inner\.bogus: unknown key"),
])
def test_inner_options_are_validated_by_the_inner_kind(make_tier, inner, message):
    with pytest.raises(ConfigError, match=message):
        make_tier("faulty", inner=inner)


def test_options_parse_units():
    opts = build_dataclass(FaultyOptions, {"inner": {"kind": "local", "path": "/x"}, "latency_s": "250ms",
                                           "disk_full_after": "1MiB", "ops": ["list"]})
    assert opts.latency_s == 0.25 and opts.disk_full_after == MiB and opts.ops == ("list",)


def test_capabilities_are_the_inner_tiers(make_tier, shm_root, tmp_path):
    over_shm = make_tier("faulty", inner={"kind": "shm", "path": shm_root})
    over_local = make_tier("faulty", inner={"kind": "local", "path": str(tmp_path)})
    assert over_shm.capabilities.memory and over_shm.capabilities.zero_copy_read
    assert not over_local.capabilities.memory
    opts = build_dataclass(FaultyOptions, {"inner": {"kind": "fsspec", "url": "s3://b/p"}})
    assert not FaultyTier.capabilities_for(opts).atomic_rename
    assert over_shm.describe().startswith("faulty(shm ")


def test_wrap_an_existing_tier(tmp_path):
    inner = LocalTier("nvme", LocalOptions(path=str(tmp_path)))
    tier = FaultyTier.wrap(inner, transient_errors=1)
    assert tier.name == "nvme" and tier.inner is inner
    with pytest.raises(TransientTierError):
        tier.write_blob("k", [b"v"])
    tier.write_blob("k", [b"v"])
    assert host_bytes(inner.read_blob("k")) == b"v"


# ----- faults ---------------------------------------------------------------------------------------------
def test_transient_errors(faulty):
    tier = faulty(transient_errors=2)
    consumed = []

    def chunks():
        for i in range(3):
            consumed.append(i)
            yield b"x" * MiB

    for attempt in (1, 2):
        consumed.clear()
        expected = f"injected transient fault \\(write_blob, operation {attempt}\\)"
        with pytest.raises(TransientTierError, match=expected):
            tier.write_blob("ckpt/file.pt", chunks())
        assert consumed == [0], "fail_at midway: the inner tier had the first chunk in flight"
        assert raw_files(tier.inner.root) == [], "no blob and no temporary file"
    assert tier.write_blob("ckpt/file.pt", chunks()) == 3 * MiB
    tier.publish("tracker", b"1")
    assert tier.control.stats == {"ops": 4, "injected": 2, "bytes_written": 3 * MiB + 1}


def test_transient_errors_keep_the_old_blob(faulty):
    tier = faulty()
    tier.write_blob("ckpt", [b"old"])
    tier.control.set(transient_errors=1)
    with pytest.raises(TransientTierError):
        tier.write_blob("ckpt", [b"new" * 1000, b"more"])
    assert host_bytes(tier.read_blob("ckpt")) == b"old"
    assert tier.list() == ["ckpt"] and raw_files(tier.inner.root) == ["ckpt"]


def test_single_chunk_writes_fail_midway_too(faulty):
    tier = faulty(transient_errors=1)
    consumed = []

    def chunks():
        consumed.append(True)
        yield b"only chunk"

    with pytest.raises(TransientTierError):
        tier.write_blob("one", chunks())
    assert consumed == [True] and raw_files(tier.inner.root) == []
    tier.publish("tracker", b"1")  # operation 2: past transient_errors


def test_fail_at_start_consumes_nothing(faulty):
    tier = faulty(transient_errors=1, fail_at="start")
    consumed = []

    def chunks():
        consumed.append(True)
        yield b"x"

    with pytest.raises(TransientTierError):
        tier.write_blob("k", chunks())
    assert consumed == []


def test_fail_every(faulty):
    tier = faulty(fail_every=3, fail_at="start")
    outcomes = []
    for i in range(7):
        try:
            tier.publish(f"k{i}", b"v")
            outcomes.append("ok")
        except TransientTierError:
            outcomes.append("fail")
    assert outcomes == ["ok", "ok", "fail", "ok", "ok", "fail", "ok"]


def test_permanent_error(faulty):
    tier = faulty()
    tier.write_blob("k", [b"v"])
    tier.control.set(permanent_error=True)
    for _ in range(3):
        with pytest.raises(PermanentTierError, match="injected permanent fault"):
            tier.write_blob("k", [b"new"])
    with pytest.raises(PermanentTierError):
        tier.publish("t", b"1")
    assert host_bytes(tier.read_blob("k")) == b"v"  # reads are not in the default ops
    assert tier.list() == ["k"]


def test_ops_choose_the_primitives(faulty):
    tier = faulty(transient_errors=1, ops=["list", "read_blob"])
    tier.write_blob("k", [b"v"])  # writes are left alone
    with pytest.raises(TransientTierError, match=r"\(list, operation 1\)"):
        tier.list()
    assert tier.list() == ["k"]
    assert host_bytes(tier.read_blob("k")) == b"v"  # operation 3: past transient_errors
    assert tier.control.stats["ops"] == 3


def test_latency(faulty):
    tier = faulty(latency_s="60ms", ops=["read_blob"])
    tier.write_blob("k", [b"v"])
    tier.write_blob("k2", [b"v"])
    assert tier.control.stats["injected"] == 0  # writes are not among the ops: no delay injected
    start = time.perf_counter()
    tier.read_blob("k")
    assert time.perf_counter() - start >= 0.06


def test_disk_full(faulty):
    tier = faulty(disk_full_after=1000)
    tier.write_blob("a", [b"x" * 600])
    with pytest.raises(PermanentTierError, match=r"disk full \(ENOSPC\)") as info:
        tier.write_blob("b", (b"y" * 200 for _ in range(3)))  # the 3rd chunk crosses the limit
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert "tier 'faulty0'" in str(info.value) and "key 'b'" in str(info.value)
    assert raw_files(tier.inner.root) == ["a"], "no temporary file left behind"
    with pytest.raises(PermanentTierError, match="disk full"):
        tier.publish("a", b"z" * 500)
    assert host_bytes(tier.read_blob("a")) == b"x" * 600
    tier.publish("small", b"z" * 400)  # exactly fills the budget
    assert tier.control.stats["bytes_written"] == 1000
    tier.control.set(disk_full_after=None)
    tier.write_blob("b", [b"y" * 5000])


def test_flip_bits_on_read(make_tier, faulty):
    data = bytes(range(256)) * 64
    tier = faulty(flip_bits_on_read=True, seed=7)
    tier.write_blob("blob", [data])
    corrupted = host_bytes(tier.read_blob("blob"))
    diff = [(i, a ^ b) for i, (a, b) in enumerate(zip(corrupted, data, strict=True)) if a != b]
    assert len(diff) == 1 and bin(diff[0][1]).count("1") == 1, "exactly one bit flipped"
    assert host_bytes(tier.inner.read_blob("blob")) == data, "the stored blob is intact"
    ranged = tier.read_range("blob", 100, 1000)
    assert sum(a != b for a, b in zip(ranged, data[100:1100], strict=True)) == 1
    same_seed = faulty(flip_bits_on_read=True, seed=7)
    assert host_bytes(same_seed.read_blob("blob")) == corrupted  # reproducible
    tier.control.set(flip_bits_on_read=False)
    assert host_bytes(tier.read_blob("blob")) == data


def test_flip_bits_never_corrupts_a_zero_copy_inner_tier(make_tier, shm_root):
    tier = make_tier("faulty", inner={"kind": "shm", "path": shm_root}, flip_bits_on_read=True)
    tier.write_blob("blob", [b"\x00" * 4096])
    assert host_bytes(tier.read_blob("blob")) != b"\x00" * 4096
    assert host_bytes(tier.inner.read_blob("blob")) == b"\x00" * 4096
    slot = tier.allocate_slot("snap/0", 4096)
    slot.zero_()
    tier.read_blob("snap/0")
    assert not bool(slot.any()), "the slot behind the view was not touched"


# ----- controls -------------------------------------------------------------------------------------------
def test_in_process_control(faulty):
    tier = faulty()
    control = FaultyTier.controls[tier.name]
    assert control is tier.control
    tier.write_blob("k", [b"1"])
    control.set(transient_errors=1, fail_at="start")
    with pytest.raises(TransientTierError):
        tier.write_blob("k", [b"2"])
    tier.write_blob("k", [b"3"])
    control.update(permanent_error=True)  # counters restart, transient_errors/fail_at stay
    with pytest.raises(PermanentTierError):
        tier.write_blob("k", [b"4"])
    control.clear()
    tier.write_blob("k", [b"5"])
    assert host_bytes(tier.read_blob("k")) == b"5"
    with pytest.raises(ConfigError, match="unknown key"):
        control.set(transient_erors=1)


def test_tiers_of_one_name_share_a_control(make_tier, tmp_path):
    a = make_tier("faulty", name="flaky", inner={"kind": "local", "path": str(tmp_path / "a")})
    b = make_tier("faulty", name="flaky", inner={"kind": "local", "path": str(tmp_path / "b")})
    FaultyTier.controls["flaky"].set(permanent_error=True)
    for tier in (a, b):
        with pytest.raises(PermanentTierError):
            tier.publish("k", b"v")


def test_control_file(faulty, tmp_path):
    control = tmp_path / "faults.json"
    tier = faulty(control_file=str(control))
    tier.write_blob("k", [b"no file yet: no faults"])
    write_control_file(control, transient_errors=1, fail_at="start")
    with pytest.raises(TransientTierError):
        tier.write_blob("k", [b"x"])
    tier.write_blob("k", [b"x"])
    write_control_file(control, transient_errors=1, fail_at="start")  # rewritten: counters restart
    with pytest.raises(TransientTierError):
        tier.publish("t", b"x")
    write_control_file(control)  # {}: back to the options
    tier.publish("t", b"y")
    tier.control.set(permanent_error=True)  # in-process overrides win over the file
    with pytest.raises(PermanentTierError):
        tier.publish("t", b"z")


def test_bad_control_files_are_reported(faulty, tmp_path):
    control = tmp_path / "faults.json"
    tier = faulty(control_file=str(control))
    control.write_text("{not json")
    with pytest.raises(ConfigError, match=str(control)):
        tier.write_blob("k", [b"x"])
    control.write_text('{"transient_errors": "many"}')
    with pytest.raises(ConfigError, match="transient_errors: expected a non-negative integer"):
        tier.write_blob("k", [b"x"])
    with pytest.raises(ConfigError, match="unknown key"):
        write_control_file(control, transient=1)


CHILD = textwrap.dedent("""
    import sys
    from tiered_ckpt.tiers.local import LocalOptions, LocalTier
    from tiered_ckpt_faults import FaultyTier

    tier = FaultyTier.wrap(LocalTier("nvme", LocalOptions(path=sys.argv[1], fsync=False)),
                           control_file=sys.argv[2])
    print("ready", flush=True)
    for n, line in enumerate(sys.stdin):
        try:
            tier.write_blob(f"step{n}", [b"data"])
            print("ok", flush=True)
        except Exception as exc:
            print(type(exc).__name__, flush=True)
""")


def test_control_file_changes_faults_in_another_running_process(tmp_path):
    control = tmp_path / "faults.json"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "store"), str(control)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"

        def write() -> str:
            child.stdin.write("write\n")
            child.stdin.flush()
            return child.stdout.readline().strip()

        assert write() == "ok"
        write_control_file(control, permanent_error=True)
        assert write() == "PermanentTierError"
        write_control_file(control, transient_errors=1)
        assert write() == "TransientTierError"
        assert write() == "ok"
        write_control_file(control)
        assert write() == "ok"
    finally:
        child.stdin.close()
        child.wait(30)
    assert sorted(os.listdir(tmp_path / "store")) == ["step0", "step3", "step4"]


def test_a_retry_loop_gets_through_transient_faults(faulty):
    tier = faulty(transient_errors=3)
    attempts = 0
    while True:
        attempts += 1
        try:
            tier.write_blob("iter_0000001/model_optim_rng.pt", [b"a" * MiB, b"b" * MiB])
            break
        except TransientTierError:
            assert attempts < 10
    assert attempts == 4
    assert tier.size("iter_0000001/model_optim_rng.pt") == 2 * MiB
