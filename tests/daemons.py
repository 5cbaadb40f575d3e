"""Stopping a server or daemon that a test session started: by its pid, never by name."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_by_pid(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, up to `grace_s` seconds to exit, then SIGKILL; nothing if it already exited."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait()
