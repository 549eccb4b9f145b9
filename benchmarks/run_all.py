"""``make bench``: tiered_ckpt against its peers and this machine's limits, in one run, on the same states.

For each state (``states.py``: 1 GiB in 8 fp32 tensors; a Megatron-shaped 1.97 GiB rank) and each round, it
measures the machine's limits (``limits.py``: copy into pre-faulted memory, write+fsync, read) and runs every
candidate in a process of its own (``peers/``), in an order rotated each round so that drift on a shared
machine spreads over all of them:

* ``ours``: tiered_ckpt's CheckpointEngine, tiers shm (2 slots) + local disk, drain in its own process;
* ``torch_save``: ``torch.save`` + ``fsync``;
* ``dcp``: ``torch.distributed.checkpoint.save`` and ``async_save`` (blocking part and total);
* ``dlrover``: DLRover's flash checkpoint (``DdpCheckpointer``), from its own virtual environment
  ``benchmarks/.peers-venv`` (created here on first use: ``dlrover==0.6.1`` and ``grpcio`` from the package index;
  torch is this environment's, made visible to it, so both run the same torch). Skipped with a message when it
  cannot be installed.

It prints a table per state (rows: measurements; columns: each candidate, the machine limit, the ratio a target
is judged on and MET/MISSED) with the spread of every median, and writes everything as JSON.

    python benchmarks/run_all.py [--quick] [--rounds N] [--states fp32_1g,megatron_2g]
                                 [--candidates ours,torch_save,dcp,dlrover] [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEERS = BENCH / "peers"
PEER_VENV = BENCH / ".peers-venv"
DLROVER_SPEC = ["dlrover==0.6.1", "grpcio"]
CANDIDATES = ["ours", "torch_save", "dcp", "dlrover"]
SCRIPTS = {"ours": "ours.py", "torch_save": "torch_save.py", "dcp": "dcp.py", "dlrover": "dlrover_flash.py"}
WARM = {"ours": 3, "torch_save": 1, "dcp": 1, "dlrover": 8}
WARM_BY_STATE = {("ours", "megatron_2g"): 2}  # its drains take ~10 s each here: fewer, to bound the run time
MIB = 1 << 20
# Rounds per state by default: the 1 GiB state carries the comparisons with DLRover and gets two; the 2 GiB one
# takes twice as long per round and gets one, to stay within about ten minutes on two cores.
ROUNDS = {"fp32_1g": 2, "megatron_2g": 1}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- DLRover's environment ------------------------------------------------------------------------------------
def peer_python() -> tuple[str | None, str]:
    """The DLRover environment's Python (created and installed on first use), or None and why not."""
    import torch

    py = PEER_VENV / "bin" / "python"
    torch_site = str(Path(torch.__file__).resolve().parents[1])
    stamp = PEER_VENV / ".installed"
    want = json.dumps({"spec": DLROVER_SPEC, "torch_site": torch_site, "python": platform.python_version()})
    if stamp.exists() and stamp.read_text() == want and py.exists():
        return str(py), "DLRover environment ready"
    log(f"setting up DLRover's environment in {PEER_VENV} (pip install {' '.join(DLROVER_SPEC)}) ...")
    try:
        if PEER_VENV.exists():
            shutil.rmtree(PEER_VENV)
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True, capture_output=True, timeout=300)
        # Fail fast without a network: a short timeout and one retry instead of pip's minutes of retries.
        r = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--retries", "1", "--timeout", "30",
                            *DLROVER_SPEC], capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            return None, f"pip install {' '.join(DLROVER_SPEC)} failed: {' | '.join(tail)}"
        # torch is not installed there (a fresh resolve could pull a multi-GB CUDA build): this environment's
        # site-packages is appended to its path, after its own packages, so DLRover runs on the same torch.
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        Path(site, "zz_tiered_ckpt_bench_torch.pth").write_text(torch_site + "\n")
        r = subprocess.run([str(py), "-W", "ignore", "-c",
                            "import torch, dlrover.trainer.torch.flash_checkpoint.ddp"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            return None, f"DLRover does not import: {r.stderr.strip().splitlines()[-1:]}"
        stamp.write_text(want)
        return str(py), "DLRover environment installed"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot create DLRover's environment: {exc}"


# ----- one measurement process ----------------------------------------------------------------------------------
def run_one(name: str, cmd: list[str], workdir: str, out: str, timeout: float) -> dict[str, Any]:
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    logfile = os.path.join(os.path.dirname(out), f"{Path(out).stem}.log")
    try:
        with open(logfile, "w") as lf:
            r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout, cwd=str(REPO))
        ok = r.returncode == 0 and os.path.exists(out)
        error = None if ok else f"exit code {r.returncode}: {_tail(logfile)}"
    except subprocess.TimeoutExpired:
        ok, error = False, f"timed out after {timeout:.0f} s: {_tail(logfile)}"
    wall = time.perf_counter() - t0
    shutil.rmtree(workdir, ignore_errors=True)
    log(f"    {name:<11} {'ok' if ok else 'FAILED'} in {wall:5.1f} s" + ("" if ok else f"  ({error})"))
    if not ok:
        return {"error": error, "wall_s": wall, "log_tail": _tail(logfile, 40).split(" | ")}
    result = json.loads(Path(out).read_text())
    result["wall_s"] = wall
    return result


def _tail(path: str, n: int = 3) -> str:
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


# ----- statistics -----------------------------------------------------------------------------------------------
def stat(samples: list[float]) -> dict[str, Any] | None:
    samples = [float(s) for s in samples if s is not None]
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples),
            "samples": samples}


def gather(runs: list[dict], pick) -> list[float]:
    out: list[float] = []
    for r in runs:
        if "error" in r:
            continue
        try:
            v = pick(r)
        except (KeyError, IndexError, TypeError):
            continue
        out.extend(v if isinstance(v, list) else [v])
    return out


# Rows: (key, label, unit, {column: picker}, limit key). Columns: ours, torch_save, dcp_save, dcp_async, dlrover.
COLUMNS = ["ours", "torch_save", "dcp_save", "dcp_async", "dlrover"]
ROWS: list[tuple[str, str, str, dict[str, Any], str | None]] = [
    ("prepare", "prepare(): allocate + pre-fault the slots", "s", {"ours": lambda r: r["prepare_s"]}, None),
    ("first", "save() blocking, first", "s", {
        "ours": lambda r: r["first_s"], "torch_save": lambda r: r["durable_total_s"][0],
        "dcp_save": lambda r: r["save_s"][0], "dcp_async": lambda r: r["async_blocking_s"][0],
        "dlrover": lambda r: r["first_s"]}, None),
    ("first_no_prepare", "save() blocking, first, no prepare()", "s", {"ours": lambda r: r["first_no_prepare_s"]},
     None),
    ("warm", "save() blocking, warm", "s", {
        "ours": lambda r: r["warm_s"] + r["warm_series_s"], "torch_save": lambda r: r["durable_total_s"][1:],
        "dcp_save": lambda r: r["save_s"][1:], "dcp_async": lambda r: r["async_blocking_s"][1:],
        "dlrover": lambda r: r["warm_s"]}, "copy"),
    ("durable_total", "save() call -> durable on local disk", "s", {
        "ours": lambda r: r["durable_total_s"], "torch_save": lambda r: r["durable_total_s"][1:],
        "dcp_save": lambda r: r["save_s"][1:], "dcp_async": lambda r: r["async_total_s"][1:],
        "dlrover": lambda r: r["durable_total_s"]}, None),
    ("durable_after", "save() return -> durable (background)", "s", {
        "ours": lambda r: r["durable_after_s"],
        "dcp_async": lambda r: [t - b for t, b in zip(r["async_total_s"][1:], r["async_blocking_s"][1:],
                                                      strict=True)],
        "dlrover": lambda r: r["durable_after_s"]}, "write_fsync"),
    ("restore_shm", "restore shm into the model's tensors", "s", {
        "ours": lambda r: r["restore_shm_into_s"], "dlrover": lambda r: r["restore_shm_views_copy_s"]},
     "copy_out"),
    ("restore_shm_views", "  ours: load(copy=False) views + copy_", "s", {
        "ours": lambda r: r["restore_shm_views_copy_s"]}, "copy_out"),
    ("restore_shm_load", "    of which load(copy=False): verify, views", "s", {
        "ours": lambda r: r["restore_shm_views_load_part_s"], "dlrover": lambda r: r["restore_shm_views_load_part_s"]},
     None),
    ("restore_shm_fresh", "restore shm: load(copy=True), new memory", "s", {
        "ours": lambda r: r["restore_shm_fresh_s"]}, "copy_out"),
    ("restore_disk", "restore local disk -> model tensors", "s", {
        "ours": lambda r: r["restore_disk_s"], "torch_save": lambda r: r["restore_disk_s"],
        "dcp_save": lambda r: r["restore_disk_s"], "dlrover": lambda r: r["restore_disk_s"]}, "read"),
    ("peak_rss", "peak RSS of the training process", "MiB", {
        "ours": lambda r: r["memory"]["peak_rss_mib"], "torch_save": lambda r: r["memory"]["peak_rss_mib"],
        "dcp_save": lambda r: r["memory_save"]["peak_rss_mib"],
        "dcp_async": lambda r: r["memory_async"]["peak_rss_mib"], "dlrover": lambda r: r["memory"]["peak_rss_mib"]},
     None),
    ("slots", "slots / staging memory held", "MiB", {
        "ours": lambda r: r["memory"]["slot_mib"], "torch_save": lambda r: r["memory"]["slot_mib"],
        "dcp_save": lambda r: r["memory_save"]["slot_mib"], "dcp_async": lambda r: r["memory_async"]["slot_mib"],
        "dlrover": lambda r: r["memory"]["slot_mib"]}, None),
    ("extra_mem", "host memory added beyond the slots", "MiB", {
        "ours": lambda r: r["memory"]["extra_total_mib"], "torch_save": lambda r: r["memory"]["extra_total_mib"],
        "dcp_save": lambda r: r["memory_save"]["extra_total_mib"],
        "dcp_async": lambda r: r["memory_async"]["extra_total_mib"],
        "dlrover": lambda r: r["memory"]["extra_total_mib"]}, None),
]
SOURCE = {"ours": "ours", "torch_save": "torch_save", "dcp_save": "dcp", "dcp_async": "dcp", "dlrover": "dlrover"}
# The machine's limits, measured in ours' processes alternately with it (see peers/ours.py), and in DLRover's.
LIMIT_ROWS = [("copy", "limit: copy_ into pre-faulted memory"), ("copy_out", "limit: copy_ out of it into tensors"),
              ("write_fsync", "limit: write + fsync"), ("read", "limit: read (page cache dropped)")]
LIMIT_KEYS = {"copy": "limit_copy_s", "copy_out": "limit_copy_out_s", "write_fsync": "limit_write_fsync_s",
              "read": "limit_read_s"}
MEM_TOLERANCE_MIB = 16  # allocator and interpreter noise allowed on top of the slots


def aggregate(state_runs: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for key, _label, _unit, pickers, _limit in ROWS:
        rows[key] = {col: stat(gather(state_runs["candidates"].get(SOURCE[col], []), pick))
                     for col, pick in pickers.items()}
    ours, dl = state_runs["candidates"].get("ours", []), state_runs["candidates"].get("dlrover", [])
    limits = {k: stat(gather(ours, lambda r, k=k: r[LIMIT_KEYS[k]])) for k, _ in LIMIT_ROWS}
    limits_dlrover = {k: stat(gather(dl, lambda r, k=k: r[LIMIT_KEYS[k]])) for k, _ in LIMIT_ROWS}
    return {"rows": rows, "limits": limits, "limits_dlrover_process": limits_dlrover}


def med(x: dict[str, Any] | None) -> float | None:
    return None if x is None else x["median"]


def targets(agg: dict[str, Any], skipped: dict[str, str]) -> list[dict[str, Any]]:
    rows, lim = agg["rows"], agg["limits"]
    r = {k: {c: med(v) for c, v in cols.items()} for k, cols in rows.items()}
    copy_s, copy_out_s, write_s = med(lim["copy"]), med(lim["copy_out"]), med(lim["write_fsync"])
    dl_why = skipped.get("dlrover", "DLRover did not run")
    out = []

    def add(row: str, what: str, ratio: float | None, ok: bool | None, why: str = "", short: str = "") -> None:
        out.append({"row": row, "target": what, "ratio": ratio, "met": ok, "note": why, "short": short})

    ours_warm, dl_warm = r["warm"].get("ours"), r["warm"].get("dlrover")
    if ours_warm and dl_warm:
        add("warm", "warm blocking <= DLRover's warm save_to_memory (ours / DLRover <= 1)", ours_warm / dl_warm,
            ours_warm <= dl_warm)
    else:
        add("warm", "warm blocking <= DLRover's warm save_to_memory", None, None, dl_why)
    if ours_warm and copy_s:
        ratio = copy_s / ours_warm
        add("warm", "warm blocking >= 0.85x memcpy bandwidth (copy_ s / ours s >= 0.85)", ratio, ratio >= 0.85,
            short="vs memcpy limit (>= 0.85)")
        dl_copy = med(agg["limits_dlrover_process"]["copy"])
        if dl_warm and dl_copy:
            add("warm", "(each against the memcpy limit paired in its own process: (ours/limit) / (DLRover/limit))",
                (ours_warm / copy_s) / (dl_warm / dl_copy), None, short="vs DLRover, each / own memcpy")
    ours_first, dl_first = r["first"].get("ours"), r["first"].get("dlrover")
    if ours_first and dl_first:
        add("first", "first save <= 0.25x DLRover's first (ours / DLRover <= 0.25)", ours_first / dl_first,
            ours_first <= 0.25 * dl_first)
        nop = r["first_no_prepare"].get("ours")
        if nop:
            add("first_no_prepare", "(same, without prepare(): not the target, for information)", nop / dl_first,
                nop <= 0.25 * dl_first, short="vs DLRover first (info)")
    else:
        add("first", "first save <= 0.25x DLRover's first", None, None, dl_why)
    after = r["durable_after"].get("ours")
    if after and write_s:
        ratio = write_s / after
        add("durable_after", "local durability >= 0.85x raw write+fsync bandwidth (raw s / ours s >= 0.85)", ratio,
            ratio >= 0.85)
        dl_after, dl_write = r["durable_after"].get("dlrover"), med(agg["limits_dlrover_process"]["write_fsync"])
        if dl_after and dl_write:
            add("durable_after", "(DLRover on the same measure, for information)", dl_write / dl_after, None,
                short="DLRover on this measure")
    shm = r["restore_shm"].get("ours")
    if shm and copy_out_s:
        ratio = copy_out_s / shm
        add("restore_shm", "restore from shm >= 0.8x memcpy (load(into=model), verified; copy_ s / ours s)",
            ratio, ratio >= 0.8)
    views = r["restore_shm_views"].get("ours")
    if views and copy_out_s:
        add("restore_shm_views", "(load(copy=False) + copy_ into the model on the same measure, for information)",
            copy_out_s / views, None)
    fresh = r["restore_shm_fresh"].get("ours")
    if fresh and copy_out_s:
        add("restore_shm_fresh", "(load(copy=True) into new memory on the same measure, for information)",
            copy_out_s / fresh, None)
    slots, extra = r["slots"].get("ours"), r["extra_mem"].get("ours")
    if slots is not None and extra is not None:
        add("extra_mem", f"host memory added by saves <= the slots (extra beyond slots <= {MEM_TOLERANCE_MIB} MiB)",
            (slots + extra) / slots if slots else None, extra <= MEM_TOLERANCE_MIB)
    return out


# ----- the table ------------------------------------------------------------------------------------------------
def fmt(x: dict[str, Any] | None, unit: str) -> str:
    if x is None:
        return "-"
    v = x["median"]
    if unit == "MiB":
        return f"{v:.0f}"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}"


def spread(x: dict[str, Any] | None, unit: str) -> str:
    if x is None or x["n"] < 2:
        return ""
    if unit == "MiB":
        return f"{x['min']:.0f}-{x['max']:.0f}"
    return f"{x['min']:.3f}-{x['max']:.3f}"


def table(state: str, info: dict[str, Any], agg: dict[str, Any], tg: list[dict[str, Any]]) -> str:
    gib = info["bytes"] / 2**30
    lim = agg["limits"]
    head = ["measurement", "unit", *COLUMNS, "limit", "ratio", "target"]
    lines = [f"### {state}: {info['description']} ({gib:.2f} GiB), {info['rounds']} round(s); "
             "medians (spread: min-max of all samples below)", ""]
    by_row: dict[str, list[dict[str, Any]]] = {}
    for t in tg:
        by_row.setdefault(t["row"], []).append(t)
    body = []
    for key, label, unit, _p, limit in ROWS:
        cols = agg["rows"][key]
        verdicts = [t for t in by_row.get(key, []) if t["met"] is not None or t["ratio"] is not None]
        main = verdicts[0] if verdicts else None
        ratio = "" if not main or main["ratio"] is None else f"{main['ratio']:.2f}"
        verdict = "" if not main else ("n/a" if main["met"] is None and main["ratio"] is None else
                                       ("info" if main["met"] is None else ("MET" if main["met"] else "MISSED")))
        body.append([label, unit, *[fmt(cols.get(c), unit) for c in COLUMNS],
                     fmt(lim.get(limit), "s") if limit else "", ratio, verdict])
        for extra in verdicts[1:]:
            body.append(["  " + (extra["short"] or extra["target"][:40]), "", *[""] * len(COLUMNS), "",
                         "" if extra["ratio"] is None else f"{extra['ratio']:.2f}",
                         "info" if extra["met"] is None else ("MET" if extra["met"] else "MISSED")])
    for key, label in LIMIT_ROWS:
        x = lim.get(key)
        bw = "" if x is None else f"{info['bytes'] / x['median'] / 1e9:.2f} GB/s"
        body.append([label, "s", *[""] * len(COLUMNS), fmt(x, "s"), "", bw])
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    fmt_row = lambda row: "| " + " | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    lines.append(fmt_row(head))
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [fmt_row(row) for row in body]
    lines += ["", "Targets:"]
    for t in tg:
        verdict = "n/a   " if t["met"] is None and t["ratio"] is None else (
            "info  " if t["met"] is None else ("MET   " if t["met"] else "MISSED"))
        ratio = "" if t["ratio"] is None else f" ratio {t['ratio']:.2f}"
        lines.append(f"  {verdict} {t['target']}{ratio}{(' - ' + t['note']) if t['note'] else ''}")
    lines += ["", "Spread (min-max over all samples; n per cell in the JSON):"]
    for key, label, unit, _p, _l in ROWS:
        cells = [f"{c} {spread(agg['rows'][key].get(c), unit)}" for c in COLUMNS if spread(agg["rows"][key].get(c),
                                                                                            unit)]
        if cells:
            lines.append(f"  {label}: " + "; ".join(cells))
    for key, label in LIMIT_ROWS:
        if spread(lim.get(key), "s"):
            lines.append(f"  {label}: {spread(lim.get(key), 's')}")
    return "\n".join(lines)


# ----- main -----------------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import torch

    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller states (256 MiB and 0.49 GiB), one round")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per state (default: fp32_1g 2, megatron_2g 1; --quick: 1)")
    ap.add_argument("--states", default="fp32_1g,megatron_2g")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--dir", default=None, help="local-disk directory for the runs (default: a temp dir)")
    ap.add_argument("--json", default=None, help="default benchmarks/results/bench[-quick].json")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement process")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(BENCH))
    import states

    rounds = {name: args.rounds or (1 if args.quick else ROUNDS.get(name, 1)) for name in states.STATES}
    state_names = [s for s in args.states.split(",") if s]
    candidates = [c for c in args.candidates.split(",") if c]
    for name in state_names:
        if name not in states.STATES:
            ap.error(f"unknown state {name!r} (known: {', '.join(states.STATES)})")
    for cand in candidates:
        if cand not in SCRIPTS:
            ap.error(f"unknown candidate {cand!r} (known: {', '.join(SCRIPTS)})")
    json_path = Path(args.json) if args.json else BENCH / "results" / f"bench{'-quick' if args.quick else ''}.json"

    skipped: dict[str, str] = {}
    pythons = {c: sys.executable for c in candidates}
    if "dlrover" in candidates:
        py, why = peer_python()
        log(why if py else f"DLRover skipped: {why}")
        if py:
            pythons["dlrover"] = py
        else:
            skipped["dlrover"] = why
            candidates.remove("dlrover")

    root = tempfile.mkdtemp(prefix="tiered_ckpt_bench_", dir=args.dir)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": args.quick,
                 "rounds": {n: rounds[n] for n in state_names}, "machine": machine(), "disk_dir": root,
                 "skipped": skipped,
                 "dlrover_spec": DLROVER_SPEC, "mem_tolerance_mib": MEM_TOLERANCE_MIB},
        "states": {},
    }
    try:
        for name in state_names:
            if name == "megatron_2g":
                log("megatron_2g: making (or reading) the cached state ...")
                states.make(name, args.quick)  # generate the cache once, outside every timed process
            results["states"][name] = {"description": states.describe(name, args.quick), "rounds": rounds[name],
                                       "candidates": {c: [] for c in candidates}}
        for rnd in range(max(rounds.values())):
            for name in state_names:
                if rnd >= rounds[name]:
                    continue
                entry = results["states"][name]
                log(f"round {rnd + 1}/{rounds[name]}, {name}:")
                tag = f"{name}-r{rnd}"
                order = candidates[rnd % len(candidates):] + candidates[:rnd % len(candidates)]
                for cand in order:
                    out = os.path.join(root, f"{tag}-{cand}.json")
                    workdir = os.path.join(root, f"{tag}-{cand}")
                    cmd = [pythons[cand], "-W", "ignore", str(PEERS / SCRIPTS[cand]), "--state", name,
                           "--workdir", workdir, "--warm", str(WARM_BY_STATE.get((cand, name), WARM[cand])),
                           "--out", out,
                           *(["--quick"] if args.quick else [])]
                    res = run_one(cand, cmd, workdir, out, args.timeout)
                    if "error" in res and cand != "ours":  # a peer that failed to start (e.g. DLRover's
                        first_error = res                  # socket handshake timing out): one more try
                        res = run_one(cand, cmd, workdir, out, args.timeout)
                        res["retried_after"] = first_error
                    entry["candidates"][cand].append(res)
                    entry.setdefault("bytes", entry["candidates"][cand][-1].get("bytes"))
        tables = []
        for name in state_names:
            entry = results["states"][name]
            if entry.get("bytes") is None:
                entry["bytes"] = states.nbytes(states.make(name, args.quick))
            agg = aggregate(entry)
            entry["aggregate"] = agg
            entry["targets"] = targets(agg, skipped)
            tables.append(table(name, entry, agg, entry["targets"]))
        results["meta"]["wall_s"] = time.perf_counter() - started
        text = "\n\n".join(tables)
        head = (f"tiered_ckpt benchmarks, {results['meta']['date']}: {results['meta']['machine']}, "
                f"{results['meta']['wall_s']:.0f} s")
        if skipped:
            head += "\n" + "\n".join(f"skipped {k}: {v}" for k, v in skipped.items())
        results["table"] = head + "\n\n" + text
        print(results["table"])
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
        os.replace(tmp, json_path)
        log(f"\nwrote {json_path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # Our own candidate failing is an error; a peer failing is reported in the table and the JSON.
    ours_failed = any("error" in r for e in results["states"].values() for r in e["candidates"].get("ours", []))
    return 1 if ours_failed else 0


if __name__ == "__main__":
    sys.exit(main())
