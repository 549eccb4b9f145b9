"""Print the declared lower bounds of tiered-ckpt's dependencies as exact pins, one requirement a line.

`make lowest` installs them (after torch, pinned by TORCH_SPEC: an unpinned resolve pulls a multi-GB CUDA build)
into .venv-lowest and runs a smoke subset there, so that every ``>=`` in pyproject.toml is one that works.
Read: ``dependencies`` and the ``test`` extra (the smoke subset runs with it); ``X>=1.2,<2`` becomes ``X==1.2``
and environment markers are kept. Left out: torch (installed first, on its own: ``--torch`` prints its floor
alone) and megatron-core (only tests/megatron_real use it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli
    from pip._vendor import tomli as tomllib

SKIP = {"torch", "megatron-core"}
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def lower_bounds(project: dict, only: str | None = None) -> list[str]:
    specs = list(project["dependencies"]) + list(project["optional-dependencies"]["test"])
    if only is not None:
        specs = [s for s in specs if re.match(rf"\s*{re.escape(only)}\b", s, re.IGNORECASE)]
    out: dict[str, str] = {}
    for spec in specs:
        requirement, _, marker = spec.partition(";")
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*?)\s*", requirement)
        if m is None:
            raise SystemExit(f"cannot read the requirement {spec!r}")
        name, extras, versions = m.groups()
        if name.lower() in SKIP and name.lower() != only:
            continue
        low = re.search(r">=\s*([0-9][^,\s]*)", versions)
        if low is None:
            raise SystemExit(f"{spec!r} declares no lower bound: add one (and make lowest tests it)")
        pin = f"{name}{extras or ''}=={low.group(1)}" + (f"; {marker.strip()}" if marker.strip() else "")
        out.setdefault(name.lower(), pin)
    return list(out.values())


if __name__ == "__main__":
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    only = "torch" if sys.argv[1:] == ["--torch"] else None
    pins = lower_bounds(project, only)
    if only and len(pins) != 1:
        raise SystemExit("pyproject.toml declares no torch requirement with a lower bound")
    sys.stdout.write("".join(f"{line}\n" for line in pins))
