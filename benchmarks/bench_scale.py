"""How save() blocking, time to durable and restore scale with the state: 0.25, 1, 4 GiB, 10,000 small tensors.

Each case runs in a process of its own (``--case``: peak memory never mixes, and a 4 GiB case frees everything
when it ends): a CheckpointEngine with tiers ``shm`` (2 slots) + ``local`` (``keep: 1``, ``O_DIRECT``, drain
in its own process), ``prepare()``, one save not counted, then ``--warm`` saves, each after the previous one was
durable, each followed by the two ceilings under the same load: the all-core copy into pre-faulted shm
(``CopyBaseline``: the fastest of ``copy_``, the bytes split over torch's threads, and the same streamed) and an
``O_DIRECT`` write+fsync of the same bytes (``limits.DirectIO``, with the disk's best request depth). Then ``--warm``
restores from shm, ``load(into=state)`` (verified, into the state's own tensors), each followed by the copy
ceiling the other way (``CopyBaseline.copy_out``: the bytes from pre-faulted shm into the same tensors).

Prints one row per case (medians: blocking s, GB/s, ceiling / ours; save() call -> durable s, GB/s,
O_DIRECT ceiling / ours; how many timed saves waited for a free slot, and for how long in all; restore s,
copy-out ceiling s, ceiling / ours) and writes the
JSON; with matplotlib installed it also draws the curves as a PNG
(``--plot``; matplotlib, the ``bench`` extra that ``make bench`` installs, is not a dependency of the package:
without it the table is the result).

    python benchmarks/bench_scale.py [--quick] [--cases 0.25g,1g,4g,small10k,views10k] [--warm 5] [--dir DIR]
                                     [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))

GiB, MiB = 1 << 30, 1 << 20
# case → (full bytes, quick bytes, tensor count); "small10k": 10,000 fp32 tensors of 32 KiB (quick: 4 KiB);
# "views10k": the same sizes as views of one flat buffer (parameters kept in one contiguous buffer)
CASES: dict[str, tuple[int, int, int]] = {
    "0.25g": (GiB // 4, 16 * MiB, 8), "1g": (GiB, 64 * MiB, 8), "4g": (4 * GiB, 256 * MiB, 8),
    "small10k": (10_000 * 32 * 1024, 10_000 * 4 * 1024, 10_000),
    "views10k": (10_000 * 32 * 1024, 10_000 * 4 * 1024, 10_000),
}


def make_items(case: str, quick: bool) -> dict[str, Any]:
    import torch

    full, small, count = CASES[case]
    per = (small if quick else full) // count // 4  # fp32 elements per tensor
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(min(per, 1 << 22), generator=gen)
    out = {}
    flat = torch.empty(per * count) if case == "views10k" else None
    for i in range(count):
        t = torch.empty(per) if flat is None else flat[i * per:(i + 1) * per]
        for a in range(0, per, block.numel()):  # distinct values per tensor, at memory speed
            n = min(block.numel(), per - a)
            torch.mul(block[:n], 1.0 + 1e-4 * i, out=t[a:a + n])
        out[f"t{i:05d}"] = t
    return {"state": out}


# ----- one case, in its own process ---------------------------------------------------------------------------
def run_case(case: str, quick: bool, warm: int, workdir: str, out: str) -> None:
    import _common as c

    from tiered_ckpt import CheckpointEngine, hookimpl
    from tiered_ckpt.plugins import get_plugin_manager

    class Commits:
        def __init__(self) -> None:
            self.seconds: dict[int, float] = {}
            self.slot_wait: dict[int, float] = {}

        @hookimpl
        def tiered_ckpt_on_event(self, event):
            if event.kind == "commit" and event.tier == "local":
                self.seconds[event.step] = event.seconds
            elif event.kind == "slot_wait":  # save() found no free slot and waited (part of its blocking time)
                self.slot_wait[event.step] = event.seconds

    items = make_items(case, quick)
    tensors = c.states.tensors(items)
    nbytes = c.states.nbytes(items)
    shm = tempfile.mkdtemp(prefix="bench_scale_", dir="/dev/shm")
    commits, pm = Commits(), get_plugin_manager()
    pm.register(commits)
    res: dict[str, Any] = {"case": case, "bytes": nbytes, "tensors": len(tensors)}
    try:
        baseline = c.CopyBaseline(tensors)
        direct, io = c.direct_io(tensors, os.path.join(workdir, "raw"))
        res["io_threads"] = io
        cfg = {"run_id": f"scale-{uuid.uuid4().hex[:8]}", "layout": "rank_sharded",
               "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 2},
                         {"name": "local", "kind": "local", "path": os.path.join(workdir, "ckpt"), "keep": 1}]}
        with CheckpointEngine(cfg) as engine:
            res["prepare_s"], _ = c.timed(lambda: engine.prepare(items))
            engine.save(1, items).wait()
            blocking, durable, write_s = [], [], []
            for step in range(2, 2 + warm):
                c.drop_cache(workdir)
                h = engine.save(step, items)
                h.wait()
                engine.wait()  # retention's deletions too (after the handle): the limits below run quiet
                blocking.append(h.blocking_s)
                durable.append(h.blocking_s + commits.seconds[step])
                baseline.copy_in()
                c.drop_cache(workdir)
                write_s.append(direct.write_fsync(io["write"]))
            restore_s = []
            for _ in range(warm):  # restore from shm into the state's own tensors, verified
                t0 = time.perf_counter()
                got = engine.load(into=items)
                restore_s.append(time.perf_counter() - t0)
                if got.tier != "shm" or not got.verified:
                    raise SystemExit(f"{case}: restored from {got.tier!r}, verified={got.verified}")
                del got
                baseline.copy_out()
        res.update(blocking_s=blocking, durable_s=durable, limit_direct_write_s=write_s, restore_s=restore_s,
                   limit_copy_ways=baseline.report(),
                   slot_wait_s={str(k): v for k, v in commits.slot_wait.items() if k >= 2})
        baseline.close()
        direct.close()
    finally:
        pm.unregister(commits)
        shutil.rmtree(shm, ignore_errors=True)
    c.write_result(out, res)


# ----- the parent -------------------------------------------------------------------------------------------------
def summarize(res: dict[str, Any]) -> dict[str, Any]:
    ways = {w: statistics.median(v) for w, v in res["limit_copy_ways"]["in"].items() if v}
    way = min(ways, key=ways.__getitem__)
    blk, dur = statistics.median(res["blocking_s"]), statistics.median(res["durable_s"])
    wr = statistics.median(res["limit_direct_write_s"])
    n = res["bytes"]
    out_ways = {w: statistics.median(v) for w, v in res["limit_copy_ways"].get("out", {}).items() if v}
    restore = {}
    if res.get("restore_s") and out_ways:
        rs, out_way = statistics.median(res["restore_s"]), min(out_ways, key=out_ways.__getitem__)
        restore = {"restore_s": rs, "copy_out_s": out_ways[out_way], "copy_out_way": out_way,
                   "restore_vs_ceiling": out_ways[out_way] / rs}
    return {**restore, "case": res["case"], "bytes": n, "tensors": res["tensors"], "blocking_s": blk,
            "blocking_max_s": max(res["blocking_s"]), "blocking_gbps": n / blk / 1e9, "copy_ceiling_s": ways[way],
            "copy_way": way, "blocking_vs_ceiling": ways[way] / blk, "durable_s": dur, "durable_gbps": n / dur / 1e9,
            "direct_write_s": wr, "durable_vs_ceiling": wr / dur,
            "slot_waits": len(res.get("slot_wait_s", {})), "slot_wait_s": sum(res.get("slot_wait_s", {}).values())}


def table(rows: list[dict[str, Any]], quick: bool) -> str:
    head = ["state", "tensors", "blocking s", "GB/s", "copy ceiling s", "ceiling/ours", "durable s", "GB/s",
            "O_DIRECT s", "ceiling/ours", "slot waits", "restore s", "copy-out ceiling s", "ceiling/ours"]
    body = []
    for r in rows:
        size = f"{r['bytes'] / GiB:.2f} GiB" if r["bytes"] >= GiB // 8 else f"{r['bytes'] / MiB:.0f} MiB"
        body.append([f"{size} ({r['case']} case)" if quick else size, r["tensors"], f"{r['blocking_s']:.3f}",
                     f"{r['blocking_gbps']:.2f}",
                     f"{r['copy_ceiling_s']:.3f} ({r['copy_way']})", f"{r['blocking_vs_ceiling']:.2f}",
                     f"{r['durable_s']:.3f}", f"{r['durable_gbps']:.2f}", f"{r['direct_write_s']:.3f}",
                     f"{r['durable_vs_ceiling']:.2f}", f"{r['slot_waits']} ({r['slot_wait_s']:.3f} s)",
                     *([f"{r['restore_s']:.3f}", f"{r['copy_out_s']:.3f} ({r['copy_out_way']})",
                        f"{r['restore_vs_ceiling']:.2f}"] if "restore_s" in r else ["-", "-", "-"])])
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([f"### Scale: blocking and time to durable against the state's size"
                      f"{' (quick sizes)' if quick else ''}; medians", "", line(head),
                      "|" + "|".join("-" * (w + 2) for w in widths) + "|", *[line(b) for b in body]])


def plot(rows: list[dict[str, Any]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]'; the table above is the result)"
    curve = [r for r in rows if r["tensors"] < 1000]
    small = [r for r in rows if r["tensors"] >= 1000]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("blocking_s", "copy_ceiling_s", "save() blocking", "copy ceiling (all cores)"),
              ("durable_s", "direct_write_s", "save() call -> durable", "O_DIRECT write + fsync ceiling"))
    for i, (key, ceiling, title, ceiling_label) in enumerate(panels):
        x = [r["bytes"] / GiB for r in curve]
        ax[i].plot(x, [r[key] for r in curve], "o-", label="tiered_ckpt (8 tensors)")
        ax[i].plot(x, [r[ceiling] for r in curve], "s--", label=ceiling_label)
        for r in small:
            ax[i].plot([r["bytes"] / GiB], [r[key]], "x", markersize=10, label=f"{r['tensors']} tensors ({r['case']})")
        ax[i].set(xscale="log", yscale="log", xlabel="state (GiB)", ylabel="seconds", title=title)
        ax[i].set_xticks(x, [f"{v:.3g}" for v in x])
        ax[i].xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax[i].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16, 64, 256 MiB and 10,000 x 4 KiB")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--dir", default=None, help="local-disk directory (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: beside --json, when matplotlib is there)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        run_case(args.case, args.quick, args.warm, args.workdir, args.out)
        return 0
    cases = [x for x in args.cases.split(",") if x]
    for x in cases:
        if x not in CASES:
            ap.error(f"unknown case {x!r} (known: {', '.join(CASES)})")
    root = tempfile.mkdtemp(prefix="tiered_ckpt_scale_", dir=args.dir)
    raw, rows, errors = [], [], {}
    try:
        for case in cases:
            out, work = os.path.join(root, f"{case}.json"), os.path.join(root, case)
            os.makedirs(work)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-W", "ignore", __file__, "--case", case, "--warm", str(args.warm),
                                "--workdir", work, "--out", out, *(["--quick"] if args.quick else [])],
                               capture_output=True, text=True, timeout=args.timeout)
            shutil.rmtree(work, ignore_errors=True)
            if r.returncode != 0 or not os.path.exists(out):
                tail = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()][-3:]
                errors[case] = f"exit {r.returncode}: {' | '.join(tail)}"
                print(f"  {case}: FAILED ({errors[case]})", file=sys.stderr, flush=True)
                continue
            print(f"  {case}: ok in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            res = json.loads(Path(out).read_text())
            raw.append(res)
            rows.append(summarize(res))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = table(rows, args.quick) + "".join(f"\n  {k}: FAILED {v}" for k, v in errors.items())
    png = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png and rows:
        text += "\n\n" + plot(rows, png)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"quick": args.quick, "rows": rows, "runs": raw, "errors": errors,
                                               "table": text}, indent=1) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
