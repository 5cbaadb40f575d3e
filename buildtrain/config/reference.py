"""The preset reference, rendered from the config classes so that it cannot drift from them.

Every key comes with its type, its default (as TOML), its allowed values and the one-line doc
that `setting()` attached to the field. docs/reference.md embeds the output of

    python -m buildtrain.config.reference
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import attrs

from buildtrain.config.checks import DOC, bounds_of, choices_of
from buildtrain.config.schema import SECTIONS, STAGE_KEYS, Config, Stage

EXTENDS_DOC = (
    "presets this one builds on, relative to this file; tables merge key by key, "
    "arrays and values are replaced, later files win and this file wins over all"
)

INTRO = """\
## Preset reference

A preset is a TOML file. Every key below except a stage's name is optional: a left-out key takes its
default, and the resolved config (every default filled in) is what the plan hash covers. Unknown
keys are errors.
`bt plan PRESET --set KEY=VALUE` overrides any key with a TOML value, for example
`--set train.lr=3e-4` or `--set stages.finetune.train.steps=50` (a stage by name or by index,
`stages[1]`).

**Stages.** `[data]` and `[train]` at the top level are the defaults of every training stage.
Each `[[stages]]` entry names a stage and overrides only what differs in its own `data` and `train`
tables (merged key by key; an array such as `files` is replaced). A preset without `[[stages]]` has
one stage, `main`. A stage with `init_from` starts from the final weights of an earlier stage;
`[eval]` and `[export]` apply to the last stage."""


@attrs.frozen
class KeyDoc:
    """One documented key of the preset language."""

    section: str  # the heading it is listed under: "top level", "[data]", "[[stages]]", ...
    key: str  # the key path as written in a preset; `stages[]` stands for any stage
    type: str
    default: str  # a TOML value, or a note in parentheses such as "(required)"
    doc: str
    choices: tuple[str, ...] = ()
    bounds: tuple[str, ...] = ()  # ranges such as "> 0.0"


def type_name(annotation: Any) -> str:
    """A field's type in TOML words."""
    if attrs.has(annotation):
        return "table"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"array of {type_name(args[0])}s"
        return f"array of {len(args)} {type_name(args[0])}s"
    return {bool: "boolean", int: "integer", float: "float", str: "string"}.get(annotation, str(annotation))


def toml_value(value: Any) -> str:
    """A default as it would be written in a preset."""
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return "(table)"


def _default(field: attrs.Attribute[Any]) -> Any:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()  # type: ignore[call-arg]
    return default


def _fields(cls: type, prefix: str, section: str) -> list[KeyDoc]:
    hints = typing.get_type_hints(cls)
    found: list[KeyDoc] = []
    for field in attrs.fields(cls):
        key = f"{prefix}.{field.name}"
        annotation = hints[field.name]
        if attrs.has(annotation):  # a nested table: document its keys under its own path
            found.extend(_fields(annotation, key, section))
            continue
        takes_self = isinstance(field.default, attrs.Factory) and field.default.takes_self  # type: ignore[arg-type]
        found.append(
            KeyDoc(
                section=section,
                key=key,
                type=type_name(annotation),
                default="(see description)" if takes_self else toml_value(_default(field)),
                doc=field.metadata[DOC],
                choices=choices_of(field) or (),
                bounds=tuple(str(b) for b in bounds_of(field)),
            )
        )
        tables = [a for a in typing.get_args(annotation) if attrs.has(a)]
        if tables:  # a word or a table (data.tokenizer), or an array of tables (eval.suites)
            array = typing.get_origin(annotation) is tuple
            found.extend(_fields(tables[0], f"{key}[]" if array else key, section))
    return found


def _top_level() -> list[KeyDoc]:
    fields = attrs.fields_dict(Config)
    found = [
        KeyDoc(
            "top level", "name", "string", toml_value(_default(fields["name"])), fields["name"].metadata[DOC]
        ),
        KeyDoc("top level", "extends", "string or array of strings", "[]", EXTENDS_DOC),
        KeyDoc(
            "top level",
            "stages",
            "array of tables",
            '[{name = "main"}]',
            fields["stages"].metadata[DOC] + "; see [[stages]]",
        ),
    ]
    return found


def _stage_keys() -> list[KeyDoc]:
    hints = typing.get_type_hints(Stage)
    found = []
    for name in STAGE_KEYS:
        field = attrs.fields_dict(Stage)[name]
        if attrs.has(hints[name]):
            found.append(
                KeyDoc(
                    "[[stages]]",
                    f"stages[].{name}",
                    "table",
                    f"(the top-level [{name}])",
                    f"{field.metadata[DOC]}: any key of [{name}], overriding the top-level [{name}]",
                )
            )
        else:
            default = "(required)" if name == "name" else toml_value(_default(field))
            found.append(
                KeyDoc("[[stages]]", f"stages[].{name}", type_name(hints[name]), default, field.metadata[DOC])
            )
    return found


def reference() -> list[KeyDoc]:
    """Every key of the preset language, in the order the reference lists them."""
    found = _top_level()
    for name, cls in SECTIONS.items():
        found.extend(_fields(cls, name, f"[{name}]"))
    found.extend(_stage_keys())
    return found


def section_intro(section: str) -> str:
    if section in ("top level", "[[stages]]"):
        return {
            "top level": "Keys outside any table.",
            "[[stages]]": "One entry per training stage, in order.",
        }[section]
    cls = SECTIONS[section.strip("[]")]
    return (cls.__doc__ or "").strip().splitlines()[0]


def render() -> str:
    """The reference as Markdown: one table per section."""
    lines = [INTRO]
    current = None
    for doc in reference():
        if doc.section != current:
            current = doc.section
            lines += [
                "",
                f"### {current}",
                "",
                section_intro(current),
                "",
                "| key | type | default | allowed | description |",
                "|---|---|---|---|---|",
            ]
        default = doc.default if doc.default.startswith("(") else f"`{doc.default}`".replace("|", "\\|")
        allowed = ", ".join([f"`{c}`" for c in doc.choices] + [f"{b}" for b in doc.bounds])
        description = doc.doc.replace("|", "\\|")
        lines.append(f"| `{doc.key}` | {doc.type} | {default} | {allowed} | {description} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
