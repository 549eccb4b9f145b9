"""An item decoded from one file codec, made ready for another: what a file tier whose configuration names a
different codec (``codec``/``codecs``, docs/configuration.md) writes when it copies a step from another file tier."""

from __future__ import annotations

from typing import Any

import torch

from . import flat
from .file_codecs import ItemSource


def item_source(name: str, obj: Any) -> ItemSource:
    """``obj`` (a decoded item) as the flat header and tensor bytes every file codec encodes from."""
    plan = flat.plan_snapshot(obj)
    data = torch.empty(plan.total_bytes, dtype=torch.uint8)
    flat.copy_into(plan, data)
    return ItemSource(name, flat.encode_header(plan), data)
