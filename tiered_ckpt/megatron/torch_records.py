"""Pieces of ``torch.save``'s format that its writer (:mod:`.torch_zip`) and its lazy reader (:mod:`.lazy_torch`)
share: kept here so that neither imports the other.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch

ZIP64_MARKER = 0xFFFFFFFF  # the "see the zip64 extra field" marker
DICTS = (dict, collections.OrderedDict)  # containers walked (Megatron's model state is an OrderedDict)


def same_dict(like: dict, items: Iterable[tuple[Any, Any]]) -> dict:
    """A dict of ``like``'s type with ``items``, keeping instance attributes (a state dict's ``_metadata``)."""
    out = type(like)(items)
    if type(like) is not dict and vars(like):
        out.__dict__.update(vars(like))
    return out  # one object each: the pickle memoizes them as torch's does


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
