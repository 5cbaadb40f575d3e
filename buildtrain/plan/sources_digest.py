"""The part of the toolchain fingerprint that is buildtrain's own code: for each step kind, a
digest of exactly the modules that can change that kind's outputs.

Those are the kind's computing module, the numerics environment its process runs under, and every
buildtrain module they import, directly or not (imports are read from the source, function-local
ones included, without importing anything; imports under `if TYPE_CHECKING:` never run and are not
followed); a module with a C source of the same name beside it (the kernels it builds and calls,
`buildtrain/native.py`) brings that source in too. Presentation code (the CLI, progress, reports,
help texts, verification, the kinds' descriptions), the store and its locks are never reached from
them, so improving a message keeps every cached step, while a change to anything a step computes
with changes that kind's hash and no other. A kind passes its computing module in (`StepKind.computes`):
this module sits below the kinds and never asks them.

Each module enters as its normal form (`normal_form.py`): its syntax tree without comments,
docstrings and help texts, so rewording those keeps every hash too; a C source without comments
and spare whitespace. The digest names the Python minor version the trees were written under.

Reading each module's imports and normal form means parsing it, which cost about 210 ms of a
345 ms `bt plan` (154 parses of 51 modules). Both are functions of the module's bytes, so they
are cached on disk (`ImportCache`) under the blake3 of those bytes: an edited module has another
key, whatever its size or mtime.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import sys
from pathlib import Path

import attrs
import blake3

from buildtrain.plan.normal_form import PYTHON, c_form, python_form
from buildtrain.sources.durable import framed, unframed, write_bytes_durably

PACKAGE = "buildtrain"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent

# Every step process applies the numerics environment before it imports torch.
SHARED_ROOTS = ("buildtrain.executor.process.numerics",)

# The cache lives with the user's caches, not in the store or the package: the digests describe
# the installed code, which every store shares, and nothing under the package may change while
# it is being hashed (a read-only install cannot be written at all). Entries are few (one per
# module version, about 350 bytes each); past CACHE_ENTRIES the ones this process did not use go.
# One file per parser identity, so that checkouts of different buildtrain versions side by side
# do not keep replacing each other's file.
CACHE_ENTRIES = 4096


@functools.cache
def _package_modules(root: Path) -> dict[str, Path]:
    """Every module under `root` by dotted name, from one walk of the folder (a stat and two
    pathlib joins per lookup cost a null build about 5 ms). A module file wins over a package
    of the same name, as on import."""
    found: dict[str, Path] = {}
    for folder, dirs, files in os.walk(root):
        dirs.sort()  # parents before children: `a/b.py` is seen before `a/b/__init__.py`
        relative = os.path.relpath(folder, root)
        prefix = PACKAGE if relative == "." else ".".join((PACKAGE, *relative.split(os.sep)))
        for name in sorted(files):
            if name.endswith(".py"):
                stem = name[: -len(".py")]
                found.setdefault(prefix if stem == "__init__" else f"{prefix}.{stem}", Path(folder, name))
    return found


def module_path(root: Path, module: str) -> Path | None:
    """The source file of a buildtrain module under `root` (a package's `__init__.py`)."""
    return _package_modules(root).get(module)


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) without an `else`: never runs."""
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@attrs.frozen
class Parsed:
    """What a module's bytes say for a code digest: the buildtrain names it imports where they can
    run (`parse_imports`) and the blake3 of its normal form (`normal_form.python_form`)."""

    imports: tuple[str, ...]
    code: str


def parse_module(source: bytes, filename: str = "<module>") -> Parsed:
    tree = ast.parse(source, filename=filename)
    imports = tuple(parse_imports(tree))  # before the normal form, which edits the tree
    return Parsed(imports, blake3.blake3(python_form(tree)).hexdigest())


def parse_imports(tree: ast.Module) -> list[str]:
    """Every buildtrain name that `tree` imports where it can run, and the packages they sit in
    (a package's `__init__` runs on import); sorted. Not yet filtered to existing modules."""
    found: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if _type_checking_only(node):
            continue
        pending.extend(ast.iter_child_nodes(node))
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                parts = name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(found)


def cache_location() -> Path:
    """`$XDG_CACHE_HOME/buildtrain/code-imports-<parser>.json` (default `~/.cache/...`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / PACKAGE / f"code-imports-{parser_identity()[:16]}.json"


@functools.cache
def parser_identity() -> str:
    """What else decides a parse: the Python grammar and `ast.dump`, and the extraction and
    normal-form rules (this module and `normal_form.py`). An entry written under another identity
    is never read."""
    own = Path(__file__).read_bytes() + Path(__file__).with_name("normal_form.py").read_bytes()
    return blake3.blake3(f"{sys.version_info[0]}.{sys.version_info[1]}\n".encode() + own).hexdigest()


class ImportCache:
    """Each module's `Parsed` under the blake3 of its bytes, kept in one file whose body is
    checked against its own digest. A damaged or foreign file, or an entry of the wrong shape,
    is ignored (and rewritten): it can cost a parse, never change a digest."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, Parsed] = {}
        self.used: set[str] = set()
        self.dirty = False
        self.parsed = 0  # parses this process needed (the cache's misses)
        if path is not None:
            self.entries = _read_entries(path)

    def parse(self, source: bytes, content: str, filename: str) -> Parsed:
        """What `source`, whose blake3 is `content`, says for a code digest."""
        self.used.add(content)
        found = self.entries.get(content)
        if found is None:
            found = parse_module(source, filename)
            self.parsed += 1
            self.entries[content] = found
            self.dirty = True
        return found

    def save(self) -> None:
        """Best effort: a cache that cannot be written (a read-only home) only costs time."""
        if not self.dirty or self.path is None:
            return
        keep = self.entries if len(self.entries) <= CACHE_ENTRIES else {k: self.entries[k] for k in self.used}
        modules = {key: {"imports": list(p.imports), "code": p.code} for key, p in keep.items()}
        body = json.dumps({"parser": parser_identity(), "modules": modules}, sort_keys=True).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_durably(self.path, framed(body), durable=False)
        except OSError:
            return
        self.dirty = False


def _read_entries(path: Path) -> dict[str, Parsed]:
    try:
        body = unframed(path.read_bytes())
        loaded = json.loads(body) if body is not None else None
    except (OSError, ValueError):
        return {}
    if not isinstance(loaded, dict) or loaded.get("parser") != parser_identity():
        return {}
    entries = loaded.get("modules")
    if not isinstance(entries, dict):
        return {}
    return {key: parsed for key, entry in entries.items() if (parsed := _entry(entry)) is not None}


def _entry(entry: object) -> Parsed | None:
    """A cached entry, if it has the shape `save` writes."""
    if not isinstance(entry, dict) or set(entry) != {"imports", "code"}:
        return None
    names, code = entry["imports"], entry["code"]
    if not isinstance(names, list) or not isinstance(code, str) or len(code) != 64:
        return None
    if not all(isinstance(n, str) and (n == PACKAGE or n.startswith(PACKAGE + ".")) for n in names):
        return None
    return Parsed(tuple(names), code)


_CACHE: list[ImportCache] = []  # this process's cache, loaded on first use


def import_cache() -> ImportCache:
    if not _CACHE:
        _CACHE.append(ImportCache(cache_location()))
    return _CACHE[0]


@functools.cache
def _parsed(path: Path) -> Parsed:
    """A module's `Parsed`, its bytes read once per process (per `clear_cache`)."""
    raw = path.read_bytes()
    return import_cache().parse(raw, blake3.blake3(raw).hexdigest(), str(path))


def imported_modules(root: Path, module: str) -> set[str]:
    """The buildtrain modules that `module`'s source imports where it can run, and the packages
    they sit in."""
    path = module_path(root, module)
    if path is None:
        return set()
    return {name for name in _parsed(path).imports if module_path(root, name) is not None}


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


def computing_modules(computes: str, root: Path | None = None, also: tuple[str, ...] = ()) -> list[str]:
    """The modules that compute a step whose kind names `computes` (`StepKind.computes`, the
    module the executor's worker runs) as where its computation starts, and `also` (modules it
    reaches by name, `StepKind.also_computes`)."""
    return closure(root or PACKAGE_ROOT, (computes, *also, *SHARED_ROOTS))


@functools.cache
def _c_form(path: Path) -> bytes:
    return c_form(path.read_bytes())


@functools.cache
def _digest(computes: str, root: Path, also: tuple[str, ...]) -> str:
    hasher = blake3.blake3(PYTHON.encode() + b"\n")  # the trees' encoding is this version's
    for module in computing_modules(computes, root, also):
        path = module_path(root, module)
        assert path is not None  # closure() keeps only modules with a source file
        name, code = module.encode(), _parsed(path).code.encode()
        hasher.update(len(name).to_bytes(8, "little") + name)
        hasher.update(len(code).to_bytes(8, "little") + code)
        native_source = path.with_suffix(".c")
        if native_source.is_file():  # C kernels the module builds and calls (buildtrain/native.py)
            form = _c_form(native_source)
            hasher.update(b"c" + len(form).to_bytes(8, "little") + form)
    import_cache().save()
    return hasher.hexdigest()


def source_digest(computes: str, root: Path | None = None, also: tuple[str, ...] = ()) -> str:
    """blake3 over the name and normal form of every module that computes a step whose kind's
    computation starts at the module `computes` (and at `also`, reached by name)."""
    return _digest(computes, root or PACKAGE_ROOT, also)


def clear_cache() -> None:
    """Forget computed digests and the bytes read (files do not change under a running bt; they
    do in tests). The on-disk import cache stays: it is keyed by content."""
    _digest.cache_clear()
    _parsed.cache_clear()
    _c_form.cache_clear()
    _package_modules.cache_clear()
    _CACHE.clear()
