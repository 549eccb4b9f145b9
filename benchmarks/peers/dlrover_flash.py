"""DLRover's flash checkpoint (``DdpCheckpointer``), run with its own virtual environment's Python.

Without ``dlrover-run`` the checkpointer forks its saver process when it is built (here: before the state is
made, so the fork is small, as the agent process would be). Measures: ``save_checkpoint(MEMORY)`` first and warm
(``save_to_memory``: the copy into its ``/dev/shm`` segment); ``save_checkpoint(DISK)``: its blocking part (a
memory save), the time until the saver wrote the tracker (the persist: ``torch.save`` from shm, not fsynced),
and the ``fsync`` of the file we add to call it durable; restore from shm (its zero-copy views, copied into the
existing tensors) and from disk (its ``torch.load`` path, page cache dropped; where that refuses the file, as
it does for Megatron's ``args`` under torch >= 2.6, the error is recorded and ``weights_only=False`` timed
instead); host memory of the training process and the saver. A ``copy_`` into a pre-faulted buffer after each
warm save (both ways, the faster is the ceiling) and an ``O_DIRECT`` write+fsync after each persist give paired
limits, as in ``ours.py``.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
import uuid

os.environ.setdefault("DLROVER_LOG_LEVEL", "WARNING")
RUN_ID = f"bench{uuid.uuid4().hex[:8]}"
os.environ["TORCHELASTIC_RUN_ID"] = RUN_ID  # namespaces DLRover's shm segment and sockets

import _common as c  # noqa: E402


def wait_tracker(ckpt_dir: str, step: int, timeout: float = 600.0) -> float:
    """Seconds until DLRover's tracker names ``step`` (polled every 5 ms)."""
    tracker = os.path.join(ckpt_dir, "dlrover_latest.txt")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            with open(tracker) as f:
                if f.read().strip() == str(step):
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.005)
    raise TimeoutError(f"DLRover did not persist step {step} within {timeout} s")


def main() -> int:
    from importlib.metadata import version

    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    args = c.parse_args(__doc__.split("\n")[0])
    ckpt_dir = os.path.join(args.workdir, "ckpt")
    out: dict = {"candidate": "dlrover", "state": args.state, "dlrover": version("dlrover")}
    ck = None
    try:
        ck = DdpCheckpointer(ckpt_dir)
        items = c.states.make(args.state, args.quick)
        nbytes = c.states.nbytes(items)
        out["bytes"] = nbytes
        tensors = c.states.tensors(items)
        baseline = c.CopyBaseline(tensors)
        raw_dir = os.path.join(args.workdir, "raw")
        direct, io = c.direct_io(tensors, raw_dir)  # as in ours.py
        out["io_threads"] = io
        kids_baseline = c.wait_children_settled()
        before, out["peak_reset"], sampler = c.open_memory_window()

        first, _ = c.timed(lambda: ck.save_checkpoint(1, items, storage_type=StorageType.MEMORY))
        warm, copy_s = [], []
        for step in range(2, 2 + args.warm):
            s, _ = c.timed(lambda step=step: ck.save_checkpoint(step, items, storage_type=StorageType.MEMORY))
            warm.append(s)
            copy_s.append(baseline.copy_in())
        out["first_s"], out["warm_s"], out["limit_copy_s"] = first, warm, copy_s

        blocking, persist, fsync_s, write_s, path = [], [], [], [], None
        for step in range(100, 102):
            path = os.path.join(ckpt_dir, str(step), "rank_0.pt")
            c.drop_cache(args.workdir)  # as in ours.py: our files out of the page cache before each write
            t0 = time.perf_counter()
            ck.save_checkpoint(step, items, path=path, storage_type=StorageType.DISK)
            blocking.append(time.perf_counter() - t0)
            wait_tracker(ckpt_dir, step)
            persist.append(time.perf_counter() - t0)
            s, _ = c.timed(lambda d=os.path.dirname(path): c.fsync_tree(d))
            fsync_s.append(s)
            c.drop_cache(args.workdir)
            write_s.append(direct.write_fsync(io["write"]))
        out["limit_direct_write_s"] = write_s
        direct.close()
        out["limit_copy_ways"] = baseline.report()
        out["persist_blocking_s"], out["persist_total_s"], out["persist_fsync_s"] = blocking, persist, fsync_s
        out["durable_total_s"] = [p + f for p, f in zip(persist, fsync_s, strict=True)]
        out["durable_after_s"] = [p + f - b for p, f, b in zip(persist, fsync_s, blocking, strict=True)]
        out["memory"] = c.memory_report(before, c.proc_status(), sampler.stop(), nbytes, kids_baseline)

        shm_s, shm_load_s = [], []
        for i in range(3):
            t0 = time.perf_counter()
            loaded = ck.load_checkpoint()
            t1 = time.perf_counter()
            c.copy_into(items, loaded)
            shm_s.append(time.perf_counter() - t0)
            shm_load_s.append(t1 - t0)
            if i == 0:
                assert c.same_tensors(items, loaded), "DLRover's restore from shm returned other values"
            del loaded
            c.settle()
        baseline.close()
        out["restore_shm_views_copy_s"], out["restore_shm_views_load_part_s"] = shm_s, shm_load_s

        disk_s, disk_load_s = [], []
        for _ in range(2):
            c.drop_cache(ckpt_dir)
            t0 = time.perf_counter()
            try:  # what load_checkpoint() does when shm holds nothing: torch.load(path, map_location="cpu")
                loaded = ck._engine._load_from_storage(path)
            except Exception as exc:  # torch >= 2.6 loads weights_only: Megatron's args (a Namespace) fail
                out["restore_disk_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                c.drop_cache(ckpt_dir)
                t0 = time.perf_counter()
                loaded = c.torch.load(path, map_location="cpu", weights_only=False)
            t1 = time.perf_counter()
            c.copy_into(items, loaded)
            disk_s.append(time.perf_counter() - t0)
            disk_load_s.append(t1 - t0)
            del loaded
            c.settle()
        out["restore_disk_s"], out["restore_disk_load_part_s"] = disk_s, disk_load_s
    finally:
        try:
            if ck is not None:
                ck._engine.close()
        except Exception:
            pass
        for seg in glob.glob(f"/dev/shm/{RUN_ID}_*"):
            os.unlink(seg)
        shutil.rmtree(f"/tmp/ckpt_sock/{RUN_ID}", ignore_errors=True)
    c.write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
