"""When bytes written without an fsync may be trusted without reading them again: only on the
boot that wrote them, and only on a disk of this machine.

Data still in the page cache is lost only when the kernel is: a kernel crash or a power loss,
both of which end the boot, and Linux names each boot (`/proc/sys/kernel/random/boot_id`). A
stamp that records the boot it was written on therefore describes bytes that are either on disk
or still in this kernel's memory; on any other boot it is not trusted and the output is re-hashed
(refused and rebuilt or pulled again when damaged). A network file system breaks that reasoning
(its server can lose data while this machine stays up), as does a machine without a boot id:
there the caller fsyncs as before. Nothing here ever decides that bytes are right, only whether
a re-hash may be spared.

A re-hash on the boot of such a stamp keeps the new stamp bound to it (it read the page cache); a
re-hash on a later boot read the disk, and its stamp counts on every boot. What this cannot see:
a bound stamp deleted by hand (`rm` in `cache/verified/`) and then a crash on the same boot, with
a re-hash between them.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
MOUNTS = Path("/proc/self/mountinfo")
# File systems whose pages live in this kernel until written to this machine's disks.
LOCAL = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "tmpfs", "overlay"}
)


@functools.lru_cache(maxsize=1)
def boot_id() -> str | None:
    """This boot's id, or None where the kernel gives none (not Linux, or /proc hidden)."""
    try:
        found = BOOT_ID.read_text().strip()
    except OSError:
        return None
    return found or None


@functools.lru_cache(maxsize=64)
def fs_type(folder: str) -> str | None:
    """The type of the file system holding `folder` (the longest mount point above it)."""
    try:
        lines = MOUNTS.read_text().splitlines()
    except OSError:
        return None
    found, depth = None, -1
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        point = fields[4].replace("\\040", " ")
        inside = folder == point or folder.startswith(point.rstrip("/") + "/")
        if inside and len(point) > depth:
            found, depth = fields[fields.index("-") + 1], len(point)
    return found


def unsynced_boot(folder: Path) -> str | None:
    """The boot id to bind an unsynced write under `folder` to, or None when it must be fsynced
    (no boot id, or a file system this kernel does not own)."""
    boot = boot_id()
    if boot is None:
        return None
    with contextlib.suppress(OSError):
        if fs_type(os.path.realpath(folder)) in LOCAL:
            return boot
    return None


def flush_files(folder: Path) -> bool:
    """fdatasync every file under `folder` (for a pull whose bound stamp could not be written:
    unsynced bytes never go without one): True when all of them are durable now."""
    try:
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
    except OSError:
        return False
    return True
