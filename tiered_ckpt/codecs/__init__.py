"""Codecs: how an item (a nested state dict) becomes bytes on a tier.

``flat`` is the memory-tier snapshot codec: one contiguous buffer of tensor bytes plus a JSON header.
"""
