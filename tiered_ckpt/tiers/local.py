"""``local``: blobs as files on a node-local disk (NVMe, SSD), durable once ``write_blob`` returns.

A write goes to a temporary file in the target directory, written straight from the callers' buffers (with
``O_DIRECT`` past the page cache when ``direct_io`` allows it, see :mod:`._direct_io`; else ``os.write`` and
``writev``), ``fsync``-ed, renamed over the key, and the directory (and any directory it created) ``fsync``-ed:
after a crash the key holds the old blob or the new one, never a torn one. A disk that fills up raises
:class:`~tiered_ckpt.errors.PermanentTierError` ("disk full") and leaves no temporary file behind.

Reads go into fresh private memory, in 32 MiB pieces on several threads (``preadv``), hashed in order as they
arrive when the caller verifies (``read_blob_hashed``). Not zero-copy: a mapping of the file would turn a disk
error into SIGBUS instead of a fallback to the next tier, re-read pages dropped under memory pressure after
they were verified, and follow any later write to the file.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import ConfigError, PermanentTierError
from ._files import BlobFiles, FilesHousekeeping
from ._positional import PositionalFiles
from .base import (
    Capabilities,
    Chunk,
    Tier,
    TierContext,
    check_key,
    file_in_path,
    first_missing_dir,
    not_a_directory,
)

log = logging.getLogger(__name__)

# Why the tier's directory could not be made, where the configuration is what to change.
_CREATE_FIXES = {
    errno.ENOTDIR: "a part of that path is a file: give a path whose every parent is a directory",
    errno.EACCES: "this user may not create it there: create it beforehand, with write access, or give a path "
                  "under a directory this user can write",
    errno.EPERM: "this user may not create it there: create it beforehand, with write access, or give another path",
    errno.EROFS: "that filesystem is mounted read-only: give a path on a writable one",
}


@dataclass(frozen=True)
class LocalOptions:
    path: str  # the directory holding this tier's blobs (created if missing)
    fsync: bool = True  # fsync files and directories (turn off only for tests or throw-away runs)
    # Write files with O_DIRECT, past the page cache (see _direct_io), and read large ones back that way; "auto":
    # when fsync is on and the filesystem takes it. Buffered writes are paced by the kernel's dirty-page
    # throttling, direct ones are not; buffered reads copy every byte out of the page cache.
    direct_io: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: expected a directory, got an empty string")


def said_if_parents_made(name: str, root: str, top: str | None) -> None:
    """A warning when making ``root`` made directories above it too (``top``: :func:`first_missing_dir` before):
    a checkpoint directory under a mount point that is not mounted (a node's SSD, a network file system) is made
    on the disk below it, and a resume there finds nothing: never without a word."""
    if top is not None and top != root:
        log.warning("tier %r: created %s and the directories above it from %s, which did not exist: if %s should "
                    "be a mounted file system, it is not mounted, and checkpoints go to the disk below (where a "
                    "restart finds none of the mounted one's)", name, root, top, top)


class LocalTier(FilesHousekeeping, Tier):
    kind = "local"
    capabilities = Capabilities(memory=False, node_local=True, survives_process=True,
                                atomic_rename=True, zero_copy_read=False)
    Options = LocalOptions

    def __init__(self, name: str, options: LocalOptions, context: TierContext | None = None):
        super().__init__(name, options, context)
        self.root = os.path.abspath(os.path.expanduser(options.path))
        blocker = file_in_path(self.root)
        if blocker is not None:
            raise ConfigError(f"{not_a_directory(self.root, blocker)}: give the tier the directory that holds (or "
                              "will hold) its checkpoints", key_path=f"tier {name!r}.path")
        top = first_missing_dir(self.root)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            fix = _CREATE_FIXES.get(exc.errno or 0)
            if fix is not None:
                raise ConfigError(f"cannot create the directory {self.root}: {exc.strerror}; {fix}",
                                  key_path=f"tier {name!r}.path") from exc
            raise PermanentTierError(f"cannot create the directory {self.root}: {exc.strerror or exc}",
                                     tier=name) from exc
        if not os.path.isdir(self.root):
            raise PermanentTierError(f"{self.root} is not a directory", tier=name)
        said_if_parents_made(name, self.root, top)
        direct = options.fsync if options.direct_io == "auto" else bool(options.direct_io)
        self.files = BlobFiles(name, self.root, file_mode=0o644, dir_mode=0o755, fsync=options.fsync,
                               direct_io=direct)

    def write_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        return self.files.write(check_key(key), chunks)

    def read_blob(self, key: str) -> torch.Tensor:
        return self.files.read_into_tensor(key)

    def read_blob_hashed(self, key: str, hasher: Any = None, max_size: int | None = None) -> torch.Tensor:
        return self.files.read_into_tensor(key, hasher, max_size)

    def delete(self, key: str) -> None:
        self.files.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self.files.delete_prefix(prefix)

    def positional(self) -> PositionalFiles:
        return PositionalFiles(self.files)

    def describe(self) -> str:
        return f"local {self.root}" + ("" if self.options.fsync else " (fsync off)") + (
            ", O_DIRECT" if self.files.direct_io else "")
