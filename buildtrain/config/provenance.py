"""Which layer set each key of a preset, so a problem is reported where it can be fixed.

A preset is built in layers, applied in order: the presets it extends (depth first, each after
the presets it extends), the preset itself, then each `--set`. The provenance maps every key path a
layer wrote (tables, values and array elements) to that layer's label (a file as `display` shows
it, or `--set KEY=VALUE`); the last layer to write a key owns it. Never hashed: it is for messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from buildtrain.config.problems import KeyPath

Provenance = dict[KeyPath, str]


def record(provenance: Provenance, value: Any, prefix: KeyPath, label: str) -> None:
    """`label` wrote `value` at `prefix`, and so every key inside it."""
    provenance[prefix] = label
    if isinstance(value, dict):
        for key, item in value.items():
            record(provenance, item, (*prefix, key), label)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            record(provenance, item, (*prefix, index), label)


def forget_below(provenance: Provenance, prefix: KeyPath) -> None:
    """Forget the keys inside `prefix`: a value that replaced a table or an array owns them no more."""
    for key in [k for k in provenance if len(k) > len(prefix) and k[: len(prefix)] == prefix]:
        del provenance[key]


def merge_layer(provenance: Provenance, table: Mapping[str, Any], label: str, prefix: KeyPath = ()) -> None:
    """Record a layer merged over the ones before it: tables merge key by key (a table keeps the
    label of the layer that first wrote it), any other value replaces what was there."""
    for key, item in table.items():
        path = (*prefix, key)
        if isinstance(item, Mapping):
            provenance.setdefault(path, label)
            merge_layer(provenance, item, label, path)
        else:
            forget_below(provenance, path)  # a replaced array forgets its old elements
            record(provenance, item, path, label)


def merge_base(
    provenance: Provenance, base: Mapping[str, Any], base_provenance: Mapping[KeyPath, str]
) -> None:
    """Record a preset this one extends, merged over the presets it extends before it, by the
    rules of `merge_layer`."""
    tables = {key for key in base_provenance if isinstance(_lookup(base, key), Mapping)}
    for key in base_provenance.keys() - tables:
        forget_below(provenance, key)  # this base replaced the value or array there
    for key, label in base_provenance.items():
        if key in tables:
            provenance.setdefault(key, label)
        else:
            provenance[key] = label


def _lookup(tree: Any, key: KeyPath) -> Any:
    for part in key:
        try:
            tree = tree[part]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


def source_of(provenance: Mapping[KeyPath, str], key: KeyPath, default: str) -> str:
    """The layer that set `key` or its nearest set ancestor (`default`, the preset, if none did)."""
    for length in range(len(key), 0, -1):
        found = provenance.get(key[:length])
        if found is not None:
            return found
    return default


def blame(
    provenance: Mapping[KeyPath, str],
    layers: Sequence[str],
    key: KeyPath,
    involves: Iterable[KeyPath],
    default: str,
) -> str:
    """The layer to blame for a problem at `key` that depends on the values at `involves`.

    Of the layers that set one of those keys, the last one applied: the problem appeared when it
    was applied, since the layers before it had not yet set all of them. So a problem of one key
    is blamed on the layer that set the key; a rule broken by `--set` on `--set`; one whose keys
    all come from a parent preset on the parent. If none was set, the nearest set ancestor of `key`.
    """
    order = {label: position for position, label in enumerate(layers)}  # a repeated label: its last
    setters = [provenance[k] for k in involves if k in provenance]
    if not setters:
        return source_of(provenance, key, default)
    return max(setters, key=lambda label: order.get(label, -1))
