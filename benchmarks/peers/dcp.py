"""PyTorch Distributed Checkpoint (DCP) on the local disk, one process (``no_dist``): ``save`` and ``async_save``.

``dcp.save`` blocks for all of it (its FileSystemWriter fsyncs the files: ``sync_files=True``). ``dcp.async_save``
with its default stager first copies the state into fresh CPU memory (the blocking part: it returns once that
copy is made), then writes in a thread; its total runs until the returned future is done. Each save goes to a
new directory and the previous one is deleted. Restore: ``dcp.load`` in place into the existing tensors (page
cache dropped). Host memory is measured separately for ``save`` and for ``async_save`` (whose staging copy is its
"slot").
"""

from __future__ import annotations

import os
import shutil
import time
import warnings

import _common as c
import torch.distributed.checkpoint as dcp


def main() -> int:
    warnings.filterwarnings("ignore")  # DCP warns that torch.distributed is not initialised: intended here
    args = c.parse_args(__doc__.split("\n")[0])
    items = c.states.make(args.state, args.quick)
    nbytes = c.states.nbytes(items)
    out: dict = {"candidate": "dcp", "state": args.state, "bytes": nbytes}
    counter = iter(range(1000))
    last: list[str] = []

    def target() -> str:
        path = os.path.join(args.workdir, f"step_{next(counter)}")
        last.append(path)
        if len(last) > 2:
            shutil.rmtree(last.pop(0), ignore_errors=True)
        return path

    # dcp.save
    before, out["peak_reset"], sampler = c.open_memory_window()
    save_s = []
    for _ in range(1 + args.warm):
        path = target()
        s, _ = c.timed(lambda path=path: dcp.save(items, checkpoint_id=path, no_dist=True))
        save_s.append(s)
    out["memory_save"] = c.memory_report(before, c.proc_status(), sampler.stop(), 0, 0)
    out["save_s"] = save_s

    # dcp.async_save
    before, _, sampler = c.open_memory_window()
    blocking, total = [], []
    for _ in range(1 + args.warm):
        path = target()
        t0 = time.perf_counter()
        fut = dcp.async_save(items, checkpoint_id=path, no_dist=True)
        blocking.append(time.perf_counter() - t0)
        fut.result()
        total.append(time.perf_counter() - t0)
        del fut
    out["memory_async"] = c.memory_report(before, c.proc_status(), sampler.stop(), nbytes, 0)
    out["async_blocking_s"], out["async_total_s"] = blocking, total

    disk_s = []
    for _ in range(2):
        c.drop_cache(args.workdir)
        s, _ = c.timed(lambda: dcp.load(items, checkpoint_id=last[-1], no_dist=True))
        disk_s.append(s)
        c.settle()
    out["restore_disk_s"] = disk_s
    c.write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
