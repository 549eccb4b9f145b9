"""The CUDA copy path (issue #8, point 3): page-locked shm slots and side-stream copies.

Most of it runs without a GPU: ``torch.cuda.is_available``/``is_initialized`` and ``torch.cuda.cudart()`` are
replaced by fakes that record every registration, so what is pinned, when, and what is never touched (the drain
worker, CPU-only code) is checked here. The two tests that need a real device are skipped without one.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import uuid

import pytest
import torch
from helpers import assert_same, make_items

from tiered_ckpt import CheckpointEngine, cuda_streams
from tiered_ckpt.codecs import flat
from tiered_ckpt.config import load_config
from tiered_ckpt.drain import DrainRequest
from tiered_ckpt.errors import ConfigError
from tiered_ckpt.memory_store import MemoryStore
from tiered_ckpt.parallel import RankCoords
from tiered_ckpt.tiers.shm import ShmOptions
from tiered_ckpt.validate import build_dataclass

MiB = 1 << 20
KEY = "rank_00000/slot_0.data"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records calls, keeps the set of registered ranges."""

    def __init__(self, register_rc: int = 0):
        self.register_rc = register_rc
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, nbytes, flags))
        if self.register_rc == 0:
            assert ptr not in self.registered, "registered twice without an unregister"
            self.registered[ptr] = nbytes
        return self.register_rc

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 1

    def cudaGetErrorString(self, rc: int) -> str:  # noqa: N802
        return {1: "invalid argument", 712: "part or all of the requested memory range is already mapped"}.get(
            int(rc), "unknown error")


class FakeCuda:
    """What the tests switch: is CUDA available, has this process initialised it, and the fake runtime."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.available = True
        self.initialized = True
        self.cudart = FakeCudart()
        self.asked_available = 0
        self.cleared = 0
        monkeypatch.setattr(torch.cuda, "is_available", self._is_available)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self.cudart)
        monkeypatch.setattr(cuda_streams, "clear_last_error", self._clear)

    def _is_available(self) -> bool:
        self.asked_available += 1
        return self.available

    def _clear(self) -> None:
        self.cleared += 1

    def kinds(self) -> list[str]:
        return [c[0] for c in self.cudart.calls]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Listed before ``make_tier`` in a test's arguments, so tiers are closed while the fakes are still in."""
    return FakeCuda(monkeypatch)


def pattern(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ----- options --------------------------------------------------------------------------------------------------
def test_pin_option_validates():
    assert ShmOptions().pin == "auto"
    assert build_dataclass(ShmOptions, {"pin": True}).pin is True
    assert build_dataclass(ShmOptions, {"pin": False}).pin is False
    assert build_dataclass(ShmOptions, {"pin": "auto"}).pin == "auto"
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.pin"):
        build_dataclass(ShmOptions, {"pin": "yes"}, "tiers[1]")


# ----- pinning --------------------------------------------------------------------------------------------------
def test_allocate_pins_the_whole_mapping(fake_cuda, make_tier):
    tier = make_tier("shm", name="host")
    slot = tier.allocate_slot(KEY, 3 * MiB + 5)
    assert fake_cuda.cudart.calls == [("register", slot.data_ptr(), slot.numel(), 0)]
    assert slot.numel() == 3 * MiB + 5 and tier.is_pinned(KEY)
    data = pattern(slot.numel())
    slot.copy_(data)
    assert torch.equal(tier.read_blob(KEY), data)
    assert tier.allocate_slot(KEY, MiB) is slot  # reused: registered once
    assert fake_cuda.kinds() == ["register"]


def test_unpinned_before_the_slot_grows(fake_cuda, make_tier):
    tier = make_tier("shm")
    small = tier.allocate_slot(KEY, MiB)
    old_ptr = small.data_ptr()
    big = tier.allocate_slot(KEY, 4 * MiB)
    calls = fake_cuda.cudart.calls
    assert calls[0] == ("register", old_ptr, MiB, 0)
    assert calls[1] == ("unregister", old_ptr), "the old mapping must be unregistered before it is replaced"
    assert calls[2] == ("register", big.data_ptr(), 4 * MiB, 0)
    assert fake_cuda.cudart.registered == {big.data_ptr(): 4 * MiB}
    small[:10] = 7  # the old tensor still works, unpinned, and shows the file it maps
    assert torch.equal(big[:10], torch.full((10,), 7, dtype=torch.uint8))


def test_unpinned_when_the_slot_is_replaced_deleted_or_closed(fake_cuda, make_tier):
    tier = make_tier("shm")
    slots = {k: tier.allocate_slot(k, MiB) for k in ("a/s.data", "b/s.data", "c/s.data", "d/s.data")}
    assert len(fake_cuda.cudart.registered) == 4
    tier.write_blob("a/s.data", [b"replaced"])
    tier.delete("b/s.data")
    tier.delete_prefix("c")
    unregistered = [c[1] for c in fake_cuda.cudart.calls if c[0] == "unregister"]
    assert unregistered == [slots["a/s.data"].data_ptr(), slots["b/s.data"].data_ptr(),
                            slots["c/s.data"].data_ptr()]
    tier.close()
    assert fake_cuda.cudart.registered == {}
    assert fake_cuda.kinds().count("unregister") == 4
    tier.close()  # closing twice unregisters nothing twice
    assert fake_cuda.kinds().count("unregister") == 4


def test_failed_registration_warns_once_and_the_slot_still_works(fake_cuda, make_tier, caplog):
    fake_cuda.cudart.register_rc = 712
    tier = make_tier("shm", name="host")
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.tiers.shm"):
        slot = tier.allocate_slot(KEY, 2 * MiB)
        assert tier.allocate_slot(KEY, MiB) is slot  # reuse: no second attempt, no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "'host'" in warnings[0] and KEY in warnings[0] and "2.00 MiB" in warnings[0]
    assert "already mapped" in warnings[0] and "712" in warnings[0]
    assert fake_cuda.cleared == 1, "the failed call's CUDA error must be cleared"
    assert not tier.is_pinned(KEY)
    data = pattern(slot.numel(), 1)
    slot.copy_(data)
    assert torch.equal(tier.read_blob(KEY), data)
    tier.close()
    assert "unregister" not in fake_cuda.kinds()


def test_register_raising_is_a_warning_not_an_error(fake_cuda, make_tier, caplog, monkeypatch):
    def broken() -> None:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "cudart", broken)
    tier = make_tier("shm", pin=True)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.tiers.shm"):
        slot = tier.allocate_slot(KEY, MiB)
    assert slot.numel() == MiB and not tier.is_pinned(KEY)
    assert "driver initialization failed" in caplog.text


def test_pin_true_without_cuda_is_a_config_error(fake_cuda, make_tier):
    fake_cuda.available = False
    fake_cuda.initialized = False
    tier = make_tier("shm", name="host", pin=True)
    with pytest.raises(ConfigError, match=r"tier 'host'\.pin: pin is true but CUDA is not available"):
        tier.allocate_slot(KEY, MiB)
    assert not tier.exists(KEY), "nothing may be allocated before the error"
    assert fake_cuda.cudart.calls == []


def test_pin_true_pins_even_before_cuda_is_initialised(fake_cuda, make_tier):
    fake_cuda.initialized = False
    tier = make_tier("shm", pin=True)
    slot = tier.allocate_slot(KEY, MiB)
    assert fake_cuda.cudart.calls == [("register", slot.data_ptr(), MiB, 0)]


def test_pin_false_never_calls_cuda(fake_cuda, make_tier):
    tier = make_tier("shm", pin=False)
    tier.allocate_slot(KEY, MiB)
    tier.allocate_slot(KEY, 2 * MiB)
    tier.close()
    assert fake_cuda.cudart.calls == [] and fake_cuda.asked_available == 0


def test_auto_does_not_touch_cuda_where_the_process_never_used_it(fake_cuda, make_tier):
    fake_cuda.initialized = False
    tier = make_tier("shm")
    slot = tier.allocate_slot(KEY, MiB)
    assert fake_cuda.cudart.calls == [] and fake_cuda.asked_available == 0
    # CUDA comes up later in this process (the model moved to the GPU after prepare()): the next save pins.
    fake_cuda.initialized = True
    assert tier.allocate_slot(KEY, MiB) is slot
    assert fake_cuda.cudart.calls == [("register", slot.data_ptr(), MiB, 0)]


def test_readers_never_pin(fake_cuda, make_tier, tier_context):
    writer = make_tier("shm", context=tier_context)
    slot = writer.allocate_slot(KEY, MiB)
    slot.copy_(pattern(MiB, 2))
    fake_cuda.cudart.calls.clear()
    reader = make_tier("shm", path=writer.options.path, context=tier_context)  # another process's view
    assert torch.equal(reader.read_blob(KEY), pattern(MiB, 2))
    assert reader.read_range(KEY, 10, 5) == bytes(pattern(MiB, 2)[10:15].tolist())
    reader.close()
    assert fake_cuda.cudart.calls == []


def test_the_engine_pins_its_slots_and_hop_targets(fake_cuda, shm_root, tmp_path):
    """The training process: the entry slots (save) and the gpu → shm hop's slots (drain threads here)."""
    cfg = {"run_id": f"pin-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "hbm", "kind": "gpu", "device": "cpu", "slots": 1},
                     {"name": "host", "kind": "shm", "path": shm_root, "slots": 2},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    items = make_items(4)
    with CheckpointEngine(cfg) as engine:
        engine.save(1, items).wait(timeout=60)
        host = engine.pipeline.stores["host"]
        assert host.tier.is_pinned(host.data_key(0))
        assert len(fake_cuda.cudart.registered) == 1
        assert_same(items, engine._load_from("host", 1, copy=True, map_location=None)[0])
    assert fake_cuda.cudart.registered == {}, "close() must unregister every slot"


def test_slots_prepared_before_cuda_came_up_are_pinned_at_the_next_save(fake_cuda, shm_root, tmp_path):
    """``prepare()`` before the model moved to the GPU: under ``pin: auto`` nothing is pinned then, and the next
    save after CUDA came up pins the slot it writes (the engine asks the tier for its slot at every save)."""
    fake_cuda.initialized = False
    cfg = {"run_id": f"pin-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "host", "kind": "shm", "path": shm_root, "slots": 1}]}
    items = make_items(5)
    with CheckpointEngine(cfg) as engine:
        engine.prepare(items)
        host = engine.pipeline.stores["host"]
        assert fake_cuda.cudart.calls == [] and not host.tier.is_pinned(host.data_key(0))
        fake_cuda.initialized = True
        engine.save(1, items).wait(timeout=60)
        assert host.tier.is_pinned(host.data_key(0))
        assert_same(items, engine.load(copy=True).items)
    assert fake_cuda.cudart.registered == {}


def test_the_drain_worker_never_pins(fake_cuda, shm_root, tmp_path, monkeypatch):
    """The worker's own entry point, run in this process as a fresh spawned worker would be (CUDA never
    initialised): it maps the snapshot and drains it without a single CUDA call."""
    from tiered_ckpt import worker
    from tiered_ckpt.worker import worker_main

    # What worker_main does to its own process must not outlive the test in pytest's: it ignores SIGINT (every
    # later child of pytest would inherit that: a CLI started by a later test ignored Ctrl-C) and starts a thread
    # that exits the process when its parent changes.
    monkeypatch.setattr(worker, "watch_parent", lambda *_a, **_k: None)
    sigint = signal.getsignal(signal.SIGINT)

    run_id = f"worker-{uuid.uuid4().hex[:8]}"
    shm = {"name": "host", "kind": "shm", "path": shm_root, "slots": 2}
    disk = {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}
    items = make_items(5)
    with CheckpointEngine({"run_id": run_id, "drain": {"mode": "thread"}, "tiers": [shm]}) as engine:
        engine.save(7, items).wait(timeout=60)
        assert fake_cuda.kinds() == ["register"]  # the training process pinned its slot
        meta = next(m for m in engine.pipeline.entry_store.metas().values() if m.step == 7)

        fake_cuda.cudart.calls.clear()
        fake_cuda.initialized = False
        fake_cuda.asked_available = 0
        config = load_config({"run_id": run_id, "tiers": [shm, disk]})
        requests, results = queue.Queue(), queue.Queue()
        requests.put(DrainRequest(step=7, source="host", slot=meta.slot, due=("disk",)))
        requests.put(None)
        threads = torch.get_num_threads()
        try:
            worker_main(config, RankCoords(rank=0), ["host", "disk"], 0, [0], requests, results, os.getppid())
        finally:
            torch.set_num_threads(threads)
            signal.signal(signal.SIGINT, sigint)
        msgs = []
        while not results.empty():
            msgs.append(results.get())
        assert ("tier_done", 7, "disk", True, None) in msgs, msgs
        assert fake_cuda.cudart.calls == [] and fake_cuda.asked_available == 0
    with CheckpointEngine({"run_id": run_id, "drain": {"mode": "thread"}, "tiers": [disk]}) as engine:
        assert_same(items, engine.load(step=7).items)


# ----- side streams ---------------------------------------------------------------------------------------------
def test_cpu_paths_never_touch_cuda(monkeypatch, make_tier):
    def refuse(*_a, **_k):
        raise AssertionError("a CPU-only path touched CUDA")

    for name in ("Stream", "Event", "current_stream", "synchronize", "stream", "cudart", "is_available",
                 "is_initialized", "current_device"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    items = make_items(6)
    plan = flat.plan_snapshot(items)
    dest = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    flat.copy_into(plan, dest)
    flat.copy_into(plan, dest, synchronize=False)
    assert_same(items, flat.restore(flat.decode_header(flat.encode_header(plan)), dest, copy=True))
    gpu = make_tier("gpu", device="cpu")
    gpu.write_blob("x", [b"abc", torch.arange(4, dtype=torch.uint8)])
    gpu.write_blob("y", iter([b"abc", torch.arange(4, dtype=torch.uint8)]))
    assert bytes(gpu.read_blob("x").tolist()) == bytes(gpu.read_blob("y").tolist()) == b"abc\x00\x01\x02\x03"
    dst = torch.zeros(16, dtype=torch.uint8)
    cuda_streams.copy_bytes(dst, torch.arange(16, dtype=torch.uint8))
    assert dst.tolist() == list(range(16))
    with cuda_streams.on_side_streams([]):
        pass
    MemoryStore(make_tier("shm", pin=False), 0, 1).buffer(0, MiB)


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.device = name, log, torch.device("cuda", 0)

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name}.wait({other.name})")


class FakeEvent:
    def __init__(self, log: list, blocking: bool = False):
        self.log, self.blocking, self.stream = log, blocking, None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.log.append(f"record({stream.name}, blocking={self.blocking})")

    def synchronize(self) -> None:
        self.log.append(f"event_sync({self.stream.name})")


@pytest.fixture
def fake_streams(monkeypatch):
    """torch.cuda's stream API replaced by recorders: the order of waits, records and syncs is checked."""
    log: list[str] = []
    current = FakeStream("current", log)
    made: list[FakeStream] = []

    class StreamCtx:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"enter({self.stream.name})")

        def __exit__(self, *exc):
            log.append(f"exit({self.stream.name})")

    def new_stream(device=None):
        made.append(FakeStream(f"side{len(made)}", log))
        return made[-1]

    monkeypatch.setattr(cuda_streams, "_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", StreamCtx)
    monkeypatch.setattr(torch.cuda, "Event", lambda blocking=False: FakeEvent(log, blocking))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("DEVICE_SYNC"))
    return log, made


def test_side_stream_waits_for_the_current_stream_then_only_for_its_event(fake_streams):
    log, made = fake_streams
    dev = torch.device("cuda", 0)
    with cuda_streams.on_side_streams([dev]):
        log.append("copies")
    assert log == ["side0.wait(current)", "enter(side0)", "copies", "exit(side0)",
                   "record(side0, blocking=False)", "event_sync(side0)"]
    log.clear()
    with cuda_streams.on_side_streams([dev]):  # cached: the same stream
        pass
    with cuda_streams.on_side_streams([dev], "drain", wait_current=False, blocking=True):
        pass
    assert len(made) == 2 and "DEVICE_SYNC" not in log
    assert log[-4:] == ["enter(side1)", "exit(side1)", "record(side1, blocking=True)", "event_sync(side1)"]


def test_side_stream_without_synchronize_orders_the_current_stream_after_it(fake_streams):
    log, _ = fake_streams
    with cuda_streams.on_side_streams([torch.device("cuda", 0)], synchronize=False):
        log.append("copies")
    assert log == ["side0.wait(current)", "enter(side0)", "copies", "exit(side0)", "current.wait(side0)"]


def test_side_stream_still_waits_when_the_copies_fail(fake_streams):
    log, _ = fake_streams
    with pytest.raises(RuntimeError, match="boom"), cuda_streams.on_side_streams([torch.device("cuda", 0)]):
        raise RuntimeError("boom")
    assert log[-2:] == ["record(side0, blocking=False)", "event_sync(side0)"]


# ----- on a GPU -------------------------------------------------------------------------------------------------
@needs_gpu
def test_side_stream_copies_are_bit_exact_on_cuda():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(1 << 20, device=dev, generator=g)
    items = {"m": {"a": a * 3, "b": (torch.randn(257, 33, device=dev, generator=g) + 1).half(),
                   "t": torch.randn(64, 32, device=dev, generator=g).t(), "c": torch.arange(10)}}
    expected = {"m": {k: v.cpu() for k, v in items["m"].items()}}
    plan = flat.plan_snapshot(items)
    header = flat.decode_header(flat.encode_header(plan))
    for dest in (torch.empty(plan.total_bytes, dtype=torch.uint8),
                 torch.empty(plan.total_bytes, dtype=torch.uint8, pin_memory=True),
                 torch.empty(plan.total_bytes, dtype=torch.uint8, device=dev)):
        flat.copy_into(plan, dest)
        assert_same(expected, flat.restore(header, dest.cpu(), copy=True, map_location="cpu"))
    dest = torch.empty(plan.total_bytes, dtype=torch.uint8, device=dev)
    flat.copy_into(plan, dest, synchronize=False)
    items["m"]["a"].zero_()  # queued on the current stream: must run after the copy
    assert_same(expected, flat.restore(header, dest.cpu(), copy=True, map_location="cpu"))
    assert ("snapshot", torch.device("cuda", torch.cuda.current_device())) in cuda_streams._streams


@needs_gpu
def test_pinned_shm_slot_takes_device_to_host_copies_bit_exact(make_tier):
    tier = make_tier("shm", pin=True)
    src = torch.randn(4 << 20, device="cuda")
    slot = tier.allocate_slot(KEY, src.numel() * 4)
    assert tier.is_pinned(KEY) and slot.is_pinned()
    plan = flat.plan_snapshot({"w": src})
    flat.copy_into(plan, slot[:plan.total_bytes])
    assert torch.equal(slot[:src.numel() * 4].view(torch.float32), src.cpu())
    assert torch.equal(tier.read_blob(KEY)[:src.numel() * 4].view(torch.float32), src.cpu())
    tier.close()
    assert not slot.is_pinned()
