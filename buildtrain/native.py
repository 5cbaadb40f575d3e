"""C kernels: finding the compiler that builds them, building them once, loading them. No torch.

A step's C source sits beside the Python module that calls it (`steps/train/kernels.c` beside
`kernels.py`), so that module's part of the code digest covers it (`plan/sources_digest.py`). It is
compiled at first use with this machine's C compiler (`$CC`, else `cc`) into the user's cache,
named by the blake3 of the source, the flags and the compiler's path, and loaded with ctypes:
plain C, no Python or torch headers, so a build takes a fraction of a second and needs nothing
but the compiler.

The flags are part of the arithmetic: -ffp-contract=off forbids fusing a multiply and an add into
one rounding, and leaving out -ffast-math forbids reordering a sum, so every float operation
happens as written and the bits depend on the source alone, not on the compiler or the CPU
(`kernels.c` says how its sums and exp are written for that). -fno-trapping-math and
-fno-math-errno change no result; they let the compiler vectorize clamps and a square root.
-fopenmp lets a kernel split its rows among threads, which changes no result either (`kernels.c`
says why); where the compiler has no OpenMP, the library is built without it and computes the
same bits on one thread.

Whether a machine has a compiler is a toolchain fact (`plan/toolchain.py`): a plan records
whether its steps compute with these kernels or with torch's eager operations, so one hash never
stands for two results. The data split's digests (`steps/data/short_blake3.c`) are the exception that
needs no record: integer arithmetic, the same bits as their numpy fallback on any machine.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from buildtrain.errors import StepFailed

if TYPE_CHECKING:
    import ctypes

FLAGS = (
    "-O3",
    "-std=c11",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-fPIC",
    "-shared",
)
THREADED = ("-fopenmp",)  # tried first; a compiler without OpenMP builds the kernels single-threaded
BUILD_SECONDS = 300  # a compiler that takes longer is stuck, not slow


def compiler() -> str | None:
    """The C compiler on this machine: `$CC` (a name on PATH or a path), else `cc`; None if there
    is none, and then the steps compute with torch's eager operations."""
    return shutil.which(os.environ.get("CC") or "cc")


def cache_folder() -> Path:
    """`$XDG_CACHE_HOME/buildtrain/kernels` (default `~/.cache/...`): shared by every store, as
    the code it was built from is."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "buildtrain" / "kernels"


@functools.cache
def load(source: Path, *, threaded: bool = True, shared_symbols: bool = False) -> ctypes.CDLL:
    """The library built from `source`, built now unless the cache holds it. A cached library is
    loaded only if its bytes match the digest recorded when it was built; anything else is built
    again (fail closed: a damaged file costs a build, never a wrong result). ctypes and tempfile
    are imported only here: `bt plan` imports this module for `compiler()` alone.

    `threaded=False` builds without OpenMP (a library loaded before torch must not bring the
    system's OpenMP runtime in ahead of torch's own); `shared_symbols` loads it RTLD_GLOBAL, so
    that libraries loaded after it link to its definitions (`executor/process/mkl.c`)."""
    cc = compiler()
    if cc is None:
        raise StepFailed(
            f"no C compiler to build {source.name} (looked for {os.environ.get('CC') or 'cc'}); install one "
            f"(Debian: apt-get install gcc) or set CC, or plan with numerics.kernels = 'eager'"
        )
    text = source.read_bytes()
    attempts = (THREADED, ()) if threaded else ((),)
    flags = " ".join((*FLAGS, *attempts[0])).encode()
    key = blake3.blake3(b"\0".join((text, flags, cc.encode()))).hexdigest()[:32]
    library = cache_folder() / f"{source.stem}-{key}.so"
    if not _intact(library):
        try:
            _build(cc, source, library, attempts)
        except OSError as exc:
            raise StepFailed(
                f"cannot build {source.name} into {library.parent}: {exc.strerror or exc}; set XDG_CACHE_HOME "
                f"to a writable folder"
            ) from exc
    import ctypes

    return ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL if shared_symbols else ctypes.DEFAULT_MODE)


def load_if_possible(source: Path, *, threaded: bool = True) -> ctypes.CDLL | None:
    """`load(source)`, or None where there is no compiler, the build fails or ctypes cannot load
    what was built: for kernels with a slower fallback that computes the same bits."""
    if compiler() is None:
        return None
    try:
        return load(source, threaded=threaded)
    except (StepFailed, OSError):  # OSError: ctypes could not load what was built
        return None


def _intact(library: Path) -> bool:
    try:
        recorded = library.with_suffix(".blake3").read_text(encoding="ascii").strip()
        return blake3.blake3(library.read_bytes()).hexdigest() == recorded
    except OSError:
        return False


def _build(cc: str, source: Path, library: Path, attempts: tuple[tuple[str, ...], ...]) -> None:
    """Compile into a temporary file and rename it into place, then record its digest: processes
    building at once each write their own file, and a reader never sees half of one."""
    import tempfile

    library.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=library.parent, prefix=f".{library.name}.", suffix=".tmp")
    os.close(handle)
    try:
        for threaded in attempts:
            done = subprocess.run(
                [cc, *FLAGS, *threaded, "-o", temporary, str(source), "-lm"],
                capture_output=True,
                text=True,
                timeout=BUILD_SECONDS,
                check=False,
            )
            if done.returncode == 0:
                break
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if line.strip()), "no message")
            raise StepFailed(
                f"{cc} could not build {source.name} (exit {done.returncode}): {first}; fix the compiler, "
                f"or set CC to another one, or plan with numerics.kernels = 'eager'"
            )
        digest = blake3.blake3(Path(temporary).read_bytes()).hexdigest()
        os.replace(temporary, library)
        library.with_suffix(".blake3").write_text(digest + "\n", encoding="ascii")
    except subprocess.TimeoutExpired as exc:
        raise StepFailed(f"{cc} did not finish building {source.name} in {BUILD_SECONDS} s") from exc
    finally:
        Path(temporary).unlink(missing_ok=True)
