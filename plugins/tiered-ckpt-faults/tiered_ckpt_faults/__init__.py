"""tiered-ckpt-faults: the ``faulty`` tier kind, for testing what tiered_ckpt does when storage misbehaves.

Installed, it registers through the ``tiered_ckpt`` entry-point group like any third-party plugin::

    tiers:
      - name: flaky-nvme
        kind: faulty
        inner: {kind: local, path: /tmp/ckpt}
        transient_errors: 2
        control_file: /tmp/faults.json

See README.md for every fault and for changing faults while a job runs.
"""

from __future__ import annotations

from tiered_ckpt.hookspecs import hookimpl

from .faulty import (
    DEFAULT_OPS,
    FAULT_OPS,
    FaultControl,
    FaultSettings,
    FaultyOptions,
    FaultyTier,
    write_control_file,
)

__all__ = [
    "DEFAULT_OPS", "FAULT_OPS", "FaultControl", "FaultSettings", "FaultyOptions", "FaultyTier",
    "write_control_file", "tiered_ckpt_register_tiers",
]


@hookimpl
def tiered_ckpt_register_tiers(registry):
    registry.add("faulty", FaultyTier)
