"""The demo's conductor: a reference run, a run that loses a rank to SIGKILL, and the resumed run.

Like torchrun, it restarts the whole job when one rank dies. It then checks that every loss after the resume
equals the uninterrupted run's, bit for bit, and prints what each tier did.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from ..tiers.base import _user_name
from ..tiers.shm import ShmOptions
from . import SAVE_EVERY, default_kill_step, min_steps

# What the demo writes in its workdir: its tiers' configuration, the events log, the ranks' logs, the local and
# remote tiers' folders, and the shm tier's folder where there is no /dev/shm.
DEMO_ENTRIES = frozenset({"tiers.json", "events.jsonl", "logs", "local", "remote", "shm"})
_DEMO_TIERS = ["shm", "local", "remote"]
SHM_PATH = ShmOptions.path  # the shm tier's default path, where /dev/shm exists (else the workdir's shm folder)


class DemoFailed(RuntimeError):
    """The demo's job did not do what it shows: a rank failed, or it did not finish in time (its logs say why)."""


class WorkdirError(ValueError):
    """The demo's workdir cannot be used: it holds something the demo did not write (and would delete)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, spec: dict, logs: Path, *, timeout: float = 300) -> list[dict]:
    """Start ``world`` ranks; if one dies by a signal, stop the others (the job restarts as a whole).

    Each rank writes to files in ``logs``, not to pipes: a killed rank's drain worker lives on to finish its
    writes, and would hold a pipe open long after the job is gone."""
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    outputs = []
    try:
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            out, err = logs / f"rank_{rank}.out", logs / f"rank_{rank}.err"
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, "-m", "tiered_ckpt.demo.train", json.dumps(spec)],
                                              env=env, stdout=fo, stderr=fe))
            outputs.append((out, err))
        deadline = time.monotonic() + timeout
        while [p.poll() for p in procs].count(None):  # poll every rank, every time (no short-circuit)
            if any(p.returncode is not None and p.returncode < 0 for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)  # the rest of the job goes down with the failed node
            if time.monotonic() > deadline:
                raise DemoFailed(f"the demo job did not finish within {timeout:g} s (its logs: {logs})")
            time.sleep(0.05)
    except BaseException:
        # Timed out, interrupted (Ctrl-C) or failed here: the job goes down with its conductor (and is reaped)
        # before the caller removes the shared memory its ranks write to.
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        raise
    crashed = any(p.returncode == -signal.SIGKILL for p in procs)
    records = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        # After a rank's death the others fail in their next collective: expected, the job restarts.
        if p.returncode != 0 and not crashed:
            raise DemoFailed(f"rank {rank} failed (exit {p.returncode}):\n{err.read_text()[-3000:]}")
        records += [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    return records


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r.get("rank") == 0 and "loss" in r}


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tier_table(events: list[dict], order: list[str]) -> list[list[str]]:
    rows = []
    snaps = [e for e in events if e["kind"] == "snapshot"]
    for tier in order:
        if tier == order[0]:
            sel = snaps
            secs = [e["seconds"] for e in sel]
            durable = "-"
        else:
            sel = [e for e in events if e["kind"] == "commit" and e.get("tier") == tier]
            drains = [e for e in events if e["kind"] == "drain" and e.get("tier") == tier]
            secs = [e["seconds"] for e in drains]
            durable = f"{statistics.median(e['seconds'] for e in sel):.3f}" if sel else "-"
        nbytes = sum(e.get("nbytes", 0) for e in sel)
        per = statistics.median(secs) if secs else 0.0
        each = nbytes / max(len(sel), 1)
        gbps = f"{each / per / 1e9:.2f}" if per else "-"
        rows.append([tier, str(len(sel)), f"{nbytes / 2**20:.1f} MiB", f"{per:.4f}" if secs else "-", gbps, durable])
    return rows


def _print_table(rows: list[list[str]], headers: list[str], file: TextIO | None = None) -> None:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for i, r in enumerate([headers, *rows]):
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)), file=file)
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths), file=file)


def _earlier_demo(work: Path) -> bool:
    """Whether ``work`` is an earlier demo's workdir: its ``tiers.json`` is the demo's configuration (a run_id
    ``demo-`` and 8 hex digits, the tiers shm, local and remote), and it holds nothing else than the demo writes."""
    try:
        config = json.loads((work / "tiers.json").read_text())
        entries = {p.name for p in work.iterdir()}
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or not isinstance(config.get("tiers"), list):
        return False
    names = [t.get("name") if isinstance(t, dict) else None for t in config["tiers"]]
    return (re.fullmatch(r"demo-[0-9a-f]{8}", str(config.get("run_id"))) is not None and names == _DEMO_TIERS
            and entries <= DEMO_ENTRIES)


def workdir_problem(work: Path) -> str | None:
    """Why the demo cannot use ``work`` (None: it can). The demo empties its workdir first, so it takes only a new
    or empty directory, or one an earlier demo wrote: never a directory holding anything else."""
    if not work.exists():
        return None
    if not work.is_dir():
        return f"{work} is not a directory; give the demo a new or empty directory (--workdir DIR)"
    try:
        empty = next(work.iterdir(), None) is None
    except OSError as exc:
        return (f"{work} cannot be listed ({exc.strerror or exc}); give the demo a new or empty directory "
                "(--workdir DIR)")
    if empty or _earlier_demo(work):
        return None
    return (f"{work} is not empty and is not an earlier demo's workdir: the demo deletes what its workdir holds "
            "before it starts. Give it a new or empty directory, or one an earlier demo made (--workdir DIR)")


def _remove_demo_entries(work: Path, *, ignore_errors: bool = False) -> None:
    """Remove what the demo writes in ``work`` (only the names it writes there)."""
    for name in sorted(DEMO_ENTRIES):
        entry = work / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=ignore_errors)
        elif entry.exists() or entry.is_symlink():
            with contextlib.suppress(*((OSError,) if ignore_errors else ())):
                entry.unlink()


def _prepare_workdir(work: Path) -> bool:
    """An empty ``work``: created, or emptied of an earlier demo's files. Returns whether it was created."""
    problem = workdir_problem(work)
    if problem is not None:
        raise WorkdirError(problem)
    created = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    _remove_demo_entries(work)
    return created


def run_demo(workdir: str, *, world: int = 4, steps: int = 30, save_every: int = SAVE_EVERY,
             kill_step: int | None = None, kill_rank: int | None = None, remote: str | None = None,
             keep_files: bool = True, as_json: bool = False) -> int:
    """Run the demo in ``workdir``; 0 when the resumed run matched the uninterrupted one. ``as_json``: the progress
    goes to stderr and a JSON summary to stdout."""
    if world < 1:
        raise ValueError(f"world must be 1 or more, got {world}")
    if kill_step is None and steps < min_steps(save_every):
        raise ValueError(f"steps must be at least {min_steps(save_every)} to save every {save_every} steps before "
                         f"the kill step, got {steps}")
    kill_step = kill_step if kill_step is not None else default_kill_step(steps)  # late in the run
    kill_rank = kill_rank if kill_rank is not None else world // 2
    work = Path(workdir).resolve()
    created = _prepare_workdir(work)
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    shm_path = SHM_PATH if os.path.isdir(os.path.dirname(SHM_PATH)) else str(work / "shm")
    # The shm tier's files of this run (and only of this run: run_id is new): removed however the demo ends.
    shm_run = Path(shm_path) / _user_name() / run_id
    try:
        return _run(work, run_id, shm_path, world=world, steps=steps, save_every=save_every, kill_step=kill_step,
                    kill_rank=kill_rank, remote=remote, keep_files=keep_files, created=created, as_json=as_json)
    finally:
        shutil.rmtree(shm_run, ignore_errors=True)


def _run(work: Path, run_id: str, shm_path: str, *, world: int, steps: int, save_every: int, kill_step: int,
         kill_rank: int, remote: str | None, keep_files: bool, created: bool, as_json: bool = False) -> int:
    out = sys.stderr if as_json else sys.stdout  # with --json, stdout holds the summary alone

    def say(*args: Any) -> None:
        print(*args, file=out)

    remote_url = remote or f"file://{work / 'remote'}"
    config = {
        "run_id": run_id,
        "layout": "rank_sharded",
        "events": {"jsonl": str(work / "events.jsonl")},
        "tiers": [
            {"name": "shm", "kind": "shm", "path": shm_path, "slots": 2},
            {"name": "local", "kind": "local", "path": str(work / "local"), "keep": 2},
            {"name": "remote", "kind": "fsspec", "url": remote_url, "every": 2, "keep": 3,
             "compression": {"codec": "zstd", "level": 3, "byte_grouping": True}},
        ],
    }
    (work / "tiers.json").write_text(json.dumps(config, indent=1))
    order = [t["name"] for t in config["tiers"]]
    say(f"tiered_ckpt demo: a small GPT on {world} ranks (gloo), {steps} steps, a checkpoint every {save_every}")
    say(f"  tiers: shm {shm_path} -> local {work / 'local'} -> remote {remote_url}")
    t0 = time.perf_counter()

    say("1/3 the uninterrupted run (reference)")
    reference = _losses(launch(world, {"steps": steps, "save_every": save_every}, work / "logs" / "reference"))

    say(f"2/3 the same run with checkpoints; rank {kill_rank} is killed with SIGKILL at step {kill_step}")
    crashed = launch(world, {"steps": steps, "save_every": save_every, "config": config,
                             "kill_rank": kill_rank, "kill_step": kill_step}, work / "logs" / "crashed")
    saved = sorted({r["saved"] for r in crashed if "saved" in r})
    say(f"    saved steps {saved}; the job died at step {kill_step}")

    say("3/3 the job restarts: every rank resumes from the newest step all ranks can read")
    resumed = launch(world, {"steps": steps, "save_every": save_every, "config": config, "resume": True},
                     work / "logs" / "resumed")
    starts = {r["rank"]: (r["resumed"], r["tier"], r["load_s"]) for r in resumed if "resumed" in r}
    step0 = {s for s, _, _ in starts.values()}
    after = _losses(resumed)
    matched = len(step0) == 1 and all(after[s] == reference[s] for s in after) and set(after) == set(
        range(next(iter(step0)) + 1, steps + 1))

    events = _events(work / "events.jsonl")
    say()
    say("per tier (saves of both runs):")
    headers = ["tier", "steps", "bytes", "seconds (median)", "GB/s", "time to durable s"]
    tiers = tier_table(events, order)
    _print_table(tiers, headers, out)
    say()
    say("restore:")
    _print_table([[str(r), str(s), t, f"{sec:.3f}"] for r, (s, t, sec) in sorted(starts.items())],
                 ["rank", "step", "from tier", "seconds"], out)
    say()
    for s in sorted(after)[:3]:
        say(f"  step {s}: loss {after[s]:.6f} resumed, {reference[s]:.6f} uninterrupted")
    say(f"  ... ({len(after)} steps compared, {time.perf_counter() - t0:.0f} s in all)")
    if not keep_files:  # what the demo wrote, and the directory if the demo made it (never a directory of yours)
        _remove_demo_entries(work, ignore_errors=True)  # a killed rank's drain worker may still be writing
        if created:
            with contextlib.suppress(OSError):
                work.rmdir()
    else:
        cli = _cli_command()
        say(f"  explore: {cli} ls {work / 'local'}   {cli} verify {work / 'local'}")
    if matched:
        say(f"OK: the resumed run matched the uninterrupted one exactly (from step {next(iter(step0))} to {steps}).")
    else:
        say("FAILED: the resumed run did not match the uninterrupted one.")
    if as_json:
        print(json.dumps({
            "ok": matched, "world": world, "steps": steps, "save_every": save_every, "run_id": run_id,
            "killed": {"rank": kill_rank, "step": kill_step}, "saved_steps": saved,
            "resumed": {str(r): {"step": s, "tier": t, "load_s": round(sec, 4)} for r, (s, t, sec) in
                        sorted(starts.items())},
            "steps_compared": len(after), "tiers": [dict(zip(headers, row, strict=True)) for row in tiers],
            "seconds": round(time.perf_counter() - t0, 1), "workdir": str(work) if keep_files else None,
        }, indent=1))
    return 0 if matched else 1


def _cli_command() -> str:
    """How to run this installation's command line: ``tiered-ckpt`` when that is what the shell finds (``make
    demo`` runs it from .venv/bin, which need not be on PATH), else the script's path beside this Python."""
    beside = Path(sys.executable).parent / "tiered-ckpt"
    found = shutil.which("tiered-ckpt")
    if found and (not beside.exists() or Path(found).resolve() == beside.resolve()):
        return "tiered-ckpt"
    return str(beside) if beside.exists() else f"{sys.executable} -m tiered_ckpt.cli"
