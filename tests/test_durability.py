"""Unsynced writes are trusted only on the boot that wrote them (`store/durability.py`): a pull
skips its fsyncs, and its stamp spares the re-hash on this boot and no other."""

from __future__ import annotations

from pathlib import Path

import pytest

from buildtrain.store import durability, objects
from buildtrain.store.store import Store

NAME = "a" * 64


def published(tmp_path: Path) -> Store:
    store = Store(tmp_path / ".bt")
    folder = store.new_temp("t")
    (folder / "w.bin").write_bytes(b"weights" * 1000)
    objects.publish(folder, store.outputs.path(NAME))
    return store


def damage_keeping_the_stamp(store: Store, boot: str | None) -> None:
    """A byte lost as a crash loses unsynced data: same size, and a stamp that matches the
    file's stats as they are now (the stats survived, the bytes did not)."""
    path = store.outputs.path(NAME) / "w.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    store.outputs.stamp_hashed(NAME, boot=boot)


def test_a_stamp_from_another_boot_is_not_trusted_and_the_damage_is_found(tmp_path: Path) -> None:
    store = published(tmp_path)
    damage_keeping_the_stamp(store, boot="another-boot")
    assert store.outputs.read_stamp(NAME)["boot"] == "another-boot"
    problems = store.outputs.check(NAME)
    assert problems and "w.bin" in problems[0]
    assert store.outputs.read_stamp(NAME) is None  # a failed re-hash drops it


def test_a_stamp_from_this_boot_spares_the_re_hash(tmp_path: Path) -> None:
    """The same damage under a stamp of this boot is not read: what the stamp saves, and why a
    stamp may only describe bytes this kernel still holds or wrote to disk."""
    if durability.boot_id() is None:
        pytest.skip("no boot id on this machine")
    store = published(tmp_path)
    damage_keeping_the_stamp(store, boot=durability.boot_id())
    assert store.outputs.check(NAME) == []


def test_intact_bytes_under_another_boot_are_re_hashed_once_then_stamped_for_any_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = published(tmp_path)
    store.outputs.stamp_hashed(NAME, boot="another-boot")
    reads: list[str] = []
    verify = objects.verify
    monkeypatch.setattr(objects, "verify", lambda root, **kw: reads.append(root.name) or verify(root, **kw))
    assert store.outputs.check(NAME) == [] and reads == [NAME]
    assert "boot" not in store.outputs.read_stamp(NAME)  # read back after a reboot: from disk
    assert store.outputs.check(NAME) == [] and reads == [NAME]


def test_a_re_hash_on_the_boot_of_an_unsynced_pull_keeps_its_stamp_bound(tmp_path: Path) -> None:
    """Its files changed stats (a chmod) on the boot that pulled them unsynced: the re-hash read
    the page cache, not the disk, so the new stamp stays bound to this boot."""
    if durability.boot_id() is None:
        pytest.skip("no boot id on this machine")
    store = published(tmp_path)
    store.outputs.stamp_hashed(NAME, boot=durability.boot_id())
    (store.outputs.path(NAME) / "w.bin").chmod(0o600)  # a new ctime
    assert store.outputs.check(NAME) == []
    assert store.outputs.read_stamp(NAME)["boot"] == durability.boot_id()


def test_only_a_local_file_system_with_a_boot_id_skips_the_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mounts = tmp_path / "mountinfo"
    mounts.write_text(
        "22 27 0:21 / / rw - ext4 /dev/sda1 rw\n"
        f"23 22 0:22 / {tmp_path}/team rw shared:1 - nfs4 server:/team rw\n"
    )
    monkeypatch.setattr(durability, "MOUNTS", mounts)
    durability.fs_type.cache_clear()
    try:
        (tmp_path / "team").mkdir()
        if durability.boot_id() is not None:
            assert durability.unsynced_boot(tmp_path) == durability.boot_id()
        assert durability.unsynced_boot(tmp_path / "team") is None  # its server may lose it
        monkeypatch.setattr(durability, "boot_id", lambda: None)
        assert durability.unsynced_boot(tmp_path) is None
    finally:
        durability.fs_type.cache_clear()
