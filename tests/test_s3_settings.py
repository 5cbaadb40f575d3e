"""Every S3 client buildtrain builds (`sources/s3_settings.py`): traffic to the configured
endpoint only (never the instance metadata service unless asked), bounded waits against a server
that never answers, and no endpoint credentials on stderr. Every socket here is on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_bt

from buildtrain.errors import RemoteUnavailable
from buildtrain.sources.s3_settings import INSTANCE_CREDENTIALS, redact
from buildtrain.store.remote.remote import Remote

CREDENTIALS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_SKIP_SIGNATURE",
    INSTANCE_CREDENTIALS,
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@contextlib.contextmanager
def recorder() -> Iterator[tuple[str, list[bytes]]]:
    """A loopback HTTP server that answers 404 at once and records what each connection sent."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.1)
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:  # the 0.1 s tick: look at `stop` again
                continue
            with connection:
                connection.settimeout(2)
                with contextlib.suppress(OSError):
                    seen.append(connection.recv(4096))
                    connection.sendall(NOT_FOUND)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", seen
    finally:
        stop.set()
        thread.join(5)
        server.close()


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A loopback port whose connections are accepted (by the kernel) and never answered."""
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


def _no_credentials(monkeypatch: pytest.MonkeyPatch, endpoint: str, metadata: str) -> None:
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", metadata)  # where the client's default chain asks
    monkeypatch.setenv("AWS_REGION", "us-east-1")


def _use_team_cache() -> None:
    Remote.open("s3://bt-team/x").plans()


def _use_bucket() -> None:
    from buildtrain.sources.bucket import Bucket

    Bucket("bt-data").version("corpus.jsonl")


@pytest.mark.parametrize("use", [_use_team_cache, _use_bucket], ids=["team cache", "data bucket"])
def test_no_credentials_never_asks_the_instance_metadata_service(
    monkeypatch: pytest.MonkeyPatch, use: object
) -> None:
    with recorder() as (endpoint, at_endpoint), recorder() as (metadata, at_metadata):
        _no_credentials(monkeypatch, endpoint, metadata)
        with pytest.raises(
            RemoteUnavailable, match=rf"no AWS credentials.*{INSTANCE_CREDENTIALS}=1"
        ) as caught:
            use()  # type: ignore[operator]
        assert at_metadata == [] and at_endpoint == []
        assert "\n" not in str(caught.value) and caught.value.exit_code == 1

        # Asked for, the instance role is looked up (so the recorder above would have seen it).
        monkeypatch.setenv(INSTANCE_CREDENTIALS, "1")
        with pytest.raises(RemoteUnavailable):
            use()  # type: ignore[operator]
        assert at_metadata and at_endpoint == []


def test_a_server_that_never_answers_fails_within_seconds_naming_the_endpoint(tmp_path: Path) -> None:
    with silent_server() as address:
        env = {
            "AWS_ENDPOINT_URL": f"http://team:hunter2@{address}",
            "AWS_ACCESS_KEY_ID": "team",
            "AWS_SECRET_ACCESS_KEY": "hunter2",
            "AWS_REGION": "us-east-1",
        }
        started = time.monotonic()
        done = run_bt("ls", "--remote", "s3://bt-team/x", store=tmp_path / ".bt", env=env, timeout=60)
        took = time.monotonic() - started
    assert took < 30, f"{took:.0f} s against a silent server"
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"http://***@{address}" in done.stderr and "hunter2" not in done.stderr, done.stderr
    assert "did not answer in time" in done.stderr, done.stderr  # sorted as a timeout (s3_client.py)


def test_credentials_in_a_url_are_left_out() -> None:
    assert redact("http://ak:sk@host:9000/b") == "http://***@host:9000/b"
    assert (
        redact("GET https://u:p@h/b?x=1 failed, then http://h2/")
        == "GET https://***@h/b?x=1 failed, then http://h2/"
    )
    assert redact("http://host:9000") == "http://host:9000"
