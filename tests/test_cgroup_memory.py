"""The shm tier against a container's memory limit: shared-memory pages count against it, the tmpfs's free space
does not show it, and a slot that does not fit got the job OOM-killed with nothing said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tiered_ckpt.tiers.cgroup_memory import memory_headroom

MiB = 1 << 20
NO_SWAP = "/nonexistent/meminfo"  # no swap known: limits count


def test_a_cgroup_that_may_swap_does_not_count(tmp_path):
    """tmpfs pages can be swapped out where swap is allowed: the memory limit is not where the OOM killer
    strikes, so it does not refuse slots (Docker's --memory without --memory-swap allows as much swap again)."""
    _files(tmp_path, {"proc": "0::/ctr\n", "meminfo": "MemTotal: 100 kB\nSwapTotal:     2097148 kB\n",
                      "nomem": "SwapTotal: 0 kB\n",
                      "fs/ctr/memory.max": f"{1024 * MiB}\n", "fs/ctr/memory.current": f"{900 * MiB}\n",
                      "fs/ctr/memory.swap.max": "max\n",
                      "v1proc": "4:memory:/c\n", "fs/memory/c/memory.limit_in_bytes": f"{512 * MiB}\n",
                      "fs/memory/c/memory.usage_in_bytes": f"{100 * MiB}\n",
                      "fs/memory/c/memory.memsw.limit_in_bytes": f"{1024 * MiB}\n"})
    fs, meminfo = str(tmp_path / "fs"), str(tmp_path / "meminfo")
    assert memory_headroom(str(tmp_path / "proc"), fs, meminfo) is None
    assert memory_headroom(str(tmp_path / "v1proc"), fs, meminfo) is None
    assert memory_headroom(str(tmp_path / "proc"), fs, str(tmp_path / "nomem")).available == 124 * MiB
    (tmp_path / "fs/ctr/memory.swap.max").write_text("0\n")  # swap off for this cgroup: its limit counts
    assert memory_headroom(str(tmp_path / "proc"), fs, meminfo).available == 124 * MiB
    (tmp_path / "fs/memory/c/memory.memsw.limit_in_bytes").write_text(f"{512 * MiB}\n")
    assert memory_headroom(str(tmp_path / "v1proc"), fs, meminfo).available == 412 * MiB


def _files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_v2_limit_usage_and_page_cache(tmp_path):
    _files(tmp_path, {"proc": "0::/kubepods/pod1/ctr\n",
                      "fs/kubepods/pod1/ctr/memory.max": "max\n",  # the container sets none: its pod does
                      "fs/kubepods/pod1/ctr/memory.current": f"{900 * MiB}\n",
                      "fs/kubepods/pod1/memory.max": f"{1024 * MiB}\n",
                      "fs/kubepods/pod1/memory.current": f"{1000 * MiB}\n",
                      "fs/kubepods/pod1/memory.stat": f"anon {300 * MiB}\nfile {600 * MiB}\nshmem {200 * MiB}\n"})
    h = memory_headroom(str(tmp_path / "proc"), str(tmp_path / "fs"), NO_SWAP)
    assert h is not None and h.where.endswith("kubepods/pod1")
    assert h.limit == 1024 * MiB and h.used == 600 * MiB  # 400 MiB of file cache can be dropped; shmem cannot
    assert h.available == 424 * MiB


def test_v1_tightest_ancestor_and_unlimited(tmp_path):
    unlimited = "9223372036854771712\n"
    _files(tmp_path, {"proc": "12:pids:/x\n4:memory,foo:/a/b\n0::/\n",
                      "fs/memory/a/b/memory.limit_in_bytes": f"{2048 * MiB}\n",
                      "fs/memory/a/b/memory.usage_in_bytes": f"{100 * MiB}\n",
                      "fs/memory/a/memory.limit_in_bytes": f"{512 * MiB}\n",
                      "fs/memory/a/memory.usage_in_bytes": f"{400 * MiB}\n",
                      "fs/memory/a/memory.stat": f"cache {150 * MiB}\ntotal_cache {150 * MiB}\n"
                                                 f"total_shmem {50 * MiB}\n",
                      "fs/memory/memory.limit_in_bytes": unlimited, "fs/memory/memory.usage_in_bytes": "1\n"})
    h = memory_headroom(str(tmp_path / "proc"), str(tmp_path / "fs"), NO_SWAP)
    assert h is not None and h.where.endswith("memory/a") and h.available == 512 * MiB - 300 * MiB


def test_no_limit_or_nothing_readable_is_none(tmp_path):
    _files(tmp_path, {"proc": "0::/\n", "fs/memory.max": "max\n", "fs/memory.current": "5\n"})
    assert memory_headroom(str(tmp_path / "proc"), str(tmp_path / "fs"), NO_SWAP) is None
    assert memory_headroom(str(tmp_path / "missing"), str(tmp_path / "fs"), NO_SWAP) is None
    _files(tmp_path, {"proc2": "0::/gone\n"})
    assert memory_headroom(str(tmp_path / "proc2"), str(tmp_path / "nowhere"), NO_SWAP) is None


def _make_cgroup(limit: int) -> Path:
    """A real memory cgroup with ``limit`` (v1 or v2), or skip saying why one cannot be made here."""
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    name = f"tiered_ckpt_test_{uuid.uuid4().hex[:8]}"
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            cg = v1 / name
            cg.mkdir()
            (cg / "memory.limit_in_bytes").write_text(str(limit))
        elif "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            cg = v2 / name
            cg.mkdir()
            (cg / "memory.max").write_text(str(limit))
            (cg / "memory.swap.max").write_text("0")
        else:
            pytest.skip("no memory cgroup can be made here (cgroup v2 without the memory controller delegated)")
    except OSError as exc:
        pytest.skip(f"no memory cgroup can be made here ({exc}): needs root and a writable cgroup filesystem")
    return cg


SAVE = textwrap.dedent("""
    import json, sys, torch
    from tiered_ckpt import CheckpointEngine
    from tiered_ckpt.errors import CapacityError
    cfg = json.loads(sys.argv[1])
    state = {"w": torch.ones(300 << 18)}  # 300 MiB of fp32
    with CheckpointEngine(cfg) as engine:
        try:
            engine.prepare({"model": state})  # two slots of 300 MiB
        except CapacityError as exc:
            print("REFUSED", exc, flush=True)
            raise SystemExit(3)
    print("PREPARED", flush=True)
""")


def test_slots_beyond_a_real_memory_limit_are_refused_not_oom_killed(tmp_path, shm_root):
    """In a real memory cgroup of 1 GiB: torch, a 300 MiB state and one 300 MiB slot fit, the second slot does
    not. Without the check the kernel killed the process while it pre-faulted that slot."""
    cg = _make_cgroup(1024 * MiB)
    try:
        cfg = {"run_id": f"cg{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
               "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root), "slots": 2}]}
        procs = cg / "cgroup.procs"
        proc = subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$0" -c "$1" "$2"', sys.executable, SAVE,
                               json.dumps(cfg)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 3, f"exit {proc.returncode}:\n{out[-3000:]}"
        assert "REFUSED" in out and "memory limit: 1.00 GiB" in out and "hold fewer or smaller slots" in out, out
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:  # the child's pages are still being uncharged
                import time

                time.sleep(0.1)
