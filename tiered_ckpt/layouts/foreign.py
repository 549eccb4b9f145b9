"""Step directories another program wrote: Megatron-LM's (or DLRover's) torch files, PyTorch DCP's files.

Such a directory holds no manifest of ours, so nothing in it can be verified, but it is a checkpoint the user
may need (a job that switches to tiered_ckpt keeps writing into the directory Megatron-LM wrote): retention and
``gc`` never remove it as debris, and ``ls`` says who wrote it (docs/operations.md, "What `gc` may touch"). A
directory holding any manifest of ours (``tiered_ckpt/``) is ours, so a step of ours that crashed after its
first rank manifest is debris as before; one that crashed before it looks foreign and is left in place (a
leak to remove by hand), never a lost checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable

from .base import META_DIR
from .dcp import METADATA_NAME

MEGATRON_FILES = frozenset({"model_optim_rng.pt", "distrib_optim.pt"})  # Megatron-LM's and DLRover's names
DCP_STATE = "dcp, no manifest (written by DCP: nothing to verify)"
MEGATRON_STATE = "megatron, no manifest (written by Megatron-LM or DLRover: nothing to verify)"


def foreign_step_dirs(keys: Iterable[str]) -> dict[str, str]:
    """The top-level directories of a tier's listing ``keys`` that another program wrote, each with its ``ls``
    state. A directory with DCP's ``.metadata`` counts whatever else it holds (a committed ``dcp`` step is
    listed as committed before this is asked); one with Megatron's files only without any manifest of ours."""
    ours: set[str] = set()
    dcp: set[str] = set()
    megatron: set[str] = set()
    for key in keys:
        top, _, rest = key.partition("/")
        if not rest:
            continue
        name = rest.rpartition("/")[2]
        if rest.startswith(META_DIR + "/"):
            ours.add(top)
        elif METADATA_NAME.match(name):
            dcp.add(top)
        elif name in MEGATRON_FILES:
            megatron.add(top)
    found = {d: MEGATRON_STATE for d in megatron - ours}
    found.update({d: DCP_STATE for d in dcp})
    return found
