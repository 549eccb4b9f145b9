"""What every candidate script shares: arguments, memory accounting, page-cache dropping, copying into existing
tensors, and the JSON it hands back to ``run_all.py``.

Each candidate runs in its own process (``run_all.py`` starts one per candidate, state and round), so peak RSS
numbers never mix. Only the standard library and torch are used here: the DLRover candidate imports this module
from its own virtual environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO = BENCH_DIR.parent
for p in (str(BENCH_DIR), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import limits  # noqa: E402
import states  # noqa: E402
import torch  # noqa: E402

MIB = 1 << 20


# ----- arguments and results ------------------------------------------------------------------------------------
def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--state", required=True, choices=sorted(states.STATES))
    ap.add_argument("--quick", action="store_true", help="the smaller variant of the state")
    ap.add_argument("--workdir", required=True, help="a fresh directory on the local disk for this run")
    ap.add_argument("--warm", type=int, default=3, help="warm saves to time")
    ap.add_argument("--series", type=int, default=8, help="ours: warm saves of the blocking-only series")
    ap.add_argument("--overlap", type=int, default=6, help="ours: warm saves issued while the previous drains")
    ap.add_argument("--out", required=True, help="write the result JSON here")
    return ap.parse_args()


def write_result(path: str, result: dict[str, Any]) -> None:
    result.setdefault("torch", torch.__version__)
    result.setdefault("pid", os.getpid())
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.t0


# ----- memory ---------------------------------------------------------------------------------------------------
_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The RSS fields of ``/proc/<pid>/status`` in bytes (empty if the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of ``pid`` (default: this process), from ``/proc/<pid>/task/*/children``."""
    pid = os.getpid() if pid is None else pid
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            for k in kids:
                if k not in found:
                    found.append(k)
                    todo.append(k)
    return found


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemorySampler:
    """Samples this process's and its descendants' RSS every ``interval`` s on a thread.

    The kernel's own peak (VmHWM, reset with :func:`reset_peak_rss`) catches every spike of this process; the
    samples split it into anonymous (private), file and shared-memory pages, and follow helper processes (a
    drain worker, DLRover's saver), whose private memory is what a save may add beyond the slots.
    """

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.self_max: dict[str, int] = {}
        self.kids_anon_max = 0  # the largest sum of the descendants' RssAnon seen
        self.kids_rss_max = 0
        self.kids_anon_start: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def kids(self) -> dict[int, dict[str, int]]:
        return {k: proc_status(k) for k in descendants()}

    def start(self) -> MemorySampler:
        self.kids_anon_start = sum(s.get("RssAnon", 0) for s in self.kids().values())
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        st = proc_status()
        for k, v in st.items():
            if v > self.self_max.get(k, 0):
                self.self_max[k] = v
        kids = self.kids()
        self.kids_anon_max = max(self.kids_anon_max, sum(s.get("RssAnon", 0) for s in kids.values()))
        self.kids_rss_max = max(self.kids_rss_max, sum(s.get("VmRSS", 0) for s in kids.values()))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {"self_max": dict(self.self_max), "kids_anon_max": self.kids_anon_max,
                "kids_rss_max": self.kids_rss_max, "kids_anon_start": self.kids_anon_start}


def wait_children_settled(timeout: float = 20.0, quiet_s: float = 0.6) -> int:
    """Wait until the descendants' private memory stops growing (a helper process importing torch), so that
    their baseline is taken before a save, not during their start-up. Returns that baseline in bytes."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        anon = sum(proc_status(k).get("RssAnon", 0) for k in descendants())
        if anon != last and abs(anon - last) > 4 * MIB:
            last, since = anon, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return anon
        time.sleep(0.1)
    return max(last, 0)


def memory_report(before: dict[str, int], peak: dict[str, int], sampled: dict[str, Any], slot_bytes: int,
                  kids_baseline: int) -> dict[str, Any]:
    """Host memory a save added: this process's peak RSS over its RSS before, less the slot (or staging) bytes,
    plus the growth of helper processes' private memory over their idle baseline."""
    hwm = peak.get("VmHWM", 0)
    grew = hwm - before.get("VmRSS", 0)
    kids_growth = max(0, sampled["kids_anon_max"] - kids_baseline)
    return {
        "rss_before_mib": before.get("VmRSS", 0) / MIB,
        "peak_rss_mib": hwm / MIB,
        "peak_rss_shmem_mib": sampled["self_max"].get("RssShmem", 0) / MIB,
        "peak_rss_anon_mib": sampled["self_max"].get("RssAnon", 0) / MIB,
        "slot_mib": slot_bytes / MIB,
        "grew_mib": grew / MIB,
        "extra_beyond_slots_mib": (grew - slot_bytes) / MIB,
        "helper_baseline_mib": kids_baseline / MIB,
        "helper_peak_rss_mib": sampled["kids_rss_max"] / MIB,
        "helper_growth_mib": kids_growth / MIB,
        "extra_total_mib": (grew - slot_bytes + kids_growth) / MIB,
    }


# ----- disk and tensors -----------------------------------------------------------------------------------------
def drop_cache(root: str) -> int:
    """Evict every file under ``root`` from the page cache (``posix_fadvise(DONTNEED)``; the files must be
    clean, i.e. written and synced), so a restore reads the disk. Returns the bytes dropped."""
    dropped = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            path = os.path.join(dirpath, n)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return dropped


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (for peers that do not fsync what they write)."""
    for dirpath, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def copy_into(dst: Any, src: Any) -> int:
    """Copy ``src``'s tensors into ``dst``'s same-named tensors in place (what ``model.load_state_dict`` does);
    returns the bytes copied. Non-tensor leaves are ignored."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
        return dst.numel() * dst.element_size()
    if isinstance(dst, dict):
        return sum(copy_into(v, src[k]) for k, v in dst.items())
    if isinstance(dst, (list, tuple)):
        return sum(copy_into(a, b) for a, b in zip(dst, src, strict=True))
    return 0


def same_tensors(a: Any, b: Any) -> bool:
    """True when every tensor of ``a`` equals the same-named one of ``b`` (a spot check of restores)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and all(k in b and same_tensors(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_tensors, a, b))
    return True


class CopyBaseline:
    """The machine's copy limit, measured next to the candidate in the same process: the state's tensors copied
    into (``copy_in``) or out of (``copy_out``) a pre-faulted ``/dev/shm`` buffer (``limits.prefaulted_shm``).
    Timing it between a candidate's saves or restores gives pairs taken under the same load, so their ratio is
    far steadier than limits measured at another time on a busy machine.

    Each call times every way of ``limits.ParallelCopy`` (``limits.COPY_WAYS``): ``Tensor.copy_`` piece by piece
    (``single``), the bytes split over ``torch.get_num_threads()`` threads (``threaded``), and the same with
    streaming stores (``streaming``), the order rotating from call to call; the ceiling is the way with the
    lowest median (``run_all.py`` decides, from every sample).

    The buffer is at most ``ring`` bytes (256 MiB): tensors are copied through it piece by piece, wrapping
    around, so the baseline adds little memory (the machine is shared) while every copy still goes to
    pre-faulted pages far larger than any cache. For the threaded way each thread has its own segment of the
    ring, so no two threads ever write the same bytes. Every view is made up front."""

    def __init__(self, tensors: list[torch.Tensor], ring: int = 256 * MIB, threads: int | None = None):
        self.flat = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        self.starts, pos = [], 0
        for t in self.flat:
            self.starts.append(pos)
            pos += t.numel()
        self.nbytes = pos
        self.threads = max(1, threads or torch.get_num_threads())
        self.mm, buf = limits.prefaulted_shm(max(self.threads, min(ring, self.nbytes)))
        self.buf = buf
        size = buf.numel()
        self.pairs = self._wrapped(0, self.nbytes, 0, size)  # (piece of the state, piece of the buffer)
        per = max(1, -(-self.nbytes // self.threads))
        seg = size // self.threads
        bounds = [(k * per, min(self.nbytes, (k + 1) * per)) for k in range(self.threads)]
        groups_in = [self._wrapped(lo, hi, k * seg, seg) for k, (lo, hi) in enumerate(bounds) if lo < hi]
        self.par_in = limits.ParallelCopy(self.pairs, self.threads, groups=groups_in)
        # copy_out, threaded: in rounds of one segment per thread; before each round (untimed) the segments get
        # that round's bytes, so what is copied out is the state's own bytes.
        self.out_rounds: list[tuple[limits.ParallelCopy, limits.ParallelCopy]] = []
        for r in range(-(-per // seg) if seg else 0):
            fill, back = [], []
            for k, (lo, hi) in enumerate(bounds):
                a, b = lo + r * seg, min(hi, lo + (r + 1) * seg)
                if a < b:
                    pieces = self._wrapped(a, b, k * seg, seg)
                    fill.append(pieces)
                    back.append([(d, s_) for s_, d in pieces])
            self.out_rounds.append((limits.ParallelCopy([p for g in fill for p in g], groups=fill),
                                    limits.ParallelCopy([p for g in back for p in g], groups=back)))
        self.samples: dict[str, dict[str, list[float]]] = {}  # label ("in", "out", ...) → way → seconds
        self._calls = 0

    def _wrapped(self, lo: int, hi: int, base: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(state slice, buffer slice) pairs for the state's bytes [lo, hi), placed in buf[base:base + size]
        from its start, wrapping around."""
        out, pos = [], 0
        for t, start in zip(self.flat, self.starts, strict=True):
            a, b = max(lo, start), min(hi, start + t.numel())
            while a < b:
                n = min(b - a, size - pos)
                out.append((t[a - start:a - start + n], self.buf[base + pos:base + pos + n]))
                a += n
                pos = (pos + n) % size
        return out

    def _single_out(self) -> float:
        elapsed = 0.0
        for src, dst in self.pairs:
            dst.copy_(src)
            t0 = time.perf_counter()
            src.copy_(dst)
            elapsed += time.perf_counter() - t0
        return elapsed

    def _rounds_out(self, way: str) -> float:
        elapsed = 0.0
        for fill, back in self.out_rounds:
            fill.threaded()
            elapsed += getattr(back, way)()
        return elapsed

    def _every_way(self, kind: str, ways: dict[str, Callable[[], float]]) -> float:
        self._calls += 1
        got = self.samples.setdefault(kind, {w: [] for w in ways})
        names = list(ways)
        k = self._calls % len(names)
        for name in names[k:] + names[:k]:
            got[name].append(ways[name]())
        return min(got[w][-1] for w in names)

    def copy_in(self, label: str = "in") -> float:
        """One sample of each way into the buffer; returns the fastest (all are kept in ``samples[label]``: a
        different label keeps samples taken under other conditions apart)."""
        return self._every_way(label, {w: getattr(self.par_in, w) for w in limits.COPY_WAYS})

    def copy_out(self) -> float:
        """One sample of each way from the buffer into the state's own tensors (pre-faulted, like a model's);
        before each piece, untimed, the buffer is given that piece's bytes, so the state never changes. (The
        tail of a piece may still be in the CPU cache then, which can only flatter this limit.)"""
        return self._every_way("out", {w: (self._single_out if w == "single" else
                                           lambda w=w: self._rounds_out(w)) for w in limits.COPY_WAYS})

    def report(self) -> dict[str, Any]:
        """Every sample of every way, for the result JSON (``limit_copy_ways``)."""
        return {"threads": self.threads, **{k: {w: list(v) for w, v in d.items()} for k, d in self.samples.items()}}

    def close(self) -> None:
        self.par_in.close()
        for a, b in self.out_rounds:
            a.close()
            b.close()
        self.pairs, self.out_rounds, self.flat, self.buf = [], [], [], None
        gc.collect()
        try:
            self.mm.close()
        except BufferError:
            pass


def write_fsync_seconds(tensors: list[torch.Tensor], directory: str) -> float:
    """One raw write + fsync of the tensors' bytes to a new file (``limits.write_fsync_seconds``)."""
    os.makedirs(directory, exist_ok=True)
    return limits.write_fsync_seconds(tensors, directory, repeats=1)


def direct_io(tensors: list[torch.Tensor], directory: str) -> tuple[limits.DirectIO, dict[str, Any]]:
    """The ``O_DIRECT`` ceilings for the tensors' bytes (``limits.DirectIO``; make it before a memory window:
    its buffer is baseline, not the candidate's), and how many requests in flight this disk wants for writes
    and reads (``best_threads``, measured once, here)."""
    os.makedirs(directory, exist_ok=True)
    d = limits.DirectIO(tensors, directory)
    return d, d.best_threads(repeats=1)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def settle() -> None:
    gc.collect()
    time.sleep(0.2)


def open_memory_window() -> tuple[dict[str, int], bool, MemorySampler]:
    """The start of every measured phase: settle, take the RSS baseline, reset the kernel's peak, start sampling.
    Returns (baseline status, whether the peak could be reset, the running sampler)."""
    settle()
    before = proc_status()
    reset = reset_peak_rss()
    return before, reset, MemorySampler().start()
