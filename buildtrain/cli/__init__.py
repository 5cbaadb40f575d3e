"""`bt`: a thin command line over buildtrain. Parse (`parser.py`), call one function per command
(`commands.py`), print, map errors to exit codes (here)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

from buildtrain.cli.common import err
from buildtrain.cli.parser import build_parser
from buildtrain.errors import BuildtrainError, ConfigError, ExitCode, accept_stop_signals

# Exit status after stdout was closed early (`bt show | head`): what a shell reports for SIGPIPE.
BROKEN_PIPE = 141


def _quiet_stdout() -> None:
    """stdout's reader went away: send the rest (and the final flush) nowhere, without a word."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    accept_stop_signals()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `bt show | head`: the reader has all it wanted
        _quiet_stdout()
        return BROKEN_PIPE
    except ConfigError as exc:
        for line in exc.problems:
            err(line)
        count = len(exc.problems)
        err(f"bt {args.command}: {count} problem{'s' if count != 1 else ''} in the preset; nothing was run")
        return exc.exit_code
    except BuildtrainError as exc:
        err(f"bt {args.command}: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        err(f"bt {args.command}: interrupted")
        return ExitCode.INTERRUPTED
    except OSError as exc:  # the store or a record cannot be written: say where, not how
        err(f"bt {args.command}: {_os_problem(exc)}")
        return ExitCode.FAILED


def _os_problem(exc: OSError) -> str:
    if exc.filename:
        return f"cannot use {exc.filename}: {exc.strerror or exc}"
    try:
        os.getcwd()
    except FileNotFoundError:  # the error names no file: a relative path's base is gone
        where = os.environ.get("PWD") or "the working folder"
        return f"the working folder {where} no longer exists (deleted or moved); cd to a folder that exists and run again"
    return f"cannot use: {exc.strerror or exc}"


if __name__ == "__main__":
    sys.exit(main())
