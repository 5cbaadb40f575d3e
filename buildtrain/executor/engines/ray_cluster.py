"""Where `bt run --executor ray` finds its cluster: the one `RAY_ADDRESS` names, checked to
answer before Ray's client is asked (one line instead of minutes of retries), or a local
instance started for this run and stopped with it. Nothing here imports Ray (a local instance is
Ray's own `ray start` command); submitting steps is `executor/engines/ray_engine.py`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs

from buildtrain.errors import EngineUnavailable

# Seconds to wait for the address in RAY_ADDRESS to accept a connection: Ray's own client retries
# for minutes, printing a warning every five seconds, before it gives up.
PROBE_TIMEOUT_S = 5
# A local instance's head answered within about 5 s here; SIGTERM makes it drain for up to 30 s.
LOCAL_START_TIMEOUT_S = 60
STOP_GRACE_S = 3
AUTH_MODE = "RAY_AUTH_MODE"
PR_SET_PDEATHSIG = 1


@attrs.define
class LocalInstance:
    """A Ray instance of this run's own, on this machine: `ray start --head --block` in a process
    group of its own, stopped by that group's id when the run ends. (`ray.init()` starting one
    itself left its dashboard and runtime-env agents running after `ray.shutdown()`, here, Ray
    2.60: both still alive a minute later.) Its port is chosen free; it listens only while the run
    lasts."""

    process: subprocess.Popen[bytes]
    address: str
    log: Path

    @classmethod
    def start(cls) -> LocalInstance:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = Path(tempfile.mkstemp(prefix="bt-ray-", suffix=".log")[1])
        command = [
            str(Path(sys.executable).with_name("ray")),
            *("start", "--head", "--block", "--port", str(port)),
            *("--include-dashboard=false", "--disable-usage-stats", "--node-ip-address", "127.0.0.1"),
        ]
        # On loopback only, for this run's own processes: no token (Ray 2.60 otherwise turns token
        # authentication on once ~/.ray/auth_token exists, and refused this driver's token here).
        os.environ.setdefault(AUTH_MODE, "disabled")
        env = {**os.environ}
        process = _start_held(command, env, log)
        instance = cls(process, f"127.0.0.1:{port}", log)
        deadline = time.monotonic() + LOCAL_START_TIMEOUT_S
        while not _answers(instance.address):
            if process.poll() is not None or time.monotonic() > deadline:
                instance.stop()
                raise EngineUnavailable(f"--executor ray: a local Ray instance did not start; see {log}")
            time.sleep(0.2)
        return instance

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the raylet, agents and workers too
        self.process.wait()
        self.log.unlink(missing_ok=True)


def _start_held(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start `command` from a thread that lives as long as this process: Linux sends a child its
    parent-death signal when the *thread* that started it ends, and a step's thread ends with
    its step. The signal is SIGTERM, so a `bt` killed outright still stops its Ray instance."""
    started: list[subprocess.Popen[bytes]] = []
    ready = threading.Event()

    def hold() -> None:
        with open(log, "wb") as out:
            started.append(
                subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                    preexec_fn=_terminate_with_parent,
                )
            )
        ready.set()
        threading.Event().wait()  # never set: this thread is the instance's parent until exit

    threading.Thread(target=hold, name="bt-ray-instance", daemon=True).start()
    ready.wait()
    return started[0]


def _terminate_with_parent() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def probe(address: str) -> None:
    """One line for an address nothing listens on, instead of Ray's minutes of retries."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        raise EngineUnavailable(
            f"RAY_ADDRESS={address}: nothing answers there ({exc}); start the cluster (ray start --head) "
            "or fix RAY_ADDRESS (unset it for a local Ray instance)"
        ) from None
