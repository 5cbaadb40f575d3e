"""The small family of errors a user can cause, each mapped to one documented exit code.

The CLI catches `BuildtrainError` and prints its message; anything else is a bug in buildtrain
and is allowed to show a traceback.
"""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    """Process exit codes of `bt`. Documented in README.md; tests pin them."""

    OK = 0
    FAILED = 1  # a step failed: non-finite loss, out of memory, a crash inside a step
    USAGE = 2  # bad command line or bad preset: nothing was run
    INTERRUPTED = 3  # SIGINT/SIGTERM: a checkpoint was written, `bt run` again resumes
    NOT_REPRODUCED = 4  # `bt verify` found a difference
    CORRUPT = 5  # the store holds an object whose content does not match its digest
    TOOLCHAIN_MISMATCH = 6  # the plan was compiled for another machine or torch build
    LOCKED = 7  # another `bt` holds a lock and --no-wait was given
    ENGINE_UNAVAILABLE = 8  # --executor names an engine that is not installed, not reachable, or too small


# The signals that stop a run as an interruption (exit 3).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def accept_stop_signals() -> None:
    """Unblock SIGINT and SIGTERM in this thread (call it first, in the main thread: threads
    started later inherit its mask). A signal mask is inherited across exec: started by a parent
    that blocked them (Ray blocks SIGINT in the processes it starts), bt would leave a Ctrl-C
    pending until some thread happened to unblock it, for example when a step ended."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class BuildtrainError(Exception):
    """Base of every error meant for the user rather than for a developer."""

    exit_code: ExitCode = ExitCode.FAILED


class UsageError(BuildtrainError):
    """A wrong command line: unknown plan, bad flag value."""

    exit_code = ExitCode.USAGE


class ConfigError(BuildtrainError):
    """One or more problems in a preset, each already formatted as `file: key: message`."""

    exit_code = ExitCode.USAGE

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class StepFailed(BuildtrainError):
    """A step ran and failed for a reason the user can act on (NaN loss, OOM)."""

    exit_code = ExitCode.FAILED


class Interrupted(BuildtrainError):
    """The run was stopped by a signal after writing a checkpoint."""

    exit_code = ExitCode.INTERRUPTED


class RemoteUnavailable(BuildtrainError):
    """The remote could not be reached or refused us: the message names the URL and the fix."""

    exit_code = ExitCode.FAILED


class CorruptObject(BuildtrainError):
    exit_code = ExitCode.CORRUPT


class ToolchainMismatch(BuildtrainError):
    exit_code = ExitCode.TOOLCHAIN_MISMATCH


class Locked(BuildtrainError):
    exit_code = ExitCode.LOCKED


class EngineUnavailable(BuildtrainError):
    """The executor's engine cannot run a step: its package is not installed, its address does
    not answer, no node has the resources a step asks for, or a node's toolchain differs."""

    exit_code = ExitCode.ENGINE_UNAVAILABLE


class RemoteDamaged(CorruptObject):
    """An object on a remote (team cache) is missing, damaged or another object's: it is never
    served, and nothing of it is left in the local store. The message names the object and key."""
