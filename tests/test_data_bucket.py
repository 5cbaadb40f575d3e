"""Data files in a bucket (`s3://` entries of `data.files`), against the session's real SeaweedFS.

Planned by content exactly as files on disk (the URL enters no hash), fetched at run time into the
store's `cache/sources/` by digest and checked as written: an object changed after planning is
refused with one line naming it and nothing is published; a second build takes the cached copy.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import seaweed
from conftest import MICRO, plan_hash, run_bt
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.plan.stored import load_plan
from buildtrain.sources.data_url import ObjectUrl, ObjectVersion, is_object_url, parse_object_url
from buildtrain.sources.stat_cache import SourceFile, StatCache
from buildtrain.store import objects
from buildtrain.store.store import Store

TEXTS = [f"story {i}: " + " ".join(f"{j} + {i} = {i + j}." for j in range(30)) for i in range(60)]

# -- URLs and globs (no server) ----------------------------------------------------------------


def test_an_object_url_names_a_bucket_and_a_key_or_a_glob() -> None:
    url = parse_object_url("s3://bt-data/corpus/2024/*.jsonl")
    assert (url.bucket, url.key, url.is_glob, url.listing_prefix()) == (
        "bt-data",
        "corpus/2024/*.jsonl",
        True,
        "corpus/2024",
    )
    assert str(url) == "s3://bt-data/corpus/2024/*.jsonl"
    assert not parse_object_url("s3://bt-data/a.jsonl").is_glob
    assert is_object_url("s3://x/y") and not is_object_url("corpus/s3://x") and not is_object_url(3)
    for bad, why in (
        ("s3://Bad_Bucket/a", "bucket"),
        ("s3://bt-data", "name an object"),
        ("s3://bt-data/", "name an object"),
        ("s3://bt-data/a//b", "no empty"),
        ("s3://bt-data/../b", "'..'"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_object_url(bad)


FOLDERS = st.lists(st.sampled_from(["a", "b", "c.d"]), max_size=2)
FILES = st.sampled_from(["x.jsonl", "y.txt", ".h.jsonl", "z.jsonl"])
PATTERNS = ["*.jsonl", "a/*.jsonl", "**/*.jsonl", "a/**", "?/y.txt", "[ab]/*", "**", "*/*", "c.d/**/z.*"]


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.tuples(FOLDERS, FILES), min_size=1, max_size=6), pattern=st.sampled_from(PATTERNS))
def test_a_glob_over_keys_matches_what_the_same_glob_matches_on_disk(
    keys: list[tuple[list[str], str]], pattern: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The law: a bucket holding the files of a folder, under the same names, is matched by a
    glob exactly as the folder is by `glob.glob(recursive=True)` (files only, as data.files)."""
    root = tmp_path_factory.mktemp("tree")
    names = {"/".join([*folders, name]) for folders, name in keys}
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    on_disk = {
        Path(match).relative_to(root).as_posix()
        for match in glob.glob(str(root / pattern), recursive=True)
        if Path(match).is_file()
    }
    url = ObjectUrl(bucket="bt-data", key=pattern)
    assert {name for name in names if url.matches(name)} == on_disk
    assert all(name.startswith(url.listing_prefix()) for name in on_disk)


VERSION = st.builds(
    ObjectVersion,
    url=st.sampled_from(["s3://bt-data/a.jsonl", "s3://bt-data/b.jsonl"]),
    etag=st.sampled_from(["", '"e1"', '"e2"']),
    size=st.integers(0, 3),
    modified=st.sampled_from(["2026-01-01T00:00:00+00:00", "2026-01-01T00:00:01+00:00"]),
)


@settings(max_examples=80, deadline=None)
@given(hashed=VERSION, asked=VERSION)
def test_an_object_digest_is_remembered_only_for_the_very_version_hashed(
    hashed: ObjectVersion, asked: ObjectVersion, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The law: a remembered digest is given back only for the same URL, ETag, size and
    last-modified time (and never without an ETag), also after the cache is saved and loaded."""
    path = tmp_path_factory.mktemp("cache") / "files.json"
    cache = StatCache(path)
    source = SourceFile(blake3="ab" * 32, size=hashed.size)
    cache.remember_object(hashed, source)
    cache.save()
    expected = source if asked == hashed and hashed.etag else None
    assert cache.object_digest(asked) == expected
    assert StatCache(path).object_digest(asked) == expected


def test_a_tokenizer_file_in_a_bucket_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(f'extends = "{MICRO}"\n[data.tokenizer]\nfile = "s3://bt-data/tokenizer.json"\n')
    done = run_bt("plan", str(path), store=tmp_path / ".bt")
    assert done.returncode == 2, done.stderr
    assert "s3://bt-data/tokenizer.json: a tokenizer file is read from disk only" in done.stderr


# -- against SeaweedFS ---------------------------------------------------------------------------


@pytest.fixture
def bucket(seaweed_server: seaweed.Seaweed) -> tuple[seaweed.Seaweed, str]:
    """The session's server and a fresh prefix in its bucket."""
    return seaweed_server, f"d-{uuid.uuid4().hex[:12]}"


def put(server: seaweed.Seaweed, key: str, data: bytes) -> None:
    import obstore
    from obstore.store import S3Store

    env = server.env()
    store = S3Store(
        server.bucket,
        endpoint=env["AWS_ENDPOINT_URL"],
        access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_REGION"],
        client_options={"allow_http": True},
    )
    obstore.put(store, key, data)


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def parquet(texts: list[str], path: Path) -> bytes:
    pq.write_table(pa.table({"text": texts}), path, row_group_size=16)
    return path.read_bytes()


def preset(folder: Path, name: str, files: list[str], data_format: str = "jsonl", extra: str = "") -> Path:
    path = folder / f"{name}.toml"
    listed = ", ".join(json.dumps(f) for f in files)
    path.write_text(
        f'extends = "{MICRO}"\n[data]\nsource = "files"\nformat = "{data_format}"\nfiles = [{listed}]\n{extra}'
    )
    return path


def bt(
    server: seaweed.Seaweed, *args: str, store: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return run_bt(*args, store=store, env={**server.env(), **(env or {})})


def data_step(store: Path, plan: str):
    return next(step for step in load_plan(Store(store), plan).steps if step.kind == "data")


def downloads(store: Path) -> list[dict]:
    """`source_downloaded` events of every run record beside `store`."""
    found = []
    for log in sorted((store.parent / "experiments").glob("*/train.log")):
        found += [
            e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == "source_downloaded"
        ]
    return found


@pytest.mark.parametrize("data_format", ["jsonl", "parquet"])
def test_a_file_in_a_bucket_plans_and_builds_as_the_same_file_on_disk(
    bucket: tuple[seaweed.Seaweed, str], tmp_path: Path, data_format: str
) -> None:
    server, prefix = bucket
    local = tmp_path / f"corpus.{data_format}"
    raw = jsonl(TEXTS) if data_format == "jsonl" else parquet(TEXTS, tmp_path / "made.parquet")
    local.write_bytes(raw)
    put(server, f"{prefix}/corpus.{data_format}", raw)
    on_disk = preset(tmp_path, "disk", [local.name], data_format)
    in_bucket = preset(tmp_path, "bucket", [server.url(f"{prefix}/corpus.{data_format}")], data_format)

    a, b = tmp_path / "a" / ".bt", tmp_path / "b" / ".bt"
    a.parent.mkdir(), b.parent.mkdir()
    planned = plan_hash(bt(server, "plan", str(on_disk), store=a))
    assert plan_hash(bt(server, "plan", str(in_bucket), store=b)) == planned  # the URL is in no hash
    for store in (a, b):
        done = bt(server, "run", planned, "--target", "data:main", "--progress", "off", store=store)
        assert done.returncode == 0, done.stderr
    step = data_step(b, planned)
    assert objects.sealed_digests(Store(a).outputs.path(step.hash)) == objects.sealed_digests(
        Store(b).outputs.path(step.hash)
    )
    fetched = Store(b).source_cache / step.inputs["sources"][0]["blake3"]
    assert fetched.read_bytes() == raw
    assert [e["url"] for e in downloads(b)] == [server.url(f"{prefix}/corpus.{data_format}")]
    assert load_plan(Store(b), planned).hash == planned


def test_a_glob_lists_the_prefix_and_mixes_with_local_files(
    bucket: tuple[seaweed.Seaweed, str], tmp_path: Path
) -> None:
    server, prefix = bucket
    parts = [TEXTS[:20], TEXTS[20:40], TEXTS[40:]]
    put(server, f"{prefix}/train/p1.jsonl", jsonl(parts[0]))
    put(server, f"{prefix}/train/p2.jsonl", jsonl(parts[1]))
    put(server, f"{prefix}/train/notes.txt", b"not data")
    put(server, f"{prefix}/other/p3.jsonl", jsonl(["elsewhere"]))
    (tmp_path / "p3.jsonl").write_bytes(jsonl(parts[2]))
    mixed = preset(tmp_path, "mixed", [server.url(f"{prefix}/train/*.jsonl"), "p3.jsonl"])
    store = tmp_path / ".bt"
    planned = plan_hash(bt(server, "plan", str(mixed), store=store))
    import blake3

    wanted = sorted(blake3.blake3(jsonl(p)).hexdigest() for p in parts)
    assert sorted(s["blake3"] for s in data_step(store, planned).inputs["sources"]) == wanted
    hints = Store(store).plans.meta(planned)["sources"]
    assert sorted(u for urls in hints.values() for u in urls if u.startswith("s3://")) == [
        server.url(f"{prefix}/train/p1.jsonl"),
        server.url(f"{prefix}/train/p2.jsonl"),
    ]
    done = bt(server, "run", planned, "--target", "data:main", "--progress", "off", store=store)
    assert done.returncode == 0, done.stderr
    assert len(downloads(store)) == 2  # the local file is read where it is


def test_an_object_changed_after_planning_is_refused_and_nothing_is_published(
    bucket: tuple[seaweed.Seaweed, str], tmp_path: Path
) -> None:
    server, prefix = bucket
    key = f"{prefix}/corpus.jsonl"
    put(server, key, jsonl(TEXTS))
    store = tmp_path / ".bt"
    planned = plan_hash(bt(server, "plan", str(preset(tmp_path, "p", [server.url(key)])), store=store))
    put(server, key, jsonl([*TEXTS[:-1], "a different last story"]))
    done = bt(server, "run", planned, "--target", "data:main", "--progress", "off", store=store)
    assert done.returncode == 1, done.stderr
    line = next(line for line in done.stderr.splitlines() if "changed since planning" in line)
    assert server.url(key) in line and "re-plan" in line
    assert "Traceback" not in done.stderr
    s = Store(store)
    assert not s.outputs.has(data_step(store, planned).hash)
    assert list(s.source_cache.iterdir()) == [] and list(s.tmp.iterdir()) == []


def test_a_second_build_and_a_second_plan_take_the_cached_copy_without_a_download(
    bucket: tuple[seaweed.Seaweed, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from buildtrain.plan.planner import plan_preset

    server, prefix = bucket
    key = f"{prefix}/corpus.jsonl"
    put(server, key, jsonl(TEXTS))
    store = tmp_path / ".bt"
    first = preset(tmp_path, "first", [server.url(key)])
    second = preset(tmp_path, "second", [server.url(key)], extra="split_seed = 7\n")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)  # for the planner in this process
    assert plan_preset(first, [], Store(store)).hashed_bytes == len(jsonl(TEXTS))
    assert plan_preset(first, [], Store(store)).hashed_bytes == 0  # remembered by its ETag: not read
    a = plan_hash(bt(server, "plan", str(first), store=store))
    assert bt(server, "run", a, "--target", "data:main", "--progress", "off", store=store).returncode == 0
    cached = Store(store).source_cache / data_step(store, a).inputs["sources"][0]["blake3"]
    before = cached.stat()
    b = plan_hash(bt(server, "plan", str(second), store=store))
    assert data_step(store, a).hash != data_step(store, b).hash  # another step, the same file
    done = bt(server, "run", b, "--target", "data:main", "--progress", "off", store=store)
    assert done.returncode == 0, done.stderr
    after = cached.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert len(downloads(store)) == 1  # the first build's only


def test_fsck_rehashes_fetched_files_and_gc_drops_those_no_plan_reads(
    bucket: tuple[seaweed.Seaweed, str], tmp_path: Path
) -> None:
    server, prefix = bucket
    key = f"{prefix}/corpus.jsonl"
    put(server, key, jsonl(TEXTS))
    store = tmp_path / ".bt"
    planned = plan_hash(bt(server, "plan", str(preset(tmp_path, "p", [server.url(key)])), store=store))
    assert (
        bt(server, "run", planned, "--target", "data:main", "--progress", "off", store=store).returncode == 0
    )
    cached = next(Store(store).source_cache.iterdir())
    assert bt(server, "fsck", store=store).returncode == 0
    cached.chmod(0o644)
    with open(cached, "r+b") as handle:
        handle.write(b"X")
    damaged = bt(server, "fsck", store=store)
    assert damaged.returncode == 5 and "fetched data file" in damaged.stdout + damaged.stderr
    assert bt(server, "fsck", "--repair", store=store).returncode == 0
    assert not cached.exists()
    other = plan_hash(
        bt(
            server,
            "plan",
            str(preset(tmp_path, "q", [server.url(key)], extra="split_seed = 3\n")),
            store=store,
        )
    )
    again = bt(server, "run", other, "--target", "data:main", "--progress", "off", store=store)
    assert again.returncode == 0, again.stderr
    assert cached.exists() and len(downloads(store)) == 2  # fetched again, once
    assert bt(server, "gc", store=store).returncode == 0 and cached.exists()  # its plan reads it
    assert bt(server, "gc", "--drop", planned, store=store).returncode == 0
    assert cached.exists()  # the other plan still reads it
    assert bt(server, "gc", "--drop", other, store=store).returncode == 0
    assert not cached.exists()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("case", "code", "message"),
    [
        (
            "no such key",
            2,
            r"data\.files: 's3://bt-test/.*/missing\.jsonl': no such object in bucket 'bt-test'",
        ),
        ("no such bucket", 2, r"'s3://no-such-bucket/corpus\.jsonl': there is no bucket 'no-such-bucket'"),
        ("empty glob", 2, r"'s3://bt-test/.*/\*\.parquet' matches no object in bucket 'bt-test'"),
        (
            "unreachable",
            1,
            r"s3://bt-test/.*corpus\.jsonl: cannot reach the S3 endpoint http://127\.0\.0\.1:\d+",
        ),
        ("no credentials", 1, r"s3://bt-test/.*corpus\.jsonl: no usable credentials .*AWS_ACCESS_KEY_ID"),
    ],
)
def test_each_bucket_problem_is_one_line_with_its_exit_code(
    bucket: tuple[seaweed.Seaweed, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    code: int,
    message: str,
) -> None:
    server, prefix = bucket
    put(server, f"{prefix}/corpus.jsonl", jsonl(TEXTS))
    files = {
        "no such key": server.url(f"{prefix}/missing.jsonl"),
        "no such bucket": "s3://no-such-bucket/corpus.jsonl",
        "empty glob": server.url(f"{prefix}/*.parquet"),
    }.get(case, server.url(f"{prefix}/corpus.jsonl"))
    env = {**server.env()}
    if case == "unreachable":
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    if case == "no credentials":  # none anywhere: the client asks the instance metadata service
        del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)  # not inherited from whoever runs the tests
    path = preset(tmp_path, "p", [files])
    done = run_bt("plan", str(path), store=tmp_path / ".bt", env=env)
    assert done.returncode == code, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    named = [line for line in done.stderr.splitlines() if "s3://" in line]
    assert len(named) == 1 and re.search(message, named[0]), done.stderr
    assert len(done.stderr.strip().splitlines()) == (2 if code == 2 else 1)  # + "1 problem in the preset"


def test_an_s3_preset_imports_the_client_to_plan_but_its_null_build_does_not(
    bucket: tuple[seaweed.Seaweed, str], tmp_path: Path
) -> None:
    server, prefix = bucket
    put(server, f"{prefix}/corpus.jsonl", jsonl(TEXTS))
    store = tmp_path / ".bt"
    planned = plan_hash(
        bt(server, "plan", str(preset(tmp_path, "p", [server.url(f"{prefix}/corpus.jsonl")])), store=store)
    )
    assert (
        bt(server, "run", planned, "--target", "data:main", "--progress", "off", store=store).returncode == 0
    )

    def imported(*args: str) -> str:
        env = {**os.environ, **server.env(), "BT_STORE": str(store), "BT_EXPERIMENTS": str(tmp_path / "x")}
        argv = [sys.executable, "-X", "importtime", "-m", "buildtrain", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stderr

    assert "obstore" not in imported("run", planned, "--target", "data:main")  # a null build
    assert "obstore" in imported("plan", str(tmp_path / "p.toml"))
