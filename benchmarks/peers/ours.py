"""tiered_ckpt's CheckpointEngine (tiers shm + local, drain in its own process), in a process of its own.

Measures: ``prepare()``; the first ``save()`` after it and warm ones (``handle.blocking_s``); the time from the
snapshot to the local tier's commit (the ``commit`` event's ``seconds``, which starts when ``save()`` returns);
restore from shm into the existing tensors, verified, with ``load(into=...)`` (what a resume needs), as
zero-copy views then ``copy_`` into them (what a resume's ``load_state_dict`` does after ``load()``) and as
``load(copy=True)`` into fresh memory; restore from the local disk (page cache dropped) into the existing
tensors; the host memory the saves added; and, with a fresh engine, a first ``save()`` without ``prepare()``.

The machine's physical limits are measured in this same process, alternating with the candidate under the
same load (``limits.py``): a copy of the tensors into a pre-faulted buffer after each warm save (both ways, one
``copy_`` per piece and the bytes split over all of torch's threads: the faster is the ceiling), an
``O_DIRECT`` write+fsync of the same bytes after each drain, a copy out of that buffer into the tensors after
each shm restore, and an ``O_DIRECT`` read before each disk restore. How many direct requests the disk wants in
flight is measured once first (``limits.best_io_threads``), with one buffered write+fsync for information.

Warm blocking times come from the main engine's quiet saves (each after the previous one was durable), from a
series with a shm-only engine (``--series`` saves, each followed by the copy limit), which needs no drain
between saves, and from ``--overlap`` saves issued while the previous step still drains (each followed by a copy
limit taken while that drain still runs). A save that had to wait for a free slot says so (``slot_wait``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

import _common as c
import torch

from tiered_ckpt import CheckpointEngine, hookimpl
from tiered_ckpt.checksum import digest
from tiered_ckpt.memory_store import plan_items
from tiered_ckpt.plugins import get_plugin_manager


class Events:
    def __init__(self) -> None:
        self.commit: dict[tuple[str, int], float] = {}
        self.drain: dict[tuple[str, int], float] = {}
        self.failed: list[str] = []
        self.slot_wait: dict[int, float] = {}

    @hookimpl
    def tiered_ckpt_on_event(self, event):
        if event.kind == "commit":
            self.commit[(event.tier, event.step)] = event.seconds
        elif event.kind == "drain":
            self.drain[(event.tier, event.step)] = event.seconds
        elif event.kind == "slot_wait":
            self.slot_wait[event.step] = event.seconds
        elif event.kind == "commit_failed":
            self.failed.append(f"{event.tier} step {event.step}: {event.message}")


def config(run_id: str, shm: str | None, local: str) -> dict:
    tiers = []
    if shm is not None:
        tiers.append({"name": "shm", "kind": "shm", "path": shm, "slots": 2})
    tiers.append({"name": "local", "kind": "local", "path": local, "keep": 1})
    return {"run_id": run_id, "layout": "rank_sharded", "tiers": tiers}


def main() -> int:
    args = c.parse_args(__doc__.split("\n")[0])
    items = c.states.make(args.state, args.quick)
    nbytes = c.states.nbytes(items)
    _, slot_total = plan_items(items)
    shm = tempfile.mkdtemp(prefix="bench_ours_", dir="/dev/shm")
    local = os.path.join(args.workdir, "ckpt")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    events = Events()
    pm = get_plugin_manager()
    pm.register(events)
    out: dict = {"candidate": "ours", "state": args.state, "bytes": nbytes, "slot_bytes": slot_total}
    try:
        engine = CheckpointEngine(config(run_id, shm, local))
        nslots = engine.pipeline.entry_store.nslots
        tensors = c.states.tensors(items)
        baseline = c.CopyBaseline(tensors)  # made before the RSS baseline: its pages are not the save's
        raw_dir = os.path.join(args.workdir, "raw")
        # How many O_DIRECT requests in flight this disk wants (writes, reads), and one buffered write+fsync
        # for information: before the memory window, so their buffers are not counted as the save's.
        direct, io = c.direct_io(tensors, raw_dir)
        out["io_threads"] = io
        c.drop_cache(args.workdir)
        out["limit_write_fsync_buffered_s"] = c.write_fsync_seconds(tensors, raw_dir)
        kids_baseline = c.wait_children_settled()
        before, out["peak_reset"], sampler = c.open_memory_window()

        out["prepare_s"], _ = c.timed(lambda: engine.prepare(items))
        first = engine.save(1, items)
        first.wait()
        out["first_s"] = first.blocking_s
        out["first_durable_after_s"] = events.commit[("local", 1)]
        warm, durable, drain, copy_s, write_s = [], [], [], [], []
        for step in range(2, 2 + args.warm):
            # The drain and the raw write below both start with our own files out of the page cache: on a
            # machine short of free memory, writing behind 1 GiB of cached pages (the previous step, kept until
            # this one commits) costs a reclaim that a write right after a delete would not pay.
            c.drop_cache(args.workdir)
            h = engine.save(step, items)
            h.wait()
            engine.wait()  # retention's deletions too (after the handle): the limits below run quiet
            warm.append(h.blocking_s)
            durable.append(events.commit[("local", step)])
            drain.append(events.drain[("local", step)])
            # the limits, right after, under the same load
            copy_s.append(baseline.copy_in())
            c.drop_cache(args.workdir)
            write_s.append(direct.write_fsync(io["write"]))
        out["warm_s"], out["durable_after_s"], out["drain_write_s"] = warm, durable, drain
        out["limit_copy_s"], out["limit_direct_write_s"] = copy_s, write_s  # copy_s grows below
        out["durable_total_s"] = [w + d for w, d in zip(warm, durable, strict=True)]

        # Saves while the previous step still drains: from quiet, a save a (not counted), at once a save b into
        # the other slot (timed: a's drain has just started), then a copy limit while a drain still runs.
        busy, busy_copy, overlapped, step = [], [], [], 2 + args.warm
        for _ in range(args.overlap):
            c.drop_cache(args.workdir)
            a = engine.save(step, items)
            draining = not a.done()
            b = engine.save(step + 1, items)
            busy.append(b.blocking_s)
            overlapped.append([draining, not a.done()])  # the previous step draining at b's start, at its end
            busy_copy.append(baseline.copy_in("in_busy"))
            a.wait()
            b.wait()
            engine.wait()
            step += 2
        out["warm_busy_s"], out["limit_copy_busy_s"], out["busy_overlapped"] = busy, busy_copy, overlapped
        out["slot_wait_s"] = {str(k): v for k, v in events.slot_wait.items()}
        peak = c.proc_status()
        sampled = sampler.stop()
        out["memory"] = c.memory_report(before, peak, sampled, nslots * slot_total, kids_baseline)
        out["memory"]["slots"] = nslots

        # Restore from shm, alternating the three ways, three times each.
        views_s, views_load_s, fresh_s, copy_out_s, into_s = [], [], [], [], []
        saved = [digest(t.reshape(-1).view(torch.uint8)) for t in tensors]
        for i in range(3):
            for t in tensors:  # the first bytes of every tensor changed, as training would change all of them
                t.view(-1)[:16].add_(1)
            s, res = c.timed(lambda: engine.load(into=items))  # verified, straight into the model's tensors
            into_s.append(s)
            assert res.tier == "shm" and res.verified, (res.tier, res.verified)
            assert [digest(t.reshape(-1).view(torch.uint8)) for t in tensors] == saved, "load(into=...) missed"
            del res
            c.settle()
            t0 = time.perf_counter()
            res = engine.load(copy=False)
            t1 = time.perf_counter()
            c.copy_into(items, res.items)
            t2 = time.perf_counter()
            assert res.tier == "shm", res.tier
            views_load_s.append(t1 - t0)
            views_s.append(t2 - t0)
            del res
            c.settle()
            s, res = c.timed(lambda: engine.load(copy=True))
            fresh_s.append(s)
            if i == 0:
                out["restore_verified"] = res.verified
                assert c.same_tensors(items, res.items), "restore from shm returned other values"
            del res
            c.settle()
            copy_out_s.append(baseline.copy_out())
        out["limit_copy_out_s"] = copy_out_s
        out["restore_shm_views_copy_s"] = views_s
        out["restore_shm_into_s"] = into_s
        out["restore_shm_views_load_part_s"] = views_load_s
        out["restore_shm_fresh_s"] = fresh_s
        engine.close()
        shutil.rmtree(shm, ignore_errors=True)  # its slots are not needed any more: free the memory

        # More warm blocking samples, cheaply: an engine with the shm tier alone (one slot, nothing to drain, so
        # no save waits for a drain), each save followed by the copy limit, as above.
        shm3 = tempfile.mkdtemp(prefix="bench_ours_", dir="/dev/shm")
        try:
            with CheckpointEngine({"run_id": f"{run_id}-series", "drain": {"mode": "thread"},
                                   "tiers": [{"name": "shm", "kind": "shm", "path": shm3, "slots": 1}]}) as eng:
                eng.prepare(items)
                eng.save(1, items)
                series = []
                for step in range(2, 2 + args.series):
                    series.append(eng.save(step, items).blocking_s)
                    copy_s.append(baseline.copy_in())
                out["warm_series_s"] = series
        finally:
            shutil.rmtree(shm3, ignore_errors=True)
        out["limit_copy_ways"] = baseline.report()  # every copy_in / copy_out sample of both ways
        baseline.close()

        # Restore from the local disk: a new engine with only the local tier (as after a node restart, shm gone).
        disk_s, disk_load_s, read_s = [], [], []
        engine = CheckpointEngine(config(run_id, None, local))
        for _ in range(2):
            read_s.append(direct.read(io["read"]))
            out["dropped_bytes"] = c.drop_cache(local)
            t0 = time.perf_counter()
            res = engine.load(copy=True)
            t1 = time.perf_counter()
            c.copy_into(items, res.items)
            disk_s.append(time.perf_counter() - t0)
            disk_load_s.append(t1 - t0)
            assert res.tier == "local", res.tier
            del res
            c.settle()
        engine.close()
        direct.close()
        out["restore_disk_s"], out["restore_disk_load_part_s"], out["limit_direct_read_s"] = (disk_s, disk_load_s,
                                                                                           read_s)

        # The first save without prepare(): the slot is allocated and pre-faulted inside save().
        shm2 = tempfile.mkdtemp(prefix="bench_ours_", dir="/dev/shm")
        try:
            engine = CheckpointEngine(config(f"{run_id}-np", shm2, os.path.join(args.workdir, "ckpt2")))
            c.wait_children_settled()
            h = engine.save(1, items)
            out["first_no_prepare_s"] = h.blocking_s
            h.wait()
            engine.close()
        finally:
            shutil.rmtree(shm2, ignore_errors=True)
        out["commit_failed"] = events.failed
    finally:
        pm.unregister(events)
        shutil.rmtree(shm, ignore_errors=True)
    c.write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
