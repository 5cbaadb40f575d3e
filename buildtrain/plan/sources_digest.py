"""The part of the toolchain fingerprint that is buildtrain's own code: for each step kind, a
digest of exactly the modules that can change that kind's outputs.

Those are the kind's computing module, the numerics environment its process runs under, and every
buildtrain module they import, directly or not (imports are read from the source, function-local
ones included, without importing anything). Presentation code (the CLI, progress, reports, help
texts, verification, the kinds' descriptions) is never reached from them, so improving a message keeps every cached step,
while a change to anything a step computes with changes that kind's hash and no other.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import blake3

PACKAGE = "buildtrain"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent

# Every step process applies the numerics environment before it imports torch.
SHARED_ROOTS = ("buildtrain.executor.numerics",)


def module_path(root: Path, module: str) -> Path | None:
    """The source file of a buildtrain module under `root` (a package's `__init__.py`)."""
    parts = module.split(".")[1:]
    as_file = root.joinpath(*parts).with_suffix(".py") if parts else None
    if as_file is not None and as_file.is_file():
        return as_file
    as_package = root.joinpath(*parts, "__init__.py")
    return as_package if as_package.is_file() else None


def imported_modules(root: Path, module: str) -> set[str]:
    """The buildtrain modules that `module`'s source imports, anywhere in it, and the packages
    they sit in (a package's `__init__` runs on import)."""
    path = module_path(root, module)
    if path is None:
        return set()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                parts = name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {name for name in found if module_path(root, name) is not None}


def closure(root: Path, starts: tuple[str, ...]) -> list[str]:
    """`starts` and every buildtrain module they import, transitively; sorted."""
    seen: set[str] = set()
    pending = list(starts)
    while pending:
        module = pending.pop()
        if module in seen or module_path(root, module) is None:
            continue
        seen.add(module)
        pending.extend(imported_modules(root, module) - seen)
    return sorted(seen)


def computing_root(kind: str) -> str:
    """Where a kind's computation starts: the module its kind names (`kinds/`), which the
    executor's worker runs."""
    from buildtrain.kinds import kind_of  # the kinds' toolchains read this module

    return kind_of(kind).computes


def computing_modules(kind: str, root: Path | None = None) -> list[str]:
    return closure(root or PACKAGE_ROOT, (computing_root(kind), *SHARED_ROOTS))


@functools.cache
def _digest(kind: str, root: Path) -> str:
    hasher = blake3.blake3()
    for module in computing_modules(kind, root):
        path = module_path(root, module)
        assert path is not None  # closure() keeps only modules with a source file
        name, content = module.encode(), path.read_bytes()
        hasher.update(len(name).to_bytes(8, "little") + name)
        hasher.update(len(content).to_bytes(8, "little") + content)
    return hasher.hexdigest()


def source_digest(kind: str, root: Path | None = None) -> str:
    """blake3 over the name and bytes of every module that computes steps of `kind`."""
    return _digest(kind, root or PACKAGE_ROOT)


def clear_cache() -> None:
    """Forget computed digests (files do not change under a running bt; they do in tests)."""
    _digest.cache_clear()
