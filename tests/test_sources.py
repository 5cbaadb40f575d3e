"""The stat cache of source digests: hashed once, never wrong, self-healing; locate() by content."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from conftest import time_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.sources import stat_cache as sources
from buildtrain.sources.durable import MMAP_THRESHOLD
from buildtrain.sources.stat_cache import (
    RACY_SECONDS,
    NotRegularFile,
    SourceFile,
    StatCache,
    hash_regular,
    locate,
    open_regular,
    whereabouts,
)

OLD = time.time() - 3600  # an mtime well outside the racy window


def write_old(path: Path, data: bytes, mtime: float = OLD) -> SourceFile:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))
    return SourceFile(blake3=blake3.blake3(data).hexdigest(), size=len(data))


def test_unchanged_file_is_hashed_once_also_across_saves(tmp_path: Path) -> None:
    source = write_old(tmp_path / "corpus.txt", b"hello world\n" * 100)
    cache = StatCache(tmp_path / "cache" / "files.json")
    assert cache.digest_of(tmp_path / "corpus.txt") == source
    assert cache.hashed_bytes == source.size
    assert cache.digest_of(tmp_path / "corpus.txt") == source
    assert cache.hashed_bytes == source.size  # the second lookup only stats
    cache.save()
    reloaded = StatCache(tmp_path / "cache" / "files.json")
    assert not reloaded.damaged
    assert reloaded.digest_of(tmp_path / "corpus.txt") == source
    assert reloaded.hashed_bytes == 0


def test_modified_file_is_rehashed(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    write_old(path, b"first version")
    cache = StatCache(tmp_path / "files.json")
    cache.digest_of(path)
    changed = write_old(path, b"other version", mtime=OLD + 10)  # same size, other content and mtime
    assert cache.digest_of(path) == changed
    assert cache.hashed_bytes == 2 * changed.size


def test_recently_modified_file_is_not_cached(tmp_path: Path) -> None:
    """A write within the same timestamp tick must not be served from the cache (racy-git rule)."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"version one")
    cache = StatCache(tmp_path / "files.json")
    cache.digest_of(path)
    assert cache.entries == {}
    before = path.stat()
    path.write_bytes(b"version two")  # same size; force the very same mtime as a coarse clock would
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cache.digest_of(path) == SourceFile(blake3=blake3.blake3(b"version two").hexdigest(), size=11)


# Each write gets an mtime as a real write would: "now", somewhere distinct in the past, or the very
# same tick as the previous write when that one was also "now" (a coarse clock, the racy case).
# Same-size contents are what a stat cache can confuse, so they come up often.
contents = st.binary(min_size=3, max_size=3) | st.binary(max_size=24)
writes = st.lists(
    st.tuples(contents, st.sampled_from(["now", "past", "same-tick"]), st.sampled_from([False, False, True])),
    min_size=1,
    max_size=8,
)


@settings(max_examples=80, deadline=None)
@given(history=writes)
def test_stat_cache_never_returns_a_wrong_digest(history: list[tuple[bytes, str, bool]]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        path, cache_path = root / "data" / "corpus.txt", root / "files.json"
        path.parent.mkdir()
        cache = StatCache(cache_path)
        previous: tuple[str, int] | None = None
        for number, (data, when, replace) in enumerate(history):
            if replace:  # a new inode, as editors and `mv` produce
                (root / "data" / "new").write_bytes(data)
                os.replace(root / "data" / "new", path)
            else:
                path.write_bytes(data)
            if when == "past":
                os.utime(path, (OLD + number, OLD + number))
            elif when == "same-tick" and previous is not None and previous[0] != "past":
                os.utime(path, ns=(previous[1], previous[1]))
            previous = (when, path.stat().st_mtime_ns)
            expected = SourceFile(blake3=blake3.blake3(data).hexdigest(), size=len(data))
            assert cache.digest_of(path) == expected
            assert cache.digest_of(path) == expected
            cache.save()
            cache = StatCache(cache_path)  # and through a saved and reloaded cache
            assert not cache.damaged
            assert cache.digest_of(path) == expected


def test_only_files_outside_the_racy_window_are_cached(tmp_path: Path) -> None:
    assert RACY_SECONDS > 0
    fresh, old = tmp_path / "fresh.txt", tmp_path / "old.txt"
    fresh.write_bytes(b"new")
    write_old(old, b"old")
    cache = StatCache(tmp_path / "files.json")
    cache.digest_of(fresh)
    cache.digest_of(old)
    assert set(cache.entries) == {os.path.realpath(old)}


@settings(max_examples=40, deadline=None)
@given(index=st.integers(min_value=0), mask=st.integers(min_value=1, max_value=255))
def test_damaged_cache_is_discarded_and_rebuilt(index: int, mask: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        source = write_old(root / "a.txt", b"alpha" * 10)
        cache = StatCache(root / "files.json")
        cache.digest_of(root / "a.txt")
        cache.save()
        raw = bytearray((root / "files.json").read_bytes())
        raw[index % len(raw)] ^= mask
        (root / "files.json").write_bytes(bytes(raw))

        damaged = StatCache(root / "files.json")
        assert damaged.damaged and damaged.entries == {}
        assert damaged.digest_of(root / "a.txt") == source
        assert damaged.hashed_bytes == source.size  # rehashed, not trusted
        damaged.save()  # rewritten although nothing new was learned beyond the rebuild
        rebuilt = StatCache(root / "files.json")
        assert not rebuilt.damaged
        assert rebuilt.digest_of(root / "a.txt") == source and rebuilt.hashed_bytes == 0


def test_cache_with_the_wrong_shape_is_damaged(tmp_path: Path) -> None:
    for text in ["[]", "null", '"text"', "3", "{}", '{"format": 1, "entries": {}}']:
        (tmp_path / "files.json").write_text(text)
        cache = StatCache(tmp_path / "files.json")
        assert cache.damaged and cache.dirty and cache.entries == {}, text


def test_save_only_writes_when_something_changed(tmp_path: Path) -> None:
    cache = StatCache(tmp_path / "cache" / "files.json")
    cache.save()
    assert not (tmp_path / "cache").exists()


def test_locate_prefers_hints_then_finds_a_moved_file_by_content(tmp_path: Path) -> None:
    old_place, new_place = tmp_path / "old" / "corpus.txt", tmp_path / "new" / "renamed.txt"
    source = write_old(old_place, b"the corpus")
    cache = StatCache(tmp_path / "files.json")
    assert locate(cache, source, [str(old_place)]) == old_place
    new_place.parent.mkdir()
    os.rename(old_place, new_place)
    cache.digest_of(new_place)  # a later `bt plan` saw the file at its new place
    cache.save()
    cache = StatCache(tmp_path / "files.json")
    assert locate(cache, source, [str(old_place)]) == new_place
    new_place.unlink()
    assert locate(cache, source, [str(old_place)]) is None


def test_locate_skips_paths_whose_content_changed(tmp_path: Path) -> None:
    hinted, other = tmp_path / "hinted.txt", tmp_path / "copy.txt"
    source = write_old(hinted, b"the corpus")
    write_old(other, b"the corpus")
    cache = StatCache(tmp_path / "files.json")
    cache.digest_of(other)
    write_old(hinted, b"edited!!!!", mtime=OLD + 5)  # the plan's path now holds other content
    assert locate(cache, source, [str(hinted)]) == other
    write_old(other, b"edited too", mtime=OLD + 6)
    assert locate(cache, source, [str(hinted)]) is None


def test_a_data_file_found_again_elsewhere_says_where_the_bytes_came_from(tmp_path: Path) -> None:
    """Right by content, but never silent: the terminal and the run record name the copy."""
    import json

    from conftest import MICRO, plan_hash, run_bt

    text = "".join(f"{i} + {i} = {2 * i}\n" for i in range(400))
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "corpus.txt").write_text(text)
        os.utime(tmp_path / folder / "corpus.txt", (OLD, OLD))  # outside the racy window: cached
        (tmp_path / f"{folder}.toml").write_text(
            f'extends = "{MICRO}"\n[data]\nsource = "files"\nfiles = ["{folder}/*.txt"]\n'
        )
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(tmp_path / "b.toml"), store=store))  # the copy is seen
    assert plan_hash(run_bt("plan", str(tmp_path / "a.toml"), store=store)) == planned  # then a, here
    (tmp_path / "a" / "corpus.txt").unlink()
    result = run_bt("run", planned, "--target", "data:main", "--progress", "off", store=store)
    assert result.returncode == 0, result.stderr
    copy = str(tmp_path / "b" / "corpus.txt")
    assert (
        f"is gone from {tmp_path / 'a' / 'corpus.txt'}; reading the identical copy at {copy}" in result.stderr
    )
    log = next((tmp_path / "experiments").glob("*/train.log")).read_text()
    events = [json.loads(line) for line in log.splitlines()]
    found = [e for e in events if e.get("event") == "source_found_elsewhere"]
    assert len(found) == 1 and found[0]["found_at"] == copy, found


# -- only regular files are read ------------------------------------------------------------------


@pytest.fixture(params=["fifo", "dev-zero-link", "socket", "folder"])
def not_a_file(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A path where a data file was, now something that a read would block on, never finish, or
    fail on: a FIFO, a link to /dev/zero, a socket, a folder."""
    path = tmp_path / "corpus.txt"
    if request.param == "fifo":
        os.mkfifo(path)
        yield path, "a FIFO"
    elif request.param == "dev-zero-link":
        path.symlink_to("/dev/zero")
        yield path, "a device"
    elif request.param == "socket":
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            yield path, "a socket"
    else:
        path.mkdir()
        yield path, "a directory"


def test_a_path_that_is_not_a_regular_file_is_refused_without_blocking(
    tmp_path: Path, not_a_file: tuple[Path, str]
) -> None:
    path, kind = not_a_file
    source = write_old(tmp_path / "kept.txt", b"the corpus")
    cache = StatCache(tmp_path / "files.json")
    with time_bound(5, f"reading {kind}"):
        with pytest.raises(NotRegularFile, match=f"is {kind}, not a regular file") as caught:
            open_regular(path)
        assert caught.value.filename == str(path) and caught.value.kind == kind
        with pytest.raises(NotRegularFile):
            cache.digest_of(path)
        assert locate(cache, source, [str(path)]) is None
        assert whereabouts(source, [str(path)]).startswith(
            f"the data file {path} is now {kind}, not a regular file"
        )


def test_a_fifo_swapped_in_after_the_check_is_refused_on_the_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    regular = tmp_path / "regular.txt"
    regular.write_bytes(b"text")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(
        sources.os, "stat", lambda path, *a, **k: real_stat(regular if path == fifo else path)
    )
    with time_bound(5, "opening a FIFO"), pytest.raises(NotRegularFile, match="is a FIFO"):
        open_regular(fifo)  # the first check saw a regular file; the descriptor's check does not


@pytest.mark.parametrize("size", [0, 1000, MMAP_THRESHOLD + 3])
def test_hash_regular_gives_the_digest_of_the_bytes(tmp_path: Path, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    (tmp_path / "f").write_bytes(data)
    assert hash_regular(tmp_path / "f") == (blake3.blake3(data).hexdigest(), size)


def test_whereabouts_says_what_became_of_a_planned_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    source = write_old(path, b"the corpus as planned")
    write_old(path, b"edited")
    assert whereabouts(source, [str(path)]) == (
        f"the data file {path} changed since planning "
        f"(blake3 {source.blake3[:16]}…, {source.size} bytes when planned, 6 bytes now)"
    )
    path.unlink()
    assert whereabouts(source, [str(path)]) == (
        f"a data file (blake3 {source.blake3[:16]}…, {source.size} bytes) is gone (it was at {path})"
    )
