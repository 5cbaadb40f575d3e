"""The toolchain digest covers exactly the code that computes a step: both ways.

Each test copies the package, edits one module of the copy (a line of code: comments, docstrings
and help texts leave the digest, `plan/normal_form.py`), and compiles the two-stage micro preset with a trained BPE (so the plan holds every
step kind) against the copy. A module a step kind computes with changes exactly the hashes of
that kind's steps and of the steps downstream of them; a module no step computes with changes no
hash at all.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from buildtrain.kinds import KINDS
from buildtrain.plan import sources_digest
from buildtrain.plan.plan import Plan
from buildtrain.plan.planner import plan_preset
from buildtrain.plan.sources_digest import module_path
from buildtrain.store.store import Store

REPO = Path(__file__).resolve().parent.parent
MICRO_STAGES = REPO / "tests" / "presets" / "micro_stages.toml"
WITH_BPE = ['data.tokenizer={ kind = "bpe", vocab_size = 300 }']
WITH_SUITE = f'eval.suites=[{{ name = "arith", file = "{REPO / "tests" / "suites" / "arithmetic.jsonl"}" }}]'
PRESENTATION = (
    "buildtrain.cli",
    "buildtrain.views.text",
    "buildtrain.executor.loop.progress",
    "buildtrain.executor.loop.run",
    "buildtrain.verify.verify",
    "buildtrain.verify.watch",
    "buildtrain.verify.fsck",
    "buildtrain.config.reference",
)


def computing_modules(kind: str, root: Path) -> list[str]:
    """The modules that compute steps of `kind`, read from the package at `root`."""
    return sources_digest.computing_modules(KINDS[kind].computes, root, KINDS[kind].also_computes)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("package") / "buildtrain"
    shutil.copytree(sources_digest.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def compiled(root: Path, store: Store, overrides: list[str] = WITH_BPE) -> Plan:
    """The micro preset's plan, with buildtrain's code read from `root`."""
    previous = sources_digest.PACKAGE_ROOT
    sources_digest.PACKAGE_ROOT = root
    sources_digest.clear_cache()  # the copy's files change between calls; a process's do not
    try:
        return plan_preset(MICRO_STAGES, overrides, store).plan
    finally:
        sources_digest.PACKAGE_ROOT = previous


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides that start the micro preset from a checkpoint of its own shape (the plan then
    holds an import_hf step; planning reads config.json, the tokenizer and the shard's header)."""
    import json

    import numpy as np
    import safetensors.numpy

    from buildtrain.steps.tokenizer.files import byte_level_json

    folder = tmp_path_factory.mktemp("checkpoint")
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 257,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes(byte_level_json(256))
    safetensors.numpy.save_file(
        {"model.norm.weight": np.ones(32, np.float32)}, str(folder / "model.safetensors")
    )
    return [f'model.init.hf="{folder}"']


def step_hashes(root: Path, store: Store) -> dict[str, str]:
    return {step.label: step.hash for step in compiled(root, store).steps}


def downstream(plan: Plan, labels: set[str]) -> set[str]:
    """`labels` and every step that reads one of them, directly or not."""
    found = set(labels)
    for step in plan.steps:  # plan order: inputs come first
        if any(plan.step(h).label in found for h in step.upstream.values()):
            found.add(step.label)
    return found


EDIT = b"\n_AN_EDIT = 1\n"  # a statement: code the digest must see


def edited(root: Path, module: str) -> Path:
    """Append a statement to `module` in the copy at `root`; returns the file, to restore it."""
    path = module_path(root, module)
    assert path is not None, module
    with path.open("ab") as handle:
        handle.write(EDIT)
    return path


def all_modules(root: Path) -> list[str]:
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def changed_labels(
    root: Path, store: Store, module: str, before: dict[str, str], overrides: list[str] = WITH_BPE
) -> set[str]:
    path = edited(root, module)
    original = path.read_bytes()[: -len(EDIT)]
    try:
        after = {step.label: step.hash for step in compiled(root, store, overrides).steps}
    finally:
        path.write_bytes(original)
    return {label for label in before if before[label] != after[label]}


def test_presentation_modules_compute_nothing(package: Path) -> None:
    computing = {m for kind in KINDS for m in computing_modules(kind, package)}
    assert computing.isdisjoint(PRESENTATION)


def test_a_presentation_edit_changes_no_hash(package: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    before = step_hashes(package, store)
    computing = {m for kind in KINDS for m in computing_modules(kind, package)}
    outside = [m for m in all_modules(package) if m not in computing]
    assert set(PRESENTATION) <= set(outside)
    # All at once: had any of them entered a digest, some hash would change.
    paths = {module_path(package, m): module_path(package, m).read_bytes() for m in outside}
    for module in outside:
        edited(package, module)
    try:
        assert step_hashes(package, store) == before
    finally:
        for path, original in paths.items():
            path.write_bytes(original)


@pytest.mark.parametrize("pretrained", [False, True])
def test_a_computing_edit_changes_the_steps_it_computes(
    package: Path, tmp_path: Path, checkpoint: list[str], pretrained: bool
) -> None:
    """With a trained BPE (every kind but import_hf), then from a checkpoint (import_hf, with a
    given tokenizer file)."""
    store = Store(tmp_path / "store")
    overrides = [*(checkpoint if pretrained else WITH_BPE), WITH_SUITE]  # a suite: ngrams steps too
    plan = compiled(package, store, overrides)
    before = {step.label: step.hash for step in plan.steps}
    kinds = {step.kind for step in plan.steps}
    assert kinds == (set(KINDS) if pretrained else set(KINDS) - {"import_hf"})  # every kind is exercised
    computing = {kind: computing_modules(kind, package) for kind in kinds}
    for module in sorted(set().union(*computing.values())):
        users = {kind for kind, modules in computing.items() if module in modules}
        computed = {step.label for step in plan.steps if step.kind in users}
        # Exactly the steps it computes, and those downstream of them (through their inputs).
        after = changed_labels(package, store, module, before, overrides)
        assert after == downstream(plan, computed), module


# -- each kind's closure, module by module -------------------------------------------------------

# Code that never computes a step: the store and its locks, the plan's data structure, input
# checking, and (for the kinds that do not read data files) the readers and the BPE trainer.
NOT_COMPUTING = {
    "buildtrain.store.store",
    "buildtrain.store.locks",
    "buildtrain.store.meta",
    "buildtrain.sources.stat_cache",
    "buildtrain.plan.plan",
    "buildtrain.executor.process.inputs",
}
DATA_READING = {
    "buildtrain.steps.data.step",
    "buildtrain.steps.data.tokenized",
    "buildtrain.steps.corpus",
    "buildtrain.steps.formats",
    "buildtrain.steps.sources",
    "buildtrain.steps.tokenizer.step",
}


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The import cache in a folder of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sources_digest.clear_cache()
    yield tmp_path / "cache"
    sources_digest.clear_cache()


def digests(root: Path) -> dict[str, str]:
    sources_digest.clear_cache()
    return {
        kind: sources_digest.source_digest(KINDS[kind].computes, root, KINDS[kind].also_computes)
        for kind in KINDS
    }


def test_each_kind_computes_without_the_store_and_the_other_kinds_readers(package: Path) -> None:
    closures = {kind: set(computing_modules(kind, package)) for kind in KINDS}
    for kind, modules in closures.items():
        assert modules.isdisjoint(NOT_COMPUTING), kind
    for kind in ("train", "eval", "export"):
        # The eval step reads its suites' files (sources by content) through the checked reader.
        reads = {"buildtrain.steps.sources"} if kind == "eval" else set()
        assert closures[kind].isdisjoint(DATA_READING - reads), kind
    assert "buildtrain.steps.tokenizer.step" not in closures["data"]  # it reads a tokenizer, never trains one
    assert "buildtrain.steps.eval.cache" not in closures["train"]


def test_per_kind_an_edit_changes_exactly_the_kinds_whose_closure_holds_it(
    package: Path, private_cache: Path
) -> None:
    """Every module of the package, edited alone: a kind's digest changes if and only if the
    module is in the kind's closure (inside: changes; outside: never)."""
    closures = {kind: set(computing_modules(kind, package)) for kind in KINDS}
    before = digests(package)
    for module in all_modules(package):
        path = edited(package, module)
        original = path.read_bytes()[: -len(EDIT)]
        try:
            after = digests(package)
        finally:
            path.write_bytes(original)
        changed = {kind for kind in before if before[kind] != after[kind]}
        assert changed == {kind for kind, modules in closures.items() if module in modules}, module


def test_per_kind_all_edits_outside_its_closure_at_once_change_nothing(
    package: Path, private_cache: Path
) -> None:
    before = digests(package)
    for kind in KINDS:
        inside = set(computing_modules(kind, package))
        outside = [m for m in all_modules(package) if m not in inside]
        originals = {module_path(package, m): module_path(package, m).read_bytes() for m in outside}
        for module in outside:
            edited(package, module)
        try:
            assert digests(package)[kind] == before[kind], kind
        finally:
            for path, original in originals.items():
                path.write_bytes(original)


def test_no_import_circles_in_steps() -> None:
    """Among the step modules, no module imports (at run time, in a function or for types only)
    one that imports it back, directly or not."""
    from test_layers import imports, known_module, modules

    known = modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        if module.startswith("buildtrain.steps."):
            targets = {known_module(name, known) for _, name in imports(path)}
            graph[module] = {t for t in targets if t and t.startswith("buildtrain.steps.") and t != module}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(target) :], target]))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# -- the on-disk import cache --------------------------------------------------------------------


def cold_digests(root: Path) -> dict[str, str]:
    """Digests with every module parsed now (no cache at all)."""
    sources_digest.clear_cache()
    sources_digest._CACHE.append(sources_digest.ImportCache(None))
    try:
        return {
            kind: sources_digest.source_digest(KINDS[kind].computes, root, KINDS[kind].also_computes)
            for kind in KINDS
        }
    finally:
        sources_digest.clear_cache()


def test_the_cache_gives_the_digests_of_a_cold_computation(package: Path, private_cache: Path) -> None:
    cold = cold_digests(package)
    assert digests(package) == cold  # filling the cache
    assert sources_digest.import_cache().parsed > 0
    assert digests(package) == cold  # read from it, as a second process would
    assert sources_digest.import_cache().parsed == 0
    assert list(private_cache.rglob("code-imports-*.json"))


def test_an_edit_that_keeps_size_and_mtime_is_seen(package: Path, private_cache: Path) -> None:
    """The cache is keyed by content: an edit that keeps the size and the mtime (and changes the
    imports) is parsed again."""
    path = module_path(package, "buildtrain.steps.seeds")
    original = path.read_bytes()
    comment, statement = b"\n# " + b"x" * 30 + b"\n", b"\nimport buildtrain.views.text".ljust(33) + b"\n"
    assert len(comment) == len(statement)
    try:
        path.write_bytes(original + comment)
        stat = path.stat()
        assert "buildtrain.views.text" not in computing_modules("data", package)
        digests(package)  # the cache now holds the commented version
        path.write_bytes(original + statement)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
        assert digests(package) == cold_digests(package)
        sources_digest.clear_cache()
        assert "buildtrain.views.text" in computing_modules("data", package)
    finally:
        path.write_bytes(original)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "foreign", "malformed"])
def test_a_damaged_or_foreign_cache_changes_no_digest(
    package: Path, private_cache: Path, damage: str
) -> None:
    import json

    from buildtrain.sources.durable import framed

    cold = cold_digests(package)
    digests(package)
    (cache,) = private_cache.rglob("code-imports-*.json")
    raw = cache.read_bytes()
    body = json.loads(raw.partition(b"\n")[2])
    # Every module imports the CLI side.
    wrong = {key: {"imports": ["buildtrain.views.text"], "code": "0" * 64} for key in body["modules"]}
    if damage == "flip":  # a wrong entry in a file whose digest no longer matches
        cache.write_bytes(raw[:70] + raw[70:].replace(b"buildtrain.steps", b"buildtrain.views", 1))
    elif damage == "truncate":
        cache.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        cache.write_bytes(b"\x00\xff" * 100)
    elif damage == "foreign":  # another parser's entries, sealed correctly: not read
        cache.write_bytes(framed(json.dumps({"parser": "another", "modules": wrong}).encode()))
    else:  # entries of the wrong shape under this parser
        entries = {key: {"imports": "buildtrain.views.text", "code": "0" * 64} for key in body["modules"]}
        cache.write_bytes(framed(json.dumps({"parser": body["parser"], "modules": entries}).encode()))
    assert digests(package) == cold, damage
    assert sources_digest.import_cache().parsed > 0  # parsed again instead


@pytest.mark.parametrize(
    ("c_source", "kinds"),
    [("steps/train/kernels.c", ("train", "eval")), ("steps/data/short_blake3.c", ("data",))],
)
def test_an_edit_to_a_modules_c_source_changes_the_steps_that_build_it(
    package: Path, tmp_path: Path, c_source: str, kinds: tuple[str, ...]
) -> None:
    """`steps/train/kernels.c` is compiled and called by `kernels.py`, `steps/data/short_blake3.c` by
    `short_blake3.py` (the data split): each is part of its module's code."""
    store = Store(tmp_path / "store")
    plan = compiled(package, store)
    before = {step.label: step.hash for step in plan.steps}
    source = package / c_source
    original = source.read_bytes()
    source.write_bytes(original + b"\nstatic const int an_edit = 1;\n")
    try:
        after = step_hashes(package, store)
    finally:
        source.write_bytes(original)
    changed = {label for label in before if before[label] != after[label]}
    computing = {step.label for step in plan.steps if step.kind in kinds}
    assert computing and changed == downstream(plan, computing)


# -- what cannot change a result leaves the digest ------------------------------------------------

TINY = REPO / "presets" / "tiny.toml"
# (module file, text, replacement): each is an edit that cannot change a number.
WORDING = [
    (
        "executor/process/numerics.py",
        "# cuBLAS's workspace configuration, read",
        "# the workspace cuBLAS is given, read",
    ),
    ("config/schema.py", '"width of the residual stream"', '"the width of the residual stream"'),
    (
        "executor/process/numerics.py",
        '"""The numerics profile, in three parts',
        '"""The numerics profile, in 3 parts',
    ),
]


def tiny_plan_hash(root: Path, store: Store) -> str:
    previous = sources_digest.PACKAGE_ROOT
    sources_digest.PACKAGE_ROOT = root
    sources_digest.clear_cache()
    try:
        return plan_preset(TINY, [], store).plan.hash
    finally:
        sources_digest.PACKAGE_ROOT = previous


def rewritten(root: Path, file: str, text: str, replacement: str) -> bytes:
    """Replace the one `text` in `root/file`; returns the original bytes, to restore them."""
    path = root / file
    original = path.read_bytes()
    assert original.count(text.encode()) == 1, (file, text)
    path.write_bytes(original.replace(text.encode(), replacement.encode()))
    return original


@pytest.mark.parametrize(("file", "text", "replacement"), WORDING, ids=["comment", "help", "docstring"])
def test_a_comment_a_help_text_or_a_docstring_edit_keeps_the_plan_hash(
    package: Path, tmp_path: Path, private_cache: Path, file: str, text: str, replacement: str
) -> None:
    store = Store(tmp_path / "store")
    before = tiny_plan_hash(package, store)
    original = rewritten(package, file, text, replacement)
    try:
        assert tiny_plan_hash(package, store) == before
    finally:
        (package / file).write_bytes(original)


@pytest.mark.parametrize(
    ("file", "text", "replacement"),
    [
        (
            "executor/process/numerics.py",
            '"CUBLAS_WORKSPACE_CONFIG": ":4096:8"',
            '"CUBLAS_WORKSPACE_CONFIG": ":4096:16"',
        ),
        ("steps/train/kernels.c", "1.0f / 120", "1.0f / 121"),  # a constant in a C kernel
    ],
)
def test_a_constant_edit_moves_the_plan_hash(
    package: Path, tmp_path: Path, private_cache: Path, file: str, text: str, replacement: str
) -> None:
    store = Store(tmp_path / "store")
    before = tiny_plan_hash(package, store)
    original = rewritten(package, file, text, replacement)
    try:
        assert tiny_plan_hash(package, store) != before
    finally:
        (package / file).write_bytes(original)


def test_no_computing_module_reads_what_the_normal_form_drops(package: Path) -> None:
    """Docstrings live on as `__doc__`, a setting's help as its `DOC` metadata: were a computing
    module to read either, a dropped text could change a result."""
    computing = {m for kind in KINDS for m in computing_modules(kind, package)}
    for module in sorted(computing):
        source = module_path(package, module).read_text(encoding="utf-8")
        assert "__doc__" not in source and "getdoc" not in source, module
        if module != "buildtrain.config.checks":  # where DOC is defined and written
            assert not re.search(r"\bDOC\b", source), module
