"""Crash consistency: SIGKILL at every crash point, in every tier configuration, then restart.

Each scenario forks a training process (``crash_worker.py``) that saves a few steps of varying size and dies by
SIGKILL at a crash point (``tiered_ckpt.crashpoints``: the snapshot, the drain, the commit, retention, the tiers'
atomic writes), in six tier configurations (drain threads and a drain process; shm, local disk, a shared
``file://`` tier, device memory hopping to shm, disk alone), with steps, sizes and waits drawn from a seed. A third
of the thread-mode scenarios crash again while the restarted job recovers. Then, as the restarted job would:

* ``tiered-ckpt ls --json`` lists no step as committed that ``verify --all`` does not find intact, and no manifest
  is corrupt;
* a new engine's ``load()`` returns the newest step any tier holds (committed, or a snapshot left in shared
  memory), bit-exact, and never older than a step the killed process had been told was committed or
  snapshotted (its events file says which);
* every step still committed after the restart's recovery loads bit-exact from every tier holding it;
* ``gc --delete`` removes the crash's temporary files, and the engine saves and commits the next step.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from crash_worker import scenario_items
from helpers import assert_same, cli

from tiered_ckpt import CheckpointEngine, crashpoints
from tiered_ckpt.cli import EXIT_NOT_FOUND, EXIT_OK

WORKER = Path(__file__).with_name("crash_worker.py")

# Which hit of each point to crash at (several: the first save, a later one, a write during retention...).
HITS = {
    "save.invalidated": (1, 3),
    "save.item_copied": (1, 4),  # two items per save: hit 1 is between them, hit 4 after save 2's last
    "save.before_publish": (2,),
    "memory.publish": (1, 2, 4),
    "drain.before_write": (1, 3),
    "drain.after_write": (2,),
    "drain.before_commit": (1, 3),
    "store.files_written": (2,),
    "store.rank_manifest_written": (3,),
    "store.manifest_written": (1, 3),
    "store.retain_uncommitted": (1,),  # keep: 2, so the third commit removes the first step
    "files.deleting": (2,),  # midway through removing a step directory
    "files.temp_written": (2, 5, 9),
    "fsspec.temp_written": (1, 3),
}
# The megatron layout's gather-free commit needs several ranks writing one file: its points are exercised on 4 gloo
# ranks by test_megatron_inplace_crash.py (rank_sharded here never reaches them).
MULTIRANK_POINTS = {"megatron.pieces_written", "megatron.in_place_complete", "megatron.in_place_renamed",
                    "megatron.parts_sent", "megatron.tail_sent", "megatron.upload_completed"}
# The S3 tier's point needs an S3 server: test_s3.py kills a save there mid-upload and gc aborts what it left.
S3_POINTS = {"s3.part_sent"}
assert set(HITS) | MULTIRANK_POINTS | S3_POINTS == set(crashpoints.POINTS), "every crash point is exercised"

# Tier configurations: (name, tiers, drain mode). "process" runs the drain in a worker process.
CONFIGS = {
    "shm+local": (("shm", "local"), "thread"),
    "shm+local+shared": (("shm", "local", "shared"), "thread"),
    "local": (("local",), "thread"),
    "gpu+shm+local": (("gpu", "shm", "local"), "thread"),  # device memory (here: cpu) hops to shm, then disk
    "shm+local/process": (("shm", "local"), "process"),
    "shm+local+shared/process": (("shm", "local", "shared"), "process"),
}
PERSISTENT = {"shm", "local", "shared"}  # tiers whose content survives the killed process


@dataclass(frozen=True)
class Scenario:
    config: str
    point: str
    hit: int
    seed: int
    then: str | None = None  # a second crash, while the restarted job recovers

    @property
    def id(self) -> str:
        return f"{self.config}-{self.point}:{self.hit}-s{self.seed}" + (f"-then-{self.then}" if self.then else "")


# In process mode each scenario starts a drain worker (a second Python with torch): fewer, chosen points.
PROCESS_POINTS = {
    "shm+local/process": ("save.before_publish", "memory.publish", "drain.before_write", "drain.after_write",
                          "drain.before_commit", "store.manifest_written", "store.retain_uncommitted",
                          "files.temp_written"),
    "shm+local+shared/process": ("store.rank_manifest_written", "drain.before_commit", "fsspec.temp_written"),
}


# Crash points for a second crash, during the restarted job's recovery of what shm held.
RECOVERY_CRASHES = ("drain.before_write:1", "store.files_written:1", "store.manifest_written:1",
                    "files.temp_written:2", "memory.publish:1", "store.retain_uncommitted:1")


def _scenarios() -> list[Scenario]:
    out = []
    for config, (tiers, mode) in CONFIGS.items():
        for point, hits in HITS.items():
            if point.startswith("fsspec.") and "shared" not in tiers:
                continue
            if mode == "process":
                if point not in PROCESS_POINTS[config]:
                    continue
                hits = hits[-1:]
            for hit in hits:
                n = len(out)
                then = RECOVERY_CRASHES[n // 3 % len(RECOVERY_CRASHES)] if mode == "thread" and n % 3 == 0 else None
                out.append(Scenario(config, point, hit, seed=n, then=then))
    return out


SCENARIOS = _scenarios()


def _plan(seed: int) -> dict:
    """Steps (increasing, with gaps), item sizes and which saves wait for their drain: drawn from the seed."""
    rng = random.Random(seed)
    steps, step = [], rng.randint(0, 3)
    for _ in range(4):
        step += rng.randint(1, 5)
        steps.append(step)
    return {"steps": steps, "scales": [rng.choice((1, 1, 2)) for _ in steps],
            "wait": [rng.random() < 0.7 for _ in steps]}


def _config(name: str, root: Path, shm_root: str, run_id: str, mode: str | None = None) -> dict:
    tiers, default_mode = CONFIGS[name]
    every = {"gpu": {"name": "gpu", "kind": "gpu", "device": "cpu"},
             "shm": {"name": "shm", "kind": "shm", "path": shm_root},
             "local": {"name": "local", "kind": "local", "path": str(root / "local"), "keep": 2},
             "shared": {"name": "shared", "kind": "fsspec", "url": f"file://{root / 'shared'}", "keep": 2}}
    return {"run_id": run_id, "drain": {"mode": mode or default_mode, "commit_timeout_s": 30},
            "tiers": [every[t] for t in tiers]}


class Zygote:
    """``crash_worker.py serve``: forks each scenario from one warm process."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ready = self.proc.stdout.readline()
        assert ready.startswith('{"ready"'), f"crash worker did not start: {ready!r}"

    def run(self, spec: dict) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the crash worker died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()



def events_of(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # the kill may cut the last line short
                out.append(json.loads(line))
    return out


def check_tiers(config_path: Path) -> tuple[set[tuple[str, int]], set[int]]:
    """``ls`` and ``verify --all``: (committed (tier, step) pairs, snapshot steps), after checking that every
    committed step is intact and no manifest is corrupt."""
    code, out = cli("ls", "--config", str(config_path), "--json")
    rows = json.loads(out)
    if code == EXIT_NOT_FOUND:  # a crash before anything reached a tier: nothing there, and ls says so
        assert rows.get("results", []) == [], rows
        rows = []
    assert code in (EXIT_OK, EXIT_NOT_FOUND), rows
    assert not [r for r in rows if r["state"].startswith("corrupt")], rows
    committed = {(r["tier"], r["step"]) for r in rows if r["state"] == "committed"}
    snapshots = {r["step"] for r in rows if r["state"].startswith("snapshot")}
    code, out = cli("verify", "--config", str(config_path), "--all", "--json")
    report = json.loads(out)
    if code == EXIT_NOT_FOUND:  # no committed step to verify
        assert not committed, report
        report = []
    assert code in (EXIT_OK, EXIT_NOT_FOUND), [r for r in report if not r["ok"]]
    assert {(r["tier"], r["step"]) for r in report} == committed
    return committed, snapshots


def temp_files(root: Path, shm_root: str) -> list[str]:
    from tiered_ckpt.tiers._files import is_temp_name

    found = []
    for base in (root, Path(shm_root)):
        for dirpath, _, names in os.walk(base):
            found += [os.path.join(dirpath, n) for n in names if is_temp_name(n) and not n.startswith(".faults")]
    return found


@pytest.mark.parametrize("sc", [pytest.param(s, marks=[pytest.mark.slow] if "process" in s.config else [])
                                for s in SCENARIOS], ids=[s.id for s in SCENARIOS])
def test_crash_point(sc: Scenario, zygote: Zygote, tmp_path: Path, shm_root: str):
    run_id = f"crash-{uuid.uuid4().hex[:10]}"
    events = tmp_path / "events.jsonl"
    log = tmp_path / "worker.log"
    config = _config(sc.config, tmp_path, shm_root, run_id)
    plan = _plan(sc.seed)
    spec = {"config": {**config, "events": {"jsonl": str(events)}}, "crash_at": f"{sc.point}:{sc.hit}",
            "log": str(log), **plan}
    result = zygote.run(spec)
    output = log.read_text() if log.exists() else ""
    assert result["status"] == "killed" and result["code"] == -9, f"{result}; worker output:\n{output[-4000:]}"

    saved = [int(line.split()[1]) for line in output.splitlines() if line.startswith("saved ")]
    if sc.then:  # the restarted job dies too, while it drains what the first one left in shm (if anything)
        again = zygote.run({**spec, "crash_at": sc.then, "steps": [], "scales": [], "wait": []})
        assert again["status"] == "killed" or again == {"status": "exited", "code": 0}, (again, log.read_text())
    seen = events_of(events)
    # What the killed process was told was durable: commits on tiers that outlive it, and shm snapshots.
    promised = {e["step"] for e in seen if e.get("tier") in PERSISTENT
                and (e["kind"] == "commit" or (e["kind"] == "snapshot" and e["tier"] == "shm"))}

    # 1. Right after the crash: nothing partial is committed, and what is there is intact.
    config_path = tmp_path / "tiers.json"
    config_path.write_text(json.dumps(_config(sc.config, tmp_path, shm_root, run_id, mode="thread")))
    committed, snapshots = check_tiers(config_path)
    on_tiers = {s for _, s in committed} | snapshots
    assert on_tiers <= set(plan["steps"]), f"unknown steps {on_tiers} (saved {plan['steps']})"
    newest = max(on_tiers, default=None)
    if promised:
        assert newest is not None and newest >= max(promised), (
            f"step {max(promised)} was reported durable, but the tiers hold only {sorted(on_tiers)}")

    # 2. The restarted job: load() gives the newest step, bit-exact; recovery drains what shm still holds.
    with CheckpointEngine(json.loads(config_path.read_text())) as engine:
        if newest is None:
            with pytest.raises(FileNotFoundError):
                engine.load()
        else:
            loaded = engine.load()
            assert loaded.step == newest, (loaded.step, sorted(on_tiers), engine.available_steps())
            assert_same(scenario_items(newest, plan["scales"][plan["steps"].index(newest)]), loaded.items)
        engine.wait(60)
        for handle in engine.recovered:
            handle.wait(timeout=60)

        # 3. After recovery: every committed copy of every step loads bit-exact from its tier.
        committed, snapshots = check_tiers(config_path)
        available = engine.available_steps()
        for tier, step in sorted(committed):
            assert step in available[tier], (tier, step, available)
            items = engine._load_from(tier, step, True, None)[0]
            assert_same(scenario_items(step, plan["scales"][plan["steps"].index(step)]), items)
        if newest is not None:
            assert engine.load().step == newest

        # 4. While an engine of the run holds its lock, gc touches none of the run's files (it cannot tell the
        #    crash's temporary files from the writes in flight); the next save commits everywhere.
        left = temp_files(tmp_path, shm_root)
        code, _ = cli("gc", "--config", str(config_path), "--delete", "--min-age", "0")
        assert code == EXIT_OK
        assert temp_files(tmp_path, shm_root) == left
        check_tiers(config_path)
        following = max(plan["steps"]) + 1
        engine.save(following, scenario_items(following, 1)).wait(timeout=60)
        loaded = engine.load()
        assert loaded.step == following
        assert_same(scenario_items(following, 1), loaded.items)
    # 5. Once no engine holds the run, gc removes the crash's temporary files (--min-age 0: seconds old).
    code, _ = cli("gc", "--config", str(config_path), "--delete", "--min-age", "0")
    assert code == EXIT_OK
    assert temp_files(tmp_path, shm_root) == []
    assert saved == plan["steps"][:len(saved)]


def test_scenario_count():
    """Issue #9 asks for at least 50 crash scenarios."""
    assert len(SCENARIOS) >= 50
    assert len({s.point for s in SCENARIOS}) == len(set(crashpoints.POINTS) - MULTIRANK_POINTS - S3_POINTS)


def test_crash_point_is_inert_unless_armed(monkeypatch):
    crashpoints.arm(None)
    crashpoints.crash_point("save.invalidated")  # nothing happens
    with pytest.raises(ValueError, match="positive integer"):
        crashpoints.arm("save.invalidated:0")
    assert crashpoints._target is None
    assert os.environ.get(crashpoints.ENV) is None


def test_gc_finds_temporary_files_on_a_shared_filesystem_tier(tmp_path):
    """Regression: gc found the temporary files a crash leaves only on local and shm tiers; on a ``file://``
    fsspec tier (a shared filesystem) they stayed forever."""
    from tiered_ckpt.tiers._files import temp_name

    shared = tmp_path / "shared"
    (shared / "iter_0000004/rank_00000").mkdir(parents=True)
    left = shared / "iter_0000004/rank_00000" / temp_name("state.flat")
    left.write_bytes(b"x" * 10)
    config = tmp_path / "tiers.json"
    config.write_text(json.dumps({"tiers": [{"name": "shared", "kind": "fsspec", "url": f"file://{shared}"}]}))
    code, out = cli("gc", "--config", str(config), "--json")
    result = json.loads(out)
    assert result["found"] == []  # seconds old: it may be a write in flight (the store tells its age)
    assert [(d["key"], d["left"]) for d in result["left"] if d["what"] == "temporary file"] == [
        (f"iter_0000004/rank_00000/{left.name}", "younger than --min-age")]  # and said so
    os.utime(left, (1, 1))  # a crash long ago
    code, out = cli("gc", "--config", str(config), "--json")
    (found,) = json.loads(out)["found"]
    assert found.pop("age_s") > time.time() - 2  # since 1970-01-01 00:00:01
    assert found == {"tier": "shared", "what": "temporary file", "bytes": 10,
                     "key": f"iter_0000004/rank_00000/{left.name}"}
    assert cli("gc", "--config", str(config), "--delete")[0] == EXIT_OK
    assert not left.exists() and not (shared / "iter_0000004").exists()
