"""pytest fixtures for code that uses or extends tiered_ckpt. Opt-in: ``pytest -p tiered_ckpt.testing.pytest_plugin``,
or in a ``conftest.py`` at the top of your tests::

    pytest_plugins = ["tiered_ckpt.testing.pytest_plugin"]

(It is not a ``pytest11`` entry point: a pytest run that does not ask for it neither imports it nor gains its
fixtures.)

* ``shm_root``: a fresh directory under ``/dev/shm``, removed afterwards (``tmp_path`` where there is none).
* ``tier_context``: a :class:`~tiered_ckpt.tiers.base.TierContext` with a unique ``run_id``.
* ``tier_registry`` (session): every registered tier kind, built-ins and ``tiered_ckpt`` entry points.
  Override it in a ``conftest.py`` to test a kind that is not installed.
* ``make_tier(kind, *, name=None, context=None, **options)``: a tier of a registered kind, its options
  validated like a configuration file's. Missing locations default to throw-away ones (``shm``: ``shm_root``;
  ``local``: under ``tmp_path``; ``fsspec``: a unique ``memory://`` root; ``gpu``: ``cuda`` if present, else
  ``cpu``). Every tier made is closed, and default ``memory://`` roots are emptied, when the test ends.
* ``s3_server`` (session), ``s3_bucket``, ``s3_fault_proxy``: moto's S3 server over HTTP on a free loopback
  port, a fresh bucket per test, and a fault-injecting proxy in front of it (``tiered_ckpt.testing.s3``).

Loading it costs nothing until a fixture is used: it imports only the standard library and pytest (and
``tiered_ckpt``'s package, whose names load on first use); torch and the rest are imported inside the fixtures.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .s3 import s3_bucket, s3_fault_proxy, s3_server  # noqa: F401 - fixtures; moto is imported inside them

SHM_BASE = "/dev/shm"


def build_tier_registry(*, load_entry_points: bool = True, extra_plugins: tuple[Any, ...] = ()) -> Any:
    """A registry of every tier kind: the built-ins, the ``tiered_ckpt`` entry points and ``extra_plugins``,
    with the same order and conflict rules as the library's own plugin manager (it is that manager's)."""
    from tiered_ckpt.plugins import PluginManager

    return PluginManager(load_entry_points=load_entry_points, extra_plugins=extra_plugins).registries.tiers


@pytest.fixture
def shm_root(tmp_path: Any) -> Iterator[str]:
    """A fresh directory on ``/dev/shm`` (tmpfs), removed after the test (under ``tmp_path`` if none)."""
    if os.path.isdir(SHM_BASE) and os.access(SHM_BASE, os.W_OK | os.X_OK):
        path = tempfile.mkdtemp(prefix="tiered-ckpt-test-", dir=SHM_BASE)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    else:
        path = tmp_path / "shm"
        path.mkdir()
        yield str(path)


@pytest.fixture
def tier_context() -> Any:
    """A :class:`~tiered_ckpt.tiers.base.TierContext` with a run_id no other test uses."""
    from tiered_ckpt.tiers.base import TierContext

    return TierContext(run_id=f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def tier_registry() -> Any:
    """Every registered tier kind (override in a conftest.py to add kinds that are not installed)."""
    return build_tier_registry()


@pytest.fixture
def make_tier(tier_registry: Any, tier_context: Any, tmp_path: Any, shm_root: str) -> Iterator[Callable[..., Any]]:
    """Factory: ``make_tier("local", fsync=False)``, ``make_tier("shm", min_free="1GiB")``, ...

    ``shm_root`` is asked for here, not when the first shm tier is made: fixtures end in the reverse order of
    their start, so the directory is removed after the tiers made in it are closed (closing one may still write
    there, which left directories behind in ``/dev/shm``)."""
    from tiered_ckpt.validate import build_dataclass

    made: list[Any] = []
    scratch_urls: list[tuple[Any, str]] = []
    counter = itertools.count()

    def make(kind: str, *, name: str | None = None, context: Any = None, **options: Any) -> Any:
        cls = tier_registry.get(kind)
        name = name or f"{kind}{next(counter)}"
        options = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in options.items()}
        defaulted_url = False
        if kind == "shm" and "path" not in options:
            options["path"] = shm_root
        elif kind == "local" and "path" not in options:
            options["path"] = str(tmp_path / name)
        elif kind == "fsspec" and "url" not in options:
            options["url"] = f"memory://tiered-ckpt-test/{uuid.uuid4().hex}"
            defaulted_url = True
        elif kind == "gpu" and "device" not in options:
            import torch

            options["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        opts = build_dataclass(cls.Options, options, f"make_tier({kind!r})", "make_tier")
        tier = cls(name, opts, context or tier_context)
        made.append(tier)
        if defaulted_url:
            scratch_urls.append((tier, options["url"]))
        return tier

    yield make
    for tier in reversed(made):
        with contextlib.suppress(Exception):
            tier.close()
    for tier, _url in scratch_urls:
        with contextlib.suppress(Exception):
            tier.fs.rm(tier.root, recursive=True)
