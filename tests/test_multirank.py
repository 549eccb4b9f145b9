"""Multi-rank jobs on gloo over loopback: all-ranks commit, one consistent restore step, node-local vs shared tiers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rank_procs import start_rank

WORKER = Path(__file__).with_name("multirank_worker.py")
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world: int, spec: dict, *, worker: Path = WORKER, node_of: dict[int, str] | None = None,
                env_of: dict[int, dict[str, str]] | None = None, fresh: bool = False) -> dict:
    """Start ``world`` ranks of ``worker`` on a free port (rank → process), forked from the fork server of
    tests/rank_procs.py; ``fresh``: new interpreters (``python worker``), whose crash at exit, after the result,
    fails the test too. ``env_of``: a rank's own environment variables."""
    port = free_port()
    procs: dict = {}
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        if node_of:
            env["TIERED_CKPT_NODE"] = node_of[rank]
        env.update((env_of or {}).get(rank, {}))
        if fresh:
            procs[rank] = subprocess.Popen([sys.executable, str(worker), json.dumps(spec)], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        else:
            procs[rank] = start_rank(worker, [json.dumps(spec)], env)
    return procs


def run_ranks(world: int, spec: dict, node_of: dict[int, str] | None = None, timeout: float = 240,
              worker: Path = WORKER, env_of: dict[int, dict[str, str]] | None = None,
              fresh: bool = False) -> dict[int, dict]:
    """Start ``world`` ranks (:func:`start_ranks`), wait for all, and return each rank's last JSON line
    (rank → result)."""
    procs = start_ranks(world, spec, worker=worker, node_of=node_of, env_of=env_of, fresh=fresh)
    results = {}
    deadline = time.monotonic() + timeout
    try:
        ended = {rank: p.communicate(timeout=max(0.0, deadline - time.monotonic())) for rank, p in procs.items()}
    finally:
        for p in procs.values():  # those still running when one timed out
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in procs.items():
        out, err = ended[rank]
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        killed = p.returncode == -signal.SIGKILL
        assert (lines or killed) and (p.returncode == 0 or killed), f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
        results[rank] = {**(json.loads(lines[-1]) if lines else {}), "killed": killed}
    return results


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.parent.name[5:]) for p in root.glob("iter_*/tiered_ckpt/manifest.json"))


def tiers(shm: Path, local: Path, shared: Path, **local_opts) -> list[dict]:
    return [{"name": "shm", "kind": "shm", "path": str(shm)},
            {"name": "local", "kind": "local", "path": str(local), **local_opts},
            {"name": "shared", "kind": "fsspec", "url": f"file://{shared}"}]


def job_config(tier_list: list[dict], run_id: str) -> dict:
    return {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 8}, "tiers": tier_list}


@pytest.mark.parametrize("world", [4, 8])
def test_rank_killed_mid_drain_then_consistent_restore(tmp_path, shm_root, world):
    run_id = f"m{uuid.uuid4().hex[:8]}"
    shm, local, shared = Path(shm_root), tmp_path / "local", tmp_path / "shared"
    cfg = job_config(tiers(shm, local, shared), run_id)
    victim = world - 2
    # The victim dies in its drain, just before its first file of step 3 (hit 5: steps 1 and 2 wrote 4 files).
    crash = {victim: {"TIERED_CKPT_CRASH_AT": "drain.before_write:5"}}
    first = run_ranks(world, {"config": cfg, "save": [1, 2, 3]}, env_of=crash)
    assert first[victim]["killed"]
    # The committing rank gives up on the step the victim never drained, on seeing its engine is gone (not after
    # commit_timeout_s on each tier in turn): committed on no tier below shm.
    why = first[0]["save_errors"]["3"]
    assert "not committed" in why and f"the engine of rank(s) {victim} on this node died" in why, why
    assert "after 8 s" not in why
    for root in (shared, local):
        assert committed(root) == [1, 2]

    # Restart: every rank still has step 3 in shared memory: all resume there, and it is drained.
    second = run_ranks(world, {"config": cfg, "load": True})
    assert {r["step"] for r in second.values()} == {3}
    assert {r["tier"] for r in second.values()} == {"shm"}
    assert all(r["recovered"] for r in second.values())
    assert committed(shared) == [1, 2, 3] and committed(local) == [1, 2, 3]

    # The victim's node is lost (its shm is gone) before step 4 drains anywhere: everyone agrees on step 3.
    crash = {victim: {"TIERED_CKPT_CRASH_AT": "drain.before_write:1"}}
    third = run_ranks(world, {"config": cfg, "save": [4]}, env_of=crash)
    assert third[victim]["killed"]
    shutil.rmtree(shm / next(p.name for p in shm.iterdir()) / run_id / f"rank_{victim:05d}")
    fourth = run_ranks(world, {"config": cfg, "load": True})
    assert {r["step"] for r in fourth.values()} == {3}
    assert fourth[victim]["tier"] in ("local", "shared")


@pytest.mark.parametrize("layout", ["rank_sharded", "megatron"])
def test_ranks_with_nothing_to_save_take_part_in_every_commit_and_load_nothing(tmp_path, shm_root, layout):
    """A rank may hold nothing of its own (Megatron's DP rank > 0 without the distributed optimizer): it saves an
    empty dict, the step commits on every tier with it, and each rank loads back what it saved, from memory after
    a restart and from each file tier alone."""
    run_id = f"e{uuid.uuid4().hex[:8]}"
    shm, local, shared = Path(shm_root), tmp_path / "local", tmp_path / "shared"
    cfg = {**job_config(tiers(shm, local, shared), run_id), "layout": layout}
    first = run_ranks(3, {"config": cfg, "save": [1, 2], "empty_ranks": [1]})
    assert all("save_errors" not in r for r in first.values()), first
    for root in (local, shared):
        assert committed(root) == [1, 2]
        manifest = json.loads((root / "iter_0000002" / "tiered_ckpt" / "manifest.json").read_text())
        assert manifest["extra"]["ranks"] == [0, 1, 2]
        assert {f["rank"] for f in manifest["files"]} == {0, 2}
    for tier_list, tier in ((tiers(shm, local, shared), "shm"), (tiers(shm, local, shared)[1:2], "local"),
                            (tiers(shm, local, shared)[2:], "shared")):
        loaded = run_ranks(3, {"config": {**job_config(tier_list, run_id), "layout": layout}, "load": True,
                               "empty_ranks": [1]})
        assert {r["step"] for r in loaded.values()} == {2}, tier
        assert {r["tier"] for r in loaded.values()} == {tier}
        # an empty snapshot is checksummed (vacuously): not "unverified origin" from memory, nor after a restart
        assert all(r["verified"] for r in loaded.values()), (tier, loaded)
    verify = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "verify", str(shared)], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_single_rank_job_saving_nothing_is_told_so(tmp_path):
    from tiered_ckpt import CheckpointEngine

    cfg = {"run_id": "alone", "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path)}]}
    with CheckpointEngine(cfg) as engine, pytest.raises(ValueError, match="nothing to save"):
        engine.save(1, {})


def test_two_nodes_node_local_commit_and_restore_from_shared(tmp_path):
    run_id = f"n{uuid.uuid4().hex[:8]}"
    shared = tmp_path / "shared"
    node_of = {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"}
    roots = {n: (tmp_path / n / "shm", tmp_path / n / "local") for n in ("nodeA", "nodeB")}
    for shm, _ in roots.values():
        shm.mkdir(parents=True)
    configs = {str(r): job_config(tiers(*roots[node_of[r]], shared), run_id) for r in range(4)}
    first = run_ranks(4, {"configs": configs, "save": [1, 2]}, node_of, fresh=True)  # real interpreters' exits
    assert all("save_errors" not in r for r in first.values()), first
    for node in ("nodeA", "nodeB"):  # each node committed its own ranks on its local tier
        manifest = json.loads((roots[node][1] / "iter_0000002" / "tiered_ckpt" / "manifest.json").read_text())
        save = manifest["extra"].pop("save")  # the save's identity: one for the whole job (rank 0's token)
        earlier = manifest["extra"].pop("earlier")  # the saves this committer committed before: step 1's
        assert [step for step, _ in earlier] == [1]
        assert manifest["extra"] == {"ranks": [r for r, n in node_of.items() if n == node], "scope": "node"}
    manifest = json.loads((shared / "iter_0000002" / "tiered_ckpt" / "manifest.json").read_text())
    assert manifest["extra"] == {"ranks": [0, 1, 2, 3], "scope": "job", "save": save, "earlier": earlier}

    for path in roots["nodeB"]:  # node B is replaced: its memory and disk are empty
        shutil.rmtree(path)
        path.mkdir(parents=True)
    second = run_ranks(4, {"configs": configs, "load": True}, node_of)
    assert {r["step"] for r in second.values()} == {2}
    assert [second[r]["tier"] for r in range(4)] == ["shm", "shm", "shared", "shared"]


def test_a_rank_failing_in_load_stops_every_rank_at_once(tmp_path, shm_root):
    """One rank's load() fails on its own (a wrong into=): the others raised nothing and waited in the next
    exchange until the group's timeout (600 s), and a rank retrying alone had its exchanges read as another's.
    Now every rank stops at once, the others with PeerFailedError naming the failed rank and its error, and a
    load() that every rank calls again works."""
    cfg = job_config(tiers(Path(shm_root), tmp_path / "local", tmp_path / "shared"), f"a{uuid.uuid4().hex[:8]}")
    run_ranks(3, {"config": cfg, "save": [1, 2]})
    out = run_ranks(3, {"config": cfg, "bad_into_rank": 1, "load": True}, timeout=100)
    assert out[1]["first_load"].startswith("LoadIntoError"), out[1]
    for r in (0, 2):
        assert out[r]["first_load"].startswith("PeerFailedError"), out[r]
        assert "rank 1: LoadIntoError" in out[r]["first_load"], out[r]
    assert all(out[r]["step"] == 2 and "error" not in out[r] for r in range(3)), out


def test_ranks_at_different_exchanges_all_raise(tmp_path, shm_root):
    cfg = job_config(tiers(Path(shm_root), tmp_path / "local", tmp_path / "shared"), f"x{uuid.uuid4().hex[:8]}")
    out = run_ranks(2, {"config": cfg, "collective": True}, timeout=100)
    for r in (0, 1):
        assert out[r]["collective"].startswith("PeerFailedError"), out[r]
        assert "rank 0 at 'agree_on_step', rank 1 at 'all_succeeded'" in out[r]["collective"], out[r]


def test_node_local_retention_waits_for_the_node_s_slower_ranks(tmp_path):
    """Two nodes; each node's local tier (keep: 1) is committed and trimmed by its first rank, the shared tier by
    global rank 0. On node B, rank 1 finished its own part of a step on the shared tier and deleted the step
    from node B's local tier while rank 2, slower, was still copying its part from there: that step never
    reached the shared tier (rank 2: "no such blob"). Every step must reach it."""
    node_of = {0: "A", 1: "B", 2: "B"}
    latency = {0: 0.05, 1: 0.05, 2: 0.4}
    shared, run_id = tmp_path / "shared", f"n{uuid.uuid4().hex[:6]}"
    configs = {}
    for r, node in node_of.items():
        configs[str(r)] = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 20},
                           "tiers": [{"name": "shm", "kind": "shm", "path": str(tmp_path / node / "shm"), "slots": 8},
                                     {"name": "local", "kind": "local", "path": str(tmp_path / node / "local"),
                                      "keep": 1},
                                     {"name": "shared", "kind": "faulty", "latency_s": latency[r],
                                      "ops": ["write_blob"], "inner": {"kind": "fsspec", "url": f"file://{shared}"}}]}
    out = run_ranks(3, {"configs": configs, "nowait": [1, 2, 3, 4, 5, 6]}, node_of, timeout=200)
    assert all("wait_error" not in r and "error" not in r for r in out.values()), out
    assert committed(shared) == [1, 2, 3, 4, 5, 6]
    for node in ("A", "B"):  # and the local tiers are trimmed to keep: 1 beyond what was still in use
        assert 6 in committed(tmp_path / node / "local")


def test_tp_change_is_refused_naming_tp(tmp_path, shm_root):
    cfg = job_config(tiers(Path(shm_root), tmp_path / "local", tmp_path / "shared"), f"t{uuid.uuid4().hex[:8]}")
    run_ranks(4, {"config": cfg, "save": [1], "parallel": {"tp": 2, "dp": 2}})
    again = run_ranks(4, {"config": cfg, "load": True, "parallel": {"tp": 1, "dp": 4}})
    for r in again.values():
        assert "LayoutMismatchError" in r["error"] and "TP 2 → 1" in r["error"], r


@pytest.mark.parametrize("victim", [0, 1])
def test_a_step_saved_again_never_commits_with_the_earlier_save_s_votes(tmp_path, victim):
    """A job re-run into the same directory saves step 5 again; one rank dies before writing its part. The rank
    manifests the first job left for step 5 are not this save's votes: the step must not be committed from them
    (the committer would vouch for one rank's new files beside another's old ones, a checkpoint no job saved)."""
    run_id = f"m{uuid.uuid4().hex[:8]}"
    shared = tmp_path / "shared"
    cfg = job_config([{"name": "shared", "kind": "fsspec", "url": f"file://{shared}", "keep": 3}], run_id)
    cfg["drain"]["commit_timeout_s"] = 4
    first = run_ranks(2, {"config": cfg, "save": [4, 5]})
    assert not any(r.get("save_errors") for r in first.values())
    assert committed(shared) == [4, 5]

    crash = {victim: {"TIERED_CKPT_CRASH_AT": "drain.before_write:1"}}
    second = run_ranks(2, {"config": cfg, "save": [5], "run": 1}, env_of=crash)
    assert second[victim]["killed"]
    survivor = second[1 - victim]
    if victim == 1:  # the committing rank survived: it must not commit step 5
        assert "not committed" in survivor["save_errors"]["5"]
    assert committed(shared) == [4]

    third = run_ranks(2, {"config": cfg, "load": True})
    assert {r["step"] for r in third.values()} == {4}


def test_a_step_saved_again_by_every_rank_commits_the_new_save(tmp_path):
    """The same re-run, every rank alive: step 5 is committed again, from the new save's rank manifests alone
    (they and the checkpoint manifest name one save), and loads with the new values."""
    run_id = f"m{uuid.uuid4().hex[:8]}"
    shared = tmp_path / "shared"
    cfg = job_config([{"name": "shared", "kind": "fsspec", "url": f"file://{shared}", "keep": 3}], run_id)
    run_ranks(2, {"config": cfg, "save": [4, 5]})
    first = json.loads((shared / "iter_0000005" / "tiered_ckpt" / "manifest.json").read_text())["extra"]["save"]
    second = run_ranks(2, {"config": cfg, "save": [5], "run": 1})
    assert not any(r.get("save_errors") for r in second.values())
    assert committed(shared) == [4, 5]
    step_dir = shared / "iter_0000005" / "tiered_ckpt"
    saves = {json.loads(p.read_text())["extra"]["save"] for p in step_dir.glob("rank_*.json")}
    now = json.loads((step_dir / "manifest.json").read_text())["extra"]["save"]
    assert saves == {now} and now != first
    third = run_ranks(2, {"config": cfg, "load": True, "runs_of": {"1": [5]}})
    assert {r["step"] for r in third.values()} == {5}


def test_snapshots_a_rank_never_saved_elsewhere_are_not_recovered_to_wait_for_it(tmp_path, shm_root):
    """Rank 1 stopped after step 3; rank 0 saved steps 4 and 5 (never committed: rank 1's part never came). At the
    restart rank 0 drained them again, and its commit waited commit_timeout_s for rank 1 each time, holding both
    slots, so the job's first saves blocked for minutes (found by a user's fault trial). The ranks now exchange
    what they recover: a step some rank has nowhere is left in memory, with a warning."""
    run_id = f"m{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    cfg = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 3},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(local)}]}
    first = run_ranks(2, {"config": cfg, "save_of": {"0": [1, 2, 3, 4, 5], "1": [1, 2, 3]}})
    assert sorted(first[0]["save_errors"]) == ["4", "5"] and "save_errors" not in first[1]
    assert committed(local) == [1, 2, 3]
    second = run_ranks(2, {"config": cfg, "save": [6], "load": True, "runs_of": {}}, timeout=120)
    assert second[0]["recovered"] == [] and second[1]["recovered"] == []
    assert "save_errors" not in second[0] and "save_errors" not in second[1]
    assert {r["step"] for r in second.values()} == {6}  # saved and drained above, loaded by every rank
    assert committed(local) == [1, 2, 3, 6]


def test_load_waits_for_the_recovery_that_commits_the_newest_step(tmp_path, shm_root):
    """Rank 0 died as its drain began step 3; rank 1's part of step 3 is on the tier, and rank 1 went on to save 4
    and 5. At the restart only rank 0's recovery can commit step 3, and load() listed the tiers before it did:
    the job resumed from step 2 (found by a user's fault trial). load() waits for the start-up recovery."""
    run_id = f"m{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    cfg = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 3},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(local)}]}
    first = run_ranks(2, {"config": cfg, "save_of": {"0": [1, 2, 3], "1": [1, 2, 3, 4, 5]}},
                      env_of={0: {"TIERED_CKPT_CRASH_AT": "drain.before_write:3"}})
    assert first[0]["killed"] and not first[1]["killed"]
    assert committed(local) == [1, 2]
    second = run_ranks(2, {"config": cfg, "load": True}, timeout=120)
    assert second[0]["recovered"] == [3] and second[1]["recovered"] == [], second
    assert all(r["load_waits_for_recovery"] for r in second.values())  # rank 1's memory no longer holds step 3
    assert {r["step"] for r in second.values()} == {3}, second
    assert committed(local) == [1, 2, 3]


def test_load_does_not_wait_for_a_recovery_when_every_rank_holds_the_step_in_memory(tmp_path, shm_root):
    """Every rank died as its drain began step 3: each one's memory holds it, so load() takes it from there at
    once instead of waiting for the recovery's drain (minutes to an object store) before it lists the tiers."""
    run_id = f"m{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    cfg = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 3},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(local)}]}
    first = run_ranks(2, {"config": cfg, "save": [1, 2, 3]},
                      env_of={r: {"TIERED_CKPT_CRASH_AT": "drain.before_write:3"} for r in (0, 1)})
    assert first[0]["killed"] and first[1]["killed"]
    second = run_ranks(2, {"config": cfg, "load": True}, timeout=120)
    assert all(r["recovered"] == [3] and not r["load_waits_for_recovery"] for r in second.values()), second
    assert {(r["step"], r["tier"]) for r in second.values()} == {(3, "shm")}, second
    assert committed(local) == [1, 2, 3]  # the recovery committed it all the same


@pytest.mark.parametrize("wait_committed", [False, True])
def test_ranks_that_do_not_commit_see_the_commit_when_they_wait_for_it_and_release_their_slots(
        tmp_path, shm_root, wait_committed):
    """Rank 0 commits last (it saves a second later, as DCP's writer, whose rank 0 also plans, makes it): the other
    ranks' drains end with their part voted, before the commit. engine.wait_committed() waits there until the commit
    is visible (a DCP trial: rank 1 loaded right after writer.wait() and found no step), and close() waits for it
    before on_close: release (the trial: every rank but 0 left its slot in /dev/shm after every clean save)."""
    run_id = f"c{uuid.uuid4().hex[:8]}"
    shm, local, shared = Path(shm_root), tmp_path / "local", tmp_path / "shared"
    tier_list = tiers(shm, local, shared)
    tier_list[0]["on_close"] = "release"
    spec = {"config": job_config(tier_list, run_id), "save": [1], "delay_of": {"0": 1.5},
            "wait_committed": wait_committed}
    results = run_ranks(3, spec)
    assert all("save_errors" not in r for r in results.values()), results
    if wait_committed:
        assert all(r["listed"] == {"1": {"local": True, "shared": True}} for r in results.values()), results
    assert committed(local) == committed(shared) == [1]
    left = sorted(str(p.relative_to(shm)) for p in shm.rglob("slot_*"))
    assert left == [], left


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_whose_part_fails_stops_the_other_ranks_waiting_for_the_commit(tmp_path, shm_root, victim):
    """One rank cannot write its part of step 1 on the shared tier (every write fails there). The committing
    rank waited commit_timeout_s for its vote, and the other ranks' wait_committed() ran out its own deadline
    without knowing why (a fault trial: minutes at every failed save's close). Now the failing rank records why
    (or, the committing rank failing, it records the step's failure) and every rank's wait ends with that."""
    run_id = f"f{uuid.uuid4().hex[:8]}"
    shared = tmp_path / "shared"

    def config(rank: int) -> dict:
        tier = {"name": "shared", "kind": "local", "path": str(shared)}
        if rank == victim:
            tier = {"name": "shared", "kind": "faulty", "permanent_error": True, "ops": ["write_blob"],
                    "inner": {"kind": "local", "path": str(shared)}}
        return {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 100},
                "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}, tier]}

    spec = {"configs": {str(r): config(r) for r in range(3)}, "save": [1], "wait_committed": True}
    results = run_ranks(3, spec)
    for rank, out in results.items():
        error = out["save_errors"]["1"]
        if rank == victim:
            assert "PermanentTierError" in error, (rank, error)
        elif victim == 0:
            assert "step 1 was not committed here" in error and "PermanentTierError" in error, (rank, error)
        else:
            assert f"rank {victim} could not write its part here" in error, (rank, error)
    assert committed(shared) == []


def test_the_committing_rank_killed_before_its_commit_ends_the_others_wait_at_once(tmp_path, shm_root):
    """Rank 0 dies in its drain just before it commits step 1 (killed: it records nothing). The other ranks'
    wait_committed() waited out its whole timeout (60 s here) to say "not committed after 60 s"; each now sees the
    committing rank's engine gone on its node and says so."""
    run_id = f"k{uuid.uuid4().hex[:8]}"
    cfg = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 300},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "shared", "kind": "local", "path": str(tmp_path / "shared")}]}
    results = run_ranks(3, {"config": cfg, "save": [1], "wait_committed": True},
                        env_of={0: {"TIERED_CKPT_CRASH_AT": "drain.before_commit:1"}}, timeout=200)
    assert results[0]["killed"]
    for rank in (1, 2):
        error = results[rank]["save_errors"]["1"]
        assert "the engine of the committing rank 0 died on this node" in error and "rank_00000.lock" in error, error
    assert committed(tmp_path / "shared") == []


def test_close_with_on_close_release_stops_waiting_for_a_committing_rank_that_died(tmp_path, shm_root):
    """close() before on_close: release waits for the commit of the newest step this rank voted for, up to
    commit_timeout_s (300 s here). Rank 0 dies just before that commit: ranks 1 and 2 now see it dead on their node,
    close at once, and keep their snapshots in memory (the step is committed nowhere)."""
    run_id = f"r{uuid.uuid4().hex[:8]}"
    tier_list = [{"name": "shm", "kind": "shm", "path": str(shm_root), "on_close": "release"},
                 {"name": "shared", "kind": "local", "path": str(tmp_path / "shared")}]
    cfg = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 300}, "tiers": tier_list}
    results = run_ranks(3, {"config": cfg, "save": [1]}, env_of={0: {"TIERED_CKPT_CRASH_AT": "drain.before_commit:1"}},
                        timeout=100)
    assert results[0]["killed"]
    assert all("save_errors" not in results[r] and "error" not in results[r] for r in (1, 2)), results
    assert committed(tmp_path / "shared") == []
    kept = {p.parent.name for p in Path(shm_root).rglob("slot_*")}
    assert {"rank_00001", "rank_00002"} <= kept, kept


@pytest.mark.parametrize("where", ["configuration", "tiers"])
def test_a_rank_whose_engine_cannot_start_stops_the_others_at_once(tmp_path, shm_root, where):
    """Rank 1's engine cannot start: a typo in its configuration, or a tier only the machine can refuse (a gpu
    tier enabled on a machine without one, found as the tiers are built). Its CheckpointEngine() raised, while
    the other ranks waited for it at the start-up exchange until the process group's timeout (an operator trial:
    200 s, then killed). Now they raise PeerFailedError there, naming rank 1's error."""
    run_id = f"s{uuid.uuid4().hex[:8]}"
    good = {"run_id": run_id, "drain": {"mode": "thread"},
            "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                      {"name": "local", "kind": "local", "path": str(tmp_path / "local")}]}
    if where == "configuration":
        bad, said = {**good, "tiers": [good["tiers"][0], {**good["tiers"][1], "keeep": 2}]}, "keeep"
    else:
        bad, said = {**good, "tiers": [{"name": "gpu", "kind": "gpu", "enabled": True}, *good["tiers"]]}, "gpu"
    results = run_ranks(3, {"configs": {"0": good, "1": bad, "2": good}, "save": [1]}, timeout=100)
    assert "Error" in results[1]["error"] and said in results[1]["error"], results[1]
    for rank in (0, 2):
        error = results[rank]["error"]
        assert error.startswith("PeerFailedError") and "rank 1: " in error and said in error, error


def test_a_rank_whose_parallel_layout_disagrees_with_torch_distributed_stops_the_others_at_once(tmp_path,
                                                                                                 shm_root):
    """Rank 1 is given a parallel layout of 4 ranks in a job of 3: its CheckpointEngine() raised ValueError at
    the start-up exchange, and the other ranks waited there for it until the process group's timeout. It is a
    ConfigError (a ValueError, as it was) saying what to fix."""
    cfg = {"run_id": f"p{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "local")}]}
    results = run_ranks(3, {"config": cfg, "parallels": {"1": {"dp": 4}}, "save": [1]}, timeout=100)
    said = "torch.distributed says rank 1 of 3, the parallel layout says rank 1 of 4"
    assert results[1]["error"].startswith("ConfigError") and said in results[1]["error"], results[1]
    for rank in (0, 2):
        error = results[rank]["error"]
        assert error.startswith("PeerFailedError") and "rank 1: " in error and said in error, error


def test_waiting_for_a_commit_that_retention_retired_since_says_committed(tmp_path, shm_root):
    """keep: 1, and each rank waits for the previous save's commit after the next save (as an asynchronous writer
    does): by then the next commit has retired it. The wait saw no manifest and said "not committed" after its
    timeout (a fault trial). Each commit's manifest names the saves committed before it."""
    run_id = f"c{uuid.uuid4().hex[:8]}"
    shm, local = Path(shm_root), tmp_path / "local"
    cfg = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 5},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm)},
                     {"name": "local", "kind": "local", "path": str(local), "keep": 1}]}
    results = run_ranks(3, {"config": cfg, "save": [1, 2, 3], "wait_previous": 0.5})
    assert all("save_errors" not in r for r in results.values()), results
    assert all(r["previous_committed"] == [1, 2] for r in results.values()), results
    assert committed(local) == [3]


def test_a_step_only_other_ranks_recover_is_committed_by_the_committing_rank(tmp_path, shm_root):
    """Rank 2 died as its drain began step 2; ranks 0 and 1 had their parts of it on the tier and went on to save
    3 and 4, reusing the slots that held 2. At the restart rank 2 recovers step 2 and writes its part, but rank 0,
    which commits, no longer holds it: nobody committed it, and the job resumed from step 1 (a fault trial)."""
    run_id = f"m{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    cfg = {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 3},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(local)}]}
    first = run_ranks(3, {"config": cfg, "save_of": {"0": [1, 2, 3, 4], "1": [1, 2, 3, 4], "2": [1, 2]}},
                      env_of={2: {"TIERED_CKPT_CRASH_AT": "drain.before_write:2"}})
    assert first[2]["killed"] and not first[0]["killed"]
    assert committed(local) == [1]
    second = run_ranks(3, {"config": cfg, "load": True}, timeout=120)
    assert [second[r]["recovered"] for r in range(3)] == [[2], [], [2]], second  # rank 0: the commit's handle
    assert {r["step"] for r in second.values()} == {2}, second
    assert committed(local) == [1, 2]

