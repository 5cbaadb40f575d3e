"""From the merged preset (plain TOML data) to a `Config`: the top level, the sections, and one
fully merged `Stage` per `[[stages]]` entry, with every problem found along the way.

A stage's `data` and `train` are the top-level tables with the stage's own merged over them, so
a problem in an inherited key is found once per stage; it is reported at the top-level key (and
so once) unless the stage set one of the keys it involves, which makes it the stage's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from buildtrain.config.checks import name_problem
from buildtrain.config.convert import describe
from buildtrain.config.presets import deep_merge
from buildtrain.config.problems import KeyPath, suggest, unknown_key
from buildtrain.config.schema import (
    SECTIONS,
    STAGE_KEYS,
    TOP_LEVEL_KEYS,
    Config,
    DataConfig,
    Stage,
    TrainConfig,
)
from buildtrain.config.validate import Finding, finding, structure_section

# Every stage's place for the checks across stages: (index, name or None if it has no valid
# name, init_from or None).
StageNode = tuple[int, str | None, str | None]


def resolve(raw: dict[str, Any]) -> tuple[Config | None, list[Finding]]:
    """The config, if the preset is valid, and every problem with it in the order of the preset
    language: the top level, the shared sections, then each stage."""
    found: list[Finding] = [
        finding((key,), unknown_key(key, TOP_LEVEL_KEYS)) for key in raw if key not in TOP_LEVEL_KEYS
    ]

    name = raw.get("name", Config().name)
    if not isinstance(name, str) or not name:
        found.append(finding(("name",), f"expected a non-empty string, got {describe(name)}"))
    elif name_problem(name):
        found.append(finding(("name",), str(name_problem(name))))

    sections: dict[str, Any] = {}
    for section in ("model", "eval", "numerics", "export"):
        sections[section], problems = structure_section(raw.get(section, {}), SECTIONS[section], (section,))
        found += problems

    top: dict[str, Any] = {}
    for section in ("data", "train"):
        top[section] = raw.get(section, {})
        if not isinstance(top[section], dict):
            found.append(finding((section,), f"expected a table, got {describe(top[section])}"))
            top[section] = {}

    stages_raw = raw.get("stages")
    implicit = stages_raw is None
    if implicit:
        stages_raw = [{"name": "main"}]
    if not isinstance(stages_raw, list) or not stages_raw:
        found.append(finding(("stages",), "expected a non-empty array of tables ([[stages]])"))
        stages_raw = []

    stages: list[Stage] = []
    graph: list[StageNode] = []
    for index, stage_raw in enumerate(stages_raw):
        if not isinstance(stage_raw, dict):
            found.append(finding(("stages", index), f"expected a table, got {describe(stage_raw)}"))
            graph.append((index, None, None))
            continue
        stage, node, problems = _stage(index, stage_raw, top, implicit)
        found += problems
        graph.append(node)
        if stage is not None:
            stages.append(stage)

    found += _check_stage_graph(graph)
    if found:  # every part that did not structure said why
        return None, found
    return Config(name=name, stages=tuple(stages), **sections), found


def _stage(
    index: int, stage_raw: dict[str, Any], top: Mapping[str, dict[str, Any]], implicit: bool
) -> tuple[Stage | None, StageNode, list[Finding]]:
    key: KeyPath = ("stages", index)
    found = [
        finding((*key, extra), unknown_key(extra, STAGE_KEYS))
        for extra in stage_raw
        if extra not in STAGE_KEYS
    ]
    name = stage_raw.get("name")
    if not isinstance(name, str) or not name:
        found.append(finding((*key, "name"), 'each stage needs a name, for example name = "pretrain"'))
        name = None
    elif name_problem(name):
        found.append(finding((*key, "name"), str(name_problem(name))))
    init_from = stage_raw.get("init_from")
    if init_from is not None and not isinstance(init_from, str):
        found.append(finding((*key, "init_from"), f"expected a stage name, got {describe(init_from)}"))
        init_from = None

    parts: dict[str, Any] = {}
    for section, cls in (("data", DataConfig), ("train", TrainConfig)):
        override = stage_raw.get(section, {})
        if not isinstance(override, dict):
            found.append(finding((*key, section), f"expected a table, got {describe(override)}"))
            override = {}
        parts[section], problems = structure_section(deep_merge(top[section], override), cls, (*key, section))
        found += [_placed(problem, {} if implicit else stage_raw) for problem in problems]

    node = (index, name, init_from)
    if name is None or parts["data"] is None or parts["train"] is None:
        return None, node, found
    return Stage(name=name, init_from=init_from, data=parts["data"], train=parts["train"]), node, found


def _placed(found: Finding, stage_raw: Mapping[str, Any]) -> Finding:
    """A finding of a stage's merged table, with each key it involves where it was written: in
    the stage's own table, or else at the top level; reported at the stage's key if the stage
    wrote any of them."""

    def own(key: KeyPath) -> bool:
        node: Any = stage_raw
        for part in key[2:]:  # past ("stages", index)
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return False
        return True

    involves = tuple(k if own(k) else k[2:] for k in found.involves)
    key = found.key if any(own(k) for k in found.involves) else found.key[2:]
    return Finding(key=key, message=found.message, involves=involves)


def _check_stage_graph(graph: list[StageNode]) -> list[Finding]:
    """Unique names and earlier parents, over every stage table, so a stage with a bad setting
    neither hides nor shifts the problems of the stages after it. A stage without a valid name
    takes part in none of these checks, and a parent that is not found is not reported while a
    stage has no valid name (it may be the one meant)."""
    found: list[Finding] = []
    first: dict[str, int] = {}
    for index, name, _ in graph:
        if name is None:
            continue
        if name in first:
            message = f"'{name}' is already the name of stages[{first[name]}]"
            found.append(finding(("stages", index, "name"), message, ("stages", first[name], "name")))
        first.setdefault(name, index)
    names = tuple(("stages", index, "name") for index, _, _ in graph)
    for index, name, init_from in graph:
        if init_from is None:
            continue
        key: KeyPath = ("stages", index, "init_from")
        if init_from not in first:
            if all(n is not None for _, n, _ in graph):
                message = f"no stage named '{init_from}'{suggest(init_from, list(first))}"
                found.append(finding(key, message, *names))
        elif first[init_from] >= index:
            child = f"'{name}'" if name is not None else f"stages[{index}]"
            message = f"stage '{init_from}' does not come before {child}; a stage can only start from an earlier one"
            found.append(finding(key, message, ("stages", first[init_from], "name")))
    return found
