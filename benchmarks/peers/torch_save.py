"""``torch.save`` to a file on the local disk, then ``fsync``: synchronous, so it blocks for all of it.

Measures each save's ``torch.save`` and ``fsync`` time (first and warm; each save writes a new file, the previous
one is deleted, as with ``keep: 1``), restore with ``torch.load`` (page cache dropped) copied into the existing
tensors, and the host memory a save adds (``torch.save`` streams the tensors' storages into the zip file; it
needs no staging copy).
"""

from __future__ import annotations

import os
import time

import _common as c
import torch


def main() -> int:
    args = c.parse_args(__doc__.split("\n")[0])
    items = c.states.make(args.state, args.quick)
    out: dict = {"candidate": "torch_save", "state": args.state, "bytes": c.states.nbytes(items)}
    before, out["peak_reset"], sampler = c.open_memory_window()
    save_s, fsync_s, path = [], [], None
    for step in range(1 + args.warm):
        new = os.path.join(args.workdir, f"step_{step}.pt")
        s, _ = c.timed(lambda new=new: torch.save(items, new))
        save_s.append(s)
        fd = os.open(new, os.O_RDONLY)
        try:
            s, _ = c.timed(lambda fd=fd: os.fsync(fd))
        finally:
            os.close(fd)
        fsync_s.append(s)
        if path is not None:
            os.unlink(path)
        path = new
    peak = c.proc_status()
    out["memory"] = c.memory_report(before, peak, sampler.stop(), 0, 0)
    out["save_s"], out["fsync_s"] = save_s, fsync_s
    out["durable_total_s"] = [a + b for a, b in zip(save_s, fsync_s, strict=True)]
    disk_s, disk_load_s = [], []
    for i in range(2):
        c.drop_cache(args.workdir)
        t0 = time.perf_counter()
        loaded = torch.load(path, weights_only=False)  # our own file (args is an argparse.Namespace)
        t1 = time.perf_counter()
        c.copy_into(items, loaded)
        disk_s.append(time.perf_counter() - t0)
        disk_load_s.append(t1 - t0)
        if i == 0:
            assert c.same_tensors(items, loaded)
        del loaded
        c.settle()
    out["restore_disk_s"], out["restore_disk_load_part_s"] = disk_s, disk_load_s
    c.write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
