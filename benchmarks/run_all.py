"""``make bench``: tiered_ckpt against its peers and this machine's limits, in one run, on the same states.

For each state (``states.py``: 1 GiB in 8 fp32 tensors; a Megatron-shaped 1.97 GiB rank) and each round, it
runs every candidate in a process of its own (``peers/``), in an order rotated each round so that drift on a
shared machine spreads over all of them, each measuring the machine's physical ceilings next to itself
(``limits.py``: the all-core copy into pre-faulted memory, O_DIRECT write+fsync and read):

* ``ours``: tiered_ckpt's CheckpointEngine, tiers shm (2 slots) + local disk, drain in its own process;
* ``torch_save``: ``torch.save`` + ``fsync``;
* ``dcp``: ``torch.distributed.checkpoint.save`` and ``async_save`` (blocking part and total);
* ``dlrover``: DLRover's flash checkpoint (``DdpCheckpointer``), from its own virtual environment
  ``benchmarks/.peers-venv`` (created here on first use: ``dlrover==0.6.1`` and ``grpcio`` from the package index;
  torch is this environment's, made visible to it, so both run the same torch). Skipped with a message when it
  cannot be installed.

It prints a table per state (rows: measurements; columns: each candidate, the machine's physical ceiling, the
ratio a target is judged on and MET/MISSED; ``report.py``) with the spread of every median, then the other
sections, each a script of its own: ``layouts`` (bench_layouts.py: a multi-rank Megatron-shaped job, layouts
``rank_sharded`` and ``megatron`` side by side, against the O_DIRECT ceiling), ``layouts_s3`` (the same script
with ``--tier s3``: both layouts on moto against every rank's raw parallel PUT), ``s3`` (bench_s3_save.py: save and
restore through S3 against the raw parallel PUT/GET ceiling, with DCP's fsspec writer and s3torchconnector) and
``scale`` (bench_scale.py: 0.25, 1, 4 GiB and 10,000 small tensors). Everything goes to one JSON.

    python benchmarks/run_all.py [--quick] [--rounds N] [--states fp32_1g,megatron_2g]
                                 [--candidates ours,torch_save,dcp,dlrover]
                                 [--sections peers,layouts,layouts_s3,s3,scale] [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import MEM_TOLERANCE_MIB, aggregate, table, targets  # benchmarks/: the script's own directory

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEERS = BENCH / "peers"
PEER_VENV = BENCH / ".peers-venv"
DLROVER_SPEC = ["dlrover==0.6.1", "grpcio"]
CANDIDATES = ["ours", "torch_save", "dcp", "dlrover"]
SCRIPTS = {"ours": "ours.py", "torch_save": "torch_save.py", "dcp": "dcp.py", "dlrover": "dlrover_flash.py"}
WARM = {"ours": 5, "torch_save": 1, "dcp": 1, "dlrover": 8}  # ours: medians of >= 5 quiet warm saves
WARM_BY_STATE: dict[tuple[str, str], int] = {}
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


# ----- the other sections: each a script of its own, run in its own process --------------------------------------
SECTIONS = ["peers", "layouts", "layouts_s3", "s3", "scale"]
SECTION_SCRIPTS = {"layouts": "bench_layouts.py", "layouts_s3": "bench_layouts.py", "s3": "bench_s3_save.py",
                   "scale": "bench_scale.py"}


def run_section(name: str, quick: bool, root: str, disk_dir: str | None, timeout: float) -> dict[str, Any]:
    """Run one section's script (its own ``--quick`` when quick) and return its JSON, or {"error": ...}."""
    out = os.path.join(root, f"section-{name}.json")
    cmd = [sys.executable, "-W", "ignore", str(BENCH / SECTION_SCRIPTS[name]), "--json", out,
           *(["--quick"] if quick else [])]
    if name in ("layouts", "scale") and disk_dir:
        cmd += ["--dir", disk_dir]
    if name == "s3" and quick:
        cmd += ["--rounds", "1"]
    if name == "layouts_s3":  # both layouts on S3 (moto): the megatron one as the ranks' parts of one upload
        cmd += ["--tier", "s3", *([] if quick else ["--gib", "0.5", "--saves", "3"])]
    if name == "scale":
        cmd += ["--plot", str(BENCH / "results" / f"scale{'-quick' if quick else ''}.png")]
    log(f"section {name}: {' '.join(cmd[3:])}")
    logfile = os.path.join(root, f"section-{name}.log")
    t0 = time.perf_counter()
    try:
        with open(logfile, "w") as lf:
            r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout, cwd=str(REPO))
        error = None if r.returncode == 0 and os.path.exists(out) else f"exit code {r.returncode}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    log(f"    {name} {'ok' if error is None else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    if error is not None:
        return {"error": f"{error}: {_tail(logfile, 5)}", "table": f"### {name}: FAILED ({error}): {_tail(logfile)}"}
    return json.loads(Path(out).read_text())


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
    ap.add_argument("--section-timeout", type=float, default=3600.0, help="seconds per section (layouts, s3, scale)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="peers (the states' tables), layouts (multi-rank, both layouts), layouts_s3 (the same on "
                         "S3), s3, scale")
    args = ap.parse_args(argv)
    sections = [x for x in args.sections.split(",") if x]
    for sec in sections:
        if sec not in SECTIONS:
            ap.error(f"unknown section {sec!r} (known: {', '.join(SECTIONS)})")

    sys.path.insert(0, str(BENCH))
    import states

    rounds = {name: args.rounds or (1 if args.quick else ROUNDS.get(name, 1)) for name in states.STATES}
    state_names = [s for s in args.states.split(",") if s] if "peers" in sections else []
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
    if "dlrover" in candidates and state_names:
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
        "states": {}, "sections": {},
    }
    try:
        for name in state_names:
            if name == "megatron_2g":
                log("megatron_2g: making (or reading) the cached state ...")
                states.make(name, args.quick)  # generate the cache once, outside every timed process
            results["states"][name] = {"description": states.describe(name, args.quick), "rounds": rounds[name],
                                       "candidates": {c: [] for c in candidates}}
        for rnd in range(max(rounds.values()) if state_names else 0):
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
        for sec in sections:
            if sec != "peers":
                results["sections"][sec] = run_section(sec, args.quick, root, args.dir, args.section_timeout)
                tables.append(results["sections"][sec].get("table", ""))
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
    # Our own candidate or a section (each measures ours) failing is an error; a peer failing is reported in the
    # table and the JSON.
    ours_failed = any("error" in r for e in results["states"].values() for r in e["candidates"].get("ours", []))
    return 1 if ours_failed or any("error" in r for r in results["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
