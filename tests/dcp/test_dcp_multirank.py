"""DCP through the tiers on gloo ranks: an FSDP2 model and AdamW, bit-exact through shm -> local -> S3 (moto),
both directions with DCP's FileSystemReader / FileSystemWriter, dcp.async_save, and a SIGKILL after a
memory-only save."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from test_multirank import run_ranks

WORKER = Path(__file__).with_name("dcp_worker.py")
pytestmark = pytest.mark.slow


def config(run_id: str, tiers: list[dict], commit_timeout_s: float = 30) -> dict:
    return {"run_id": run_id, "layout": "dcp", "drain": {"mode": "thread", "commit_timeout_s": commit_timeout_s},
            "tiers": tiers}


def test_round_trip_through_every_tier_and_dcp_filesystem_both_ways(tmp_path, shm_root, s3_server, s3_bucket):
    world = 2
    run_id = f"dcp{uuid.uuid4().hex[:8]}"
    shm = {"name": "shm", "kind": "shm", "path": shm_root}
    local = {"name": "local", "kind": "local", "path": str(tmp_path / "local")}
    s3 = {"name": "s3", "kind": "fsspec", "url": f"s3://{s3_bucket}/{run_id}", "options": s3_server.storage_options()}
    full = config(run_id, [shm, local, s3])
    plain = tmp_path / "plain" / "iter_0000030"
    actions = [
        {"do": "save", "step": 10, "config": full},  # dcp.save
        {"do": "save", "step": 20, "config": full, "async": True},  # dcp.async_save
        {"do": "save", "step": 30, "writer": "filesystem", "dir": str(plain)},  # DCP's own writer
        {"do": "load", "name": "from_shm", "config": full},
        {"do": "load", "name": "from_local", "config": config(run_id, [local]), "step": 10},
        {"do": "load", "name": "from_s3", "config": config(run_id, [s3])},
        {"do": "load", "name": "dcp_reads_ours", "reader": "filesystem",
         "dir": str(tmp_path / "local" / "iter_0000020")},
        {"do": "load", "name": "ours_reads_dcp", "reader": "path", "dir": str(plain)},
    ]
    out = run_ranks(world, {"actions": actions}, worker=WORKER, timeout=400)
    for rank, res in out.items():
        assert "error" not in res, res["error"]
        assert res["from_shm"]["step"] == 20 and set(res["from_shm"]["sources"].values()) == {"shm"}
        assert res["from_shm"]["verified"]  # the drain recorded the snapshots' checksums
        assert res["from_local"]["step"] == 10 and set(res["from_local"]["sources"].values()) == {"local"}
        assert res["from_local"]["verified"]
        assert res["from_s3"]["step"] == 20 and set(res["from_s3"]["sources"].values()) == {"s3"}
        for name, step in (("from_shm", 20), ("from_local", 10), ("from_s3", 20), ("dcp_reads_ours", 20),
                           ("ours_reads_dcp", 30)):
            assert res[name]["fingerprint"] == res[f"saved_{step}"], (rank, name)
            assert res[name]["extra"] == {"step": step, "note": f"after step {step}"}
        assert res["ours_reads_dcp"]["verified"] is False  # DCP's own files carry no checksums
    # Each rank read the files its plan needed (its own shards; the replicated items from whoever wrote them).
    assert set(out[0]["from_local"]["sources"]) <= {"__0_0.distcp", "__1_0.distcp"}
    for step in (10, 20):
        step_dir = tmp_path / "local" / f"iter_{step:07d}"
        assert sorted(p.name for p in step_dir.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                              "tiered_ckpt"]
        manifest = json.loads((step_dir / "tiered_ckpt" / "manifest.json").read_text())
        keys = {f["key"] for f in manifest["files"]}
        assert {f"iter_{step:07d}/.metadata", f"iter_{step:07d}/__1_0.distcp"} <= keys
        assert all(f["checksum"].startswith("xxh3_128:") for f in manifest["files"])


def test_sigkill_after_a_memory_only_save_resumes_from_shm(tmp_path, shm_root):
    world = 2
    run_id = f"dcp{uuid.uuid4().hex[:8]}"
    cfg = config(run_id, [{"name": "shm", "kind": "shm", "path": shm_root},
                          {"name": "local", "kind": "local", "path": str(tmp_path / "local")}])
    first = run_ranks(world, {"actions": [{"do": "save", "step": 7, "config": cfg, "persistent": False,
                                           "sigkill": True}]}, worker=WORKER)
    assert all(res["killed"] for res in first.values())
    assert not (tmp_path / "local" / "iter_0000007").exists()  # memory only: no file tier took it
    second = run_ranks(world, {"actions": [{"do": "load", "name": "resumed", "config": cfg}]}, worker=WORKER)
    expected = run_ranks(world, {"actions": [{"do": "save", "step": 7, "writer": "filesystem",
                                              "dir": str(tmp_path / "reference")}]}, worker=WORKER)
    for rank, res in second.items():
        assert "error" not in res, res["error"]
        assert res["resumed"]["step"] == 7 and set(res["resumed"]["sources"].values()) == {"shm"}
        assert res["resumed"]["fingerprint"] == expected[rank]["saved_7"]


def test_four_ranks_save_and_two_ranks_load_resharded(tmp_path, shm_root):
    run_id = f"dcp{uuid.uuid4().hex[:8]}"
    cfg = config(run_id, [{"name": "shm", "kind": "shm", "path": shm_root},
                          {"name": "local", "kind": "local", "path": str(tmp_path / "local")}])
    # New interpreters here (not forked ranks): a DTensor rank's exit is where gloo's threads once aborted it
    saved = run_ranks(4, {"actions": [{"do": "save", "step": 10, "config": cfg}]}, worker=WORKER, timeout=400,
                      fresh=True)
    assert all("error" not in res for res in saved.values())
    # writer.wait() returned on each rank once the step was committed (rank 0 plans and snapshots last: the other
    # ranks' own parts were long written; a DCP trial found the step missing right after it on those ranks)
    assert all(res["listed_after_wait"] == {"10": ["local", "shm"]} for res in saved.values()), saved
    assert sorted(p.name for p in (tmp_path / "local" / "iter_0000010").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)]
    only_local = config(run_id, cfg["tiers"][1:])
    loaded = run_ranks(2, {"actions": [{"do": "load", "name": "from_shm", "config": cfg},
                                       {"do": "load", "name": "from_local", "config": only_local}]},
                       worker=WORKER, timeout=400)
    for rank, res in loaded.items():
        assert "error" not in res, res["error"]
        for name, tier in (("from_shm", "shm"), ("from_local", "local")):
            got = res[name]
            # two ranks read what four wrote: each rank several data files, from the four ranks' snapshots on
            # this node, or from the files
            assert got["step"] == 10 and set(got["sources"].values()) == {tier} and got["verified"], (rank, got)
            assert len(got["sources"]) >= 2, (rank, got["sources"])
            assert got["fingerprint"] == saved[0]["saved_10"]


def test_a_failed_resave_of_a_step_never_mixes_two_saves_on_load(tmp_path, shm_root):
    """Step 10 saved, then saved again with newer state, and the coordinator fails in finish(): rank 1's newer
    snapshot (and files) exist, rank 0's .metadata is the old save's. A load takes every rank's part of the old save
    (rank 1's older snapshot, still in its other slot), never a mix of the two."""
    run_id = f"dcp{uuid.uuid4().hex[:8]}"
    # The failed save's commit waits out its timeout for the coordinator's files: 8 s, not 30.
    cfg = config(run_id, [{"name": "shm", "kind": "shm", "path": shm_root},
                          {"name": "local", "kind": "local", "path": str(tmp_path / "local")}], commit_timeout_s=8)
    out = run_ranks(2, {"actions": [{"do": "save", "step": 10, "config": cfg},
                                    {"do": "train"},
                                    {"do": "save", "step": 10, "config": cfg, "fail_finish": True, "tag": "second"},
                                    {"do": "load", "name": "loaded", "config": cfg}]}, worker=WORKER, timeout=400)
    for rank, res in out.items():
        assert "error" not in res, res["error"]
        assert res["save_failed"] and res["second"] != res["saved_10"]
        assert res["loaded"]["step"] == 10 and res["loaded"]["fingerprint"] == res["saved_10"], (rank, res)


def test_a_save_without_collectives_writes_dcp_per_rank_metadata_and_loads_back(tmp_path, shm_root):
    run_id = f"dcp{uuid.uuid4().hex[:8]}"
    shm = {"name": "shm", "kind": "shm", "path": shm_root}
    local = {"name": "local", "kind": "local", "path": str(tmp_path / "local")}
    step_dir = tmp_path / "local" / "iter_0000010"
    out = run_ranks(2, {"actions": [
        {"do": "save", "step": 10, "config": config(run_id, [shm, local]), "use_collectives": False},
        {"do": "load", "name": "from_shm", "config": config(run_id, [shm, local])},
        {"do": "load", "name": "from_local", "config": config(run_id, [local])},
        {"do": "load", "name": "dcp_reads_ours", "reader": "filesystem", "dir": str(step_dir)}]},
        worker=WORKER, timeout=400)
    assert sorted(p.name for p in step_dir.iterdir()) == ["__0.metadata", "__0_0.distcp", "__1.metadata",
                                                         "__1_0.distcp", "tiered_ckpt"]
    for rank, res in out.items():
        assert "error" not in res, res["error"]
        for name, tier in (("from_shm", "shm"), ("from_local", "local")):
            assert res[name]["step"] == 10 and res[name]["sources"] == {f"__{rank}_0.distcp": tier}, (rank, res)
            assert res[name]["verified"] and res[name]["fingerprint"] == res["saved_10"]
        assert res["dcp_reads_ours"]["fingerprint"] == res["saved_10"]
