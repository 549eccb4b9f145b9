"""The CUDA copy path: side streams for the snapshot's copies, and page-locking (``cudaHostRegister``) of host
memory.

Nothing here touches CUDA unless handed a CUDA device or asked to pin: importing this module, and any call made
with CPU tensors only, never initialises CUDA (the drain worker process and CPU-only users must stay clear of it).

* **Side streams.** Copies a snapshot makes from or to CUDA run on a stream of their own per device and purpose
  (``"snapshot"`` for ``save()``, ``"drain"`` for the drain's hops), created once and cached. The side stream
  first waits for the work already queued on the caller's current stream (the training step that produced the
  tensors), and the caller then waits on an event recorded after the copies: only those copies, never the
  training kernels queued since, as ``torch.cuda.synchronize()`` would. Purposes get separate streams so a long
  device-to-host drain never queues in front of the next ``save()``'s copies.
* **Page-locking.** :func:`host_register` pins a host range so device-to-host copies into it run at DMA speed
  instead of through the driver's staging buffer; a failure is returned, never raised, and the thread's CUDA
  error state is cleared (torch checks ``cudaGetLastError`` after its kernels, so a stale registration error
  would otherwise surface in whatever kernel this thread launches next).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: the slot is copied to and from by this process's devices

_streams: dict[tuple[str, torch.device], Any] = {}
_streams_lock = threading.Lock()
_cudart_lib: Any = None  # ctypes handle of the libcudart torch loaded; False once looked for in vain


def cuda_in_use() -> bool:
    """Whether this process has already initialised CUDA (it copies from the GPU). Touches nothing: a process
    that never used CUDA, like the drain worker, answers False without loading the driver."""
    return torch.cuda.is_initialized()


def cuda_devices(*tensors: torch.Tensor) -> list[torch.device]:
    """The distinct CUDA devices among ``tensors``' devices, in a stable order (empty: nothing to do)."""
    return sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)


def _normalise(device: torch.device) -> torch.device:
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def side_stream(device: torch.device, purpose: str = "snapshot") -> Any:
    """The cached side stream of ``device`` for ``purpose`` (created on first use)."""
    key = (purpose, _normalise(device))
    stream = _streams.get(key)
    if stream is None:
        with _streams_lock:
            stream = _streams.get(key)
            if stream is None:
                stream = _streams[key] = torch.cuda.Stream(device=key[1])
    return stream


@contextlib.contextmanager
def on_side_streams(devices: Iterable[torch.device], purpose: str = "snapshot", *, synchronize: bool = True,
                    wait_current: bool = True, blocking: bool = False) -> Iterator[None]:
    """Run the body's CUDA work on the side streams of ``devices`` (each the thread's current stream meanwhile).

    ``wait_current``: the side streams first wait for what is already queued on the current streams (the
    sources may still be being computed there; a destination freshly allocated on the current stream may still
    be in use by work queued before its reuse). On exit, even after an exception (no copy may outlive the call
    unseen), ``synchronize`` waits on an event recorded after the body's work: the host then knows the copies
    are done and the sources may change. ``synchronize=False`` makes the current streams wait for the side
    streams instead, so later work there (an optimizer step overwriting a source, the allocator reusing a
    block) is ordered after the copies without blocking the host. ``blocking`` events yield the CPU while
    waiting instead of spinning (for background threads; the save path spins for the lowest latency).
    """
    pairs = []
    for device in devices:
        side = side_stream(device, purpose)
        current = torch.cuda.current_stream(side.device)
        if wait_current:
            side.wait_stream(current)
        pairs.append((side, current))
    try:
        with contextlib.ExitStack() as stack:
            for side, _ in pairs:
                stack.enter_context(torch.cuda.stream(side))
            yield
    finally:
        events = []
        for side, current in pairs:
            if synchronize:
                event = torch.cuda.Event(blocking=blocking)
                event.record(side)
                events.append(event)
            else:
                current.wait_stream(side)
        for event in events:
            event.synchronize()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, *, purpose: str = "drain", blocking: bool = True) -> None:
    """``dst.copy_(src)``, complete when this returns; on a side stream when either side is on CUDA.

    For the drain's hops between memory tiers: the source is a snapshot slot whose copies finished before it was
    published, so the side stream waits for the current stream only when the destination is on CUDA (ordering
    its reuse of a freshly allocated block); a device-to-host hop does not queue behind training kernels.
    """
    devices = cuda_devices(dst, src)
    if not devices:
        dst.copy_(src)
        return
    with on_side_streams(devices, purpose, wait_current=dst.device.type == "cuda", blocking=blocking):
        dst.copy_(src, non_blocking=True)


# ----- page-locking ---------------------------------------------------------------------------------------------
def host_register(ptr: int, nbytes: int) -> str | None:
    """``cudaHostRegister`` ``nbytes`` of host memory at ``ptr``. None on success, else the CUDA error (the
    memory then stays pageable and usable as before)."""
    return _cudart_call(lambda cudart: cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_DEFAULT))


def host_unregister(ptr: int) -> str | None:
    """``cudaHostUnregister`` of a range :func:`host_register` pinned; None on success, else the CUDA error."""
    return _cudart_call(lambda cudart: cudart.cudaHostUnregister(ptr))


def _cudart_call(call: Any) -> str | None:
    try:
        cudart = torch.cuda.cudart()
        rc = call(cudart)
    except Exception as exc:  # CUDA that cannot start here, a binding that refuses the call: report, not raise
        return f"{type(exc).__name__}: {exc}"
    if int(rc) == 0:
        return None
    error = _error_text(cudart, rc)
    clear_last_error()
    return error


def _error_text(cudart: Any, rc: Any) -> str:
    try:
        return f"{cudart.cudaGetErrorString(rc)} (cudaError {int(rc)})"
    except Exception:
        return f"cudaError {int(rc)}"


def clear_last_error() -> None:
    """Reset this thread's last CUDA runtime error (``cudaGetLastError``), which torch's bindings do not expose:
    through the libcudart already loaded in this process (dlopen of a loaded path returns that same library)."""
    global _cudart_lib
    if _cudart_lib is None:
        _cudart_lib = _find_cudart() or False
    if _cudart_lib is False:
        log.debug("libcudart not found in this process: the failed CUDA call's error is left set")
        return
    try:
        _cudart_lib.cudaGetLastError()
    except Exception as exc:  # never let clean-up fail the save
        log.debug("cudaGetLastError failed: %s", exc)


def _find_cudart() -> Any:
    try:
        with open("/proc/self/maps") as f:
            fields = (line.split(None, 5) for line in f if "libcudart" in line)
            paths = {parts[5].strip() for parts in fields if len(parts) == 6}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cudaGetLastError  # noqa: B018 - the lookup is the check
            return lib
        except (OSError, AttributeError):
            continue
    try:  # libcudart linked in globally (a static or RTLD_GLOBAL build)
        lib = ctypes.CDLL(None)
        lib.cudaGetLastError  # noqa: B018
        return lib
    except (OSError, AttributeError):
        return None
