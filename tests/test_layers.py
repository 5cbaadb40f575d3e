"""Imports run one way: a module imports only from its own layer or the layers below it.

The order follows the data's path, with what everything needs at the bottom: the canonical
encoding and errors; the sources (regular files, durable writes, the stat cache, safetensors
headers, data URLs, bucket data sources); the store (bytes, digests, manifests); the typed config;
the plan compiled from it; the steps that compute; the executor that runs them; verification,
which drives the executor and checks the store; and the presentation (CLI, reports) on top. Every
import counts, function-local and type-only ones included, read from the source without importing
anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "buildtrain"

# Lowest first. A module's layer is the first entry whose prefix its dotted name starts with.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "buildtrain.errors",
            "buildtrain.canonical",
            "buildtrain.clock",
            "buildtrain.native",
            "buildtrain.__init__",
        ),
    ),
    ("sources", ("buildtrain.sources",)),
    ("store", ("buildtrain.store",)),
    ("config", ("buildtrain.config",)),
    ("plan", ("buildtrain.plan", "buildtrain.kinds")),
    ("steps", ("buildtrain.steps",)),
    ("executor", ("buildtrain.executor",)),
    ("verify", ("buildtrain.verify",)),
    ("presentation", ("buildtrain.cli", "buildtrain.views", "buildtrain.__main__")),
]


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in out if name.startswith("buildtrain.")]


def known_module(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported name refers to (`from buildtrain.store import objects` -> the module
    `buildtrain.store.objects`; `from buildtrain.store.store import Store` -> `buildtrain.store.store`)."""
    if name in known:
        return name
    if f"{name}.__init__" in known:
        return f"{name}.__init__"
    return None


def test_every_module_has_a_layer() -> None:
    for module in modules():
        layer_of(module)


def violations(known: dict[str, Path]) -> list[str]:
    wrong = []
    for module, path in known.items():
        own = layer_of(module)
        for line, name in imports(path):
            target = known_module(name, known)
            if target is None or target.endswith(".__init__"):
                continue  # a name inside a module (seen as the module itself) or a package marker
            if layer_of(target) > own:
                wrong.append(
                    f"{path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE) else path.name}:{line} "
                    f"({LAYERS[own][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    return wrong


def test_imports_run_one_way() -> None:
    wrong = violations(modules())
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """A store module that imports the executor inside a function is caught; one that imports
    the canonical encoding is not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from buildtrain.canonical import digest\n\ndef f():\n    from buildtrain.executor.loop.run import run_plan\n"
    )
    known = {**modules(), "buildtrain.store.probe": probe}
    assert [line for line in violations(known) if "probe" in line] == [
        "probe.py:4 (store) imports buildtrain.executor.loop.run (executor)"
    ]


def test_the_design_page_draws_the_same_order() -> None:
    """The graph in docs/design.md's "Layers" lists the layers top-down, first word of each line."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    start = design.index("```\n", design.index("its imports run one way")) + 4
    drawn = [line.split()[0] for line in design[start : design.index("```", start)].splitlines()]
    drawn = [word for word in drawn if word != "│"]
    first_module = {
        "presentation": "cli/",
        "verify": "verify/",
        "executor": "executor/",
        "steps": "steps/",
        "plan": "plan/",
        "config": "config/",
        "store": "store/",
        "sources": "sources/",
        "base": "canonical.py",
    }
    assert drawn == [first_module[name] for name, _ in reversed(LAYERS)]


def test_presentation_never_imports_torch_itself() -> None:
    """Tables, reports and the CLI read the store and records; torch stays in the step processes."""
    for module, path in modules().items():
        if LAYERS[layer_of(module)][0] == "presentation":
            for node in ast.walk(ast.parse(path.read_bytes())):
                names = (
                    [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                assert not any(n.split(".")[0] == "torch" for n in names), f"{module} imports torch"


# Presentation reads the store and calls one entry point per command of the layers beneath it; it
# never reaches into a step for a fact about a file (those live in store/layout.py and beside it).
ENTRY_POINTS = {
    "presentation": (
        "buildtrain.executor.loop.run",
        "buildtrain.executor.loop.batch",
        "buildtrain.executor.process.launch",
        "buildtrain.executor.adhoc.deliver",
        "buildtrain.executor.remote.transfer",  # bt push, bt pull, ls/show --remote, verify --push
        "buildtrain.executor.engines.engine",  # --executor: which engine, with what options
        "buildtrain.executor.engines.probes",  # --executor: what a preset is planned for (the workers, kept)
        "buildtrain.executor.adhoc.score",  # bt eval: one suite scored on a built plan's weights
    ),
}
NO_REACH: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    # (what, modules, prefixes they must not import)
    ("presentation", ("buildtrain.cli", "buildtrain.views"), ("buildtrain.steps",)),
    ("views", ("buildtrain.views",), ("buildtrain.executor", "buildtrain.verify.verify")),
    (
        "fsck and gc",
        ("buildtrain.verify.fsck", "buildtrain.verify.fsck_objects", "buildtrain.verify.gc"),
        ("buildtrain.steps", "buildtrain.executor"),
    ),
    ("the store", ("buildtrain.store",), ("buildtrain.config", "buildtrain.plan", "buildtrain.steps")),
]


def owner(name: str, known: dict[str, Path]) -> str:
    """The module an imported name lives in (`buildtrain.executor.loop.run.RunOptions` -> `...run`)."""
    parts = name.split(".")
    while parts:
        found = known_module(".".join(parts), known)
        if found is not None:
            return found.removesuffix(".__init__")
        parts.pop()
    return name


def reaches(known: dict[str, Path]) -> list[str]:
    wrong = []
    for what, owners, forbidden in NO_REACH:
        for module, path in known.items():
            if not any(module == o or module.startswith(o + ".") for o in owners):
                continue
            for line, name in sorted(set(imports(path))):
                target = owner(name, known)
                if any(target == f or target.startswith(f + ".") for f in forbidden):
                    wrong.append(f"{module}:{line} ({what}) imports {target}")
                    break
    for module, path in known.items():
        if LAYERS[layer_of(module)][0] != "presentation":
            continue
        for line, name in imports(path):
            target = owner(name, known)
            if target.startswith("buildtrain.executor") and target not in ENTRY_POINTS["presentation"]:
                wrong.append(f"{module}:{line} (presentation) imports {target}, not an entry point")
    return wrong


def test_presentation_fsck_and_gc_reach_no_step_for_a_fact_about_a_file() -> None:
    wrong = reaches(modules())
    assert not wrong, "imports past the entry points:\n" + "\n".join(wrong)


def test_the_reach_rule_catches_a_view_reading_a_step(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from buildtrain.steps.eval.cache import cache_key\nfrom buildtrain.store import layout\n"
    )
    known = {**modules(), "buildtrain.views.probe": probe}
    assert [line for line in reaches(known) if "probe" in line] == [
        "buildtrain.views.probe:1 (presentation) imports buildtrain.steps.eval.cache"
    ]


def test_the_facts_about_files_import_nothing_heavy() -> None:
    """store/layout.py is read by torch-side steps and by `bt ls` alike: standard library only."""
    for name in ("layout",):
        tree = ast.parse((PACKAGE / "store" / f"{name}.py").read_bytes())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0
        }
        assert imported <= {"__future__", "re", "collections", "pathlib"}, imported


# -- no circles -----------------------------------------------------------------------------------


def arrows(path: Path, known: dict[str, Path]) -> set[str]:
    """The buildtrain modules `path` imports, every import counted (module level, in a function,
    for types only). `from a.b import c` is an arrow to the module `a.b.c` when there is one, else
    to `a.b`; the packages a module sits in run first on import, but are not what it uses."""
    found = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name, known) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = known_module(f"{node.module}.{alias.name}", known)
                found.add(submodule.removesuffix(".__init__") if submodule else owner(node.module, known))
    return {name for name in found if name.startswith("buildtrain")}


def circles(known: dict[str, Path]) -> list[list[str]]:
    """Every import circle, as the modules on it (the strongly connected components of more than
    one module; Tarjan's algorithm)."""
    graph = {m.removesuffix(".__init__"): arrows(p, known) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module] & graph.keys()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_import_graph_has_no_circles() -> None:
    found = circles(modules())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_rule_catches_a_function_level_circle(tmp_path: Path) -> None:
    """Two probes that import each other, one of them only inside a function, are a circle; a
    probe that imports a package's module through the package is not one with the package."""
    one, other = tmp_path / "one.py", tmp_path / "other.py"
    one.write_text("from buildtrain.store.probe_other import x\n")
    other.write_text("def f():\n    import buildtrain.store.probe_one\n")
    known = {**modules(), "buildtrain.store.probe_one": one, "buildtrain.store.probe_other": other}
    assert circles(known) == [["buildtrain.store.probe_one", "buildtrain.store.probe_other"]]
    through = tmp_path / "through.py"
    through.write_text("from buildtrain.cli import commands\n")
    assert circles({**modules(), "buildtrain.cli.probe": through}) == []


# The plan model sits below the kinds, and the planner above them: kinds build steps of the
# model's `Step` and read the toolchain; the planner asks the kinds.
PLAN_MODEL = (
    "buildtrain.plan.plan",
    "buildtrain.plan.toolchain",
    "buildtrain.plan.sources_digest",
    "buildtrain.plan.normal_form",
)


def test_the_kinds_sit_between_the_plan_model_and_the_planner() -> None:
    known = modules()
    wrong = []
    for module, path in known.items():
        plan_side = [t for t in arrows(path, known) if t.startswith(("buildtrain.plan.", "buildtrain.kinds"))]
        if module in PLAN_MODEL:
            wrong += [f"{module} imports {t}" for t in plan_side if t not in PLAN_MODEL]
        elif module.startswith("buildtrain.kinds"):
            wrong += [
                f"{module} imports {t}"
                for t in plan_side
                if t.startswith("buildtrain.plan.") and t not in PLAN_MODEL
            ]
    assert not wrong, "arrows up from the plan model or the kinds:\n" + "\n".join(wrong)


# -- config on the ground floor --------------------------------------------------------------------

# (what, modules, prefixes they must not import, counting every import). The config reads files,
# the stat cache, safetensors headers and bucket data sources from the sources room; the planner
# digests a bucket object there too, never through the team cache; the sources room stands on the
# base alone.
GROUND_FLOOR: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("config", ("buildtrain.config",), ("buildtrain.store",)),
    ("plan", ("buildtrain.plan", "buildtrain.kinds"), ("buildtrain.store.remote",)),
    (
        "sources",
        ("buildtrain.sources",),
        tuple(prefix for name, prefixes in LAYERS if name not in {"base", "sources"} for prefix in prefixes),
    ),
]


def floor_breaches(known: dict[str, Path]) -> list[str]:
    wrong = []
    for what, owners, forbidden in GROUND_FLOOR:
        for module, path in known.items():
            if not any(module == o or module.startswith(o + ".") for o in owners):
                continue
            for target in sorted(arrows(path, known)):
                if any(target == f or target.startswith(f + ".") for f in forbidden):
                    wrong.append(f"{module} ({what}) imports {target}")
    return wrong


def test_config_stands_on_the_sources_room_alone() -> None:
    """config/ imports nothing from store/ (nor store/remote/), plan/ and kinds/ nothing from the
    team cache, and sources/ nothing above the base."""
    wrong = floor_breaches(modules())
    assert not wrong, "imports off the ground floor:\n" + "\n".join(wrong)


def test_the_floor_rule_catches_each_breach(tmp_path: Path) -> None:
    """A config module reading the stat cache's old home inside a function, a plan module that
    digests through the team cache, and a sources module that names the store for types only."""
    config, plan, source = tmp_path / "config.py", tmp_path / "plan.py", tmp_path / "source.py"
    config.write_text("def f():\n    from buildtrain.store.store import Store\n")
    plan.write_text(
        "from buildtrain.store.remote.backend import CHUNK\nfrom buildtrain.store import layout\n"
    )
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from buildtrain.store.store import Store\n"
    )
    known = {
        **modules(),
        "buildtrain.config.probe": config,
        "buildtrain.plan.probe": plan,
        "buildtrain.sources.probe": source,
    }
    assert [line for line in floor_breaches(known) if "probe" in line] == [
        "buildtrain.config.probe (config) imports buildtrain.store.store",
        "buildtrain.plan.probe (plan) imports buildtrain.store.remote.backend",
        "buildtrain.sources.probe (sources) imports buildtrain.store.store",
    ]


# -- sizes ----------------------------------------------------------------------------------------

# A newcomer reads a module in one sitting and a function on one screen (issue 47). The argument
# and schema tables are long because each entry is one setting, read alone, not a flow to follow.
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
TABLES = ("buildtrain.cli.parser", "buildtrain.config.schema")


def long_modules(known: dict[str, Path]) -> dict[str, int]:
    """Modules over MAX_MODULE_LINES lines, tables left out, with their line counts."""
    counts = {m: len(p.read_bytes().splitlines()) for m, p in known.items() if m not in TABLES}
    return {m: n for m, n in counts.items() if n > MAX_MODULE_LINES}


def long_functions(known: dict[str, Path]) -> dict[str, int]:
    """Functions and methods over MAX_FUNCTION_LINES lines (decorators left out, as ast counts
    them), named `module.function` or `module.Class.method`, tables left out."""
    found = {}
    for module, path in known.items():
        if module in TABLES:
            continue

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                name = getattr(child, "name", None)
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    size = (child.end_lineno or child.lineno) - child.lineno + 1
                    if size > MAX_FUNCTION_LINES:
                        found[f"{prefix}.{name}"] = size
                visit(child, f"{prefix}.{name}" if name else prefix)

        visit(ast.parse(path.read_bytes()), module)
    return found


def test_no_module_or_function_is_too_long_to_read_in_one_sitting() -> None:
    known = modules()
    modules_over, functions_over = long_modules(known), long_functions(known)
    wrong = [f"{m}: {n} lines" for m, n in sorted(modules_over.items())]
    wrong += [f"{f}(): {n} lines" for f, n in sorted(functions_over.items())]
    assert not wrong, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: split it along"
        " a seam of responsibility (a module) or into named steps (a function):\n" + "\n".join(wrong)
    )


def test_the_size_rule_catches_a_long_module_and_a_long_method(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    probe.write_text(f"class C:\n    def m(self):\n{body}\n" + "\n" * MAX_MODULE_LINES)
    known = {"buildtrain.store.probe": probe, "buildtrain.cli.parser": probe}
    assert long_modules(known) == {"buildtrain.store.probe": MAX_MODULE_LINES + MAX_FUNCTION_LINES + 3}
    assert long_functions(known) == {"buildtrain.store.probe.C.m": MAX_FUNCTION_LINES + 1}


# -- cluster clients -------------------------------------------------------------------------------

# Ray and Slurm's client are imported only inside their engines, so a run on this machine never
# loads them (`tests/test_executor.py` proves the run side by importtime; this names the modules).
CLUSTER_CLIENTS = {
    "ray": ("buildtrain.executor.engines.ray_engine",),
    "submitit": ("buildtrain.executor.engines.slurm_engine", "buildtrain.executor.engines.slurm_task"),
}


def test_ray_and_submitit_are_imported_only_inside_their_engines() -> None:
    wrong = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                client = name.split(".")[0]
                if client in CLUSTER_CLIENTS and module not in CLUSTER_CLIENTS[client]:
                    wrong.append(f"{module}:{node.lineno} imports {name}")
    assert not wrong, "cluster clients imported outside their engines:\n" + "\n".join(wrong)


# -- the executor's rooms --------------------------------------------------------------------------

# The executor's rooms, lowest first: a room imports only from its own and the rooms below it
# (every import counted). The process model starts and follows a step's process and never reads a
# submission; the team cache's client stands on it; the engines (the seam, local, Ray, Slurm) place
# processes and may pull through the remote; the build loop hands every engine a submission; the
# commands on a built plan (adhoc) stand on the process model alone.
EXECUTOR_ROOMS = ("process", "remote", "engines", "loop", "adhoc")


def room_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["buildtrain", "executor"] or len(parts) < 4:
        return None  # outside the executor, or its package marker
    if parts[2] not in EXECUTOR_ROOMS:
        raise AssertionError(f"{module} belongs to no room of the executor: add it to EXECUTOR_ROOMS")
    return EXECUTOR_ROOMS.index(parts[2])


def arrows_up_between_rooms(known: dict[str, Path]) -> list[str]:
    wrong = []
    for module, path in known.items():
        own = room_of(module)
        if own is None:
            continue
        for target in sorted(arrows(path, known)):
            room = room_of(target)
            if room is not None and room > own:
                wrong.append(f"{module} ({EXECUTOR_ROOMS[own]}/) imports {target} ({EXECUTOR_ROOMS[room]}/)")
    return wrong


def test_the_executors_rooms_point_only_down() -> None:
    """Nothing in process/ imports engines/ (only the local engine spawns, from a submission), and
    no room imports one above it."""
    wrong = arrows_up_between_rooms(modules())
    assert not wrong, "arrows up between the executor's rooms:\n" + "\n".join(wrong)


def test_the_room_rule_catches_spawn_reading_a_submission(tmp_path: Path) -> None:
    """A process module that imports the engine seam inside a function, as spawn once did."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from buildtrain.executor.engines.engine import Submission\n")
    known = {**modules(), "buildtrain.executor.process.probe": probe}
    assert [line for line in arrows_up_between_rooms(known) if "probe" in line] == [
        "buildtrain.executor.process.probe (process/) imports buildtrain.executor.engines.engine (engines/)"
    ]
