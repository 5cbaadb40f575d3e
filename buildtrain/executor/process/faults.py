"""Test-only fault injection for step processes, read from the environment of `bt run`/`bt verify`.

Never set in normal use; the variables exist so that the test suite can prove that resume, verify
and the checkpoint protocol detect what they claim to detect. The step process receives them as
the job's `hooks`.
"""

from __future__ import annotations

import os
from typing import Any


def _perturbation(text: str) -> list[Any]:
    """`STEP:TENSOR:DELTA`, e.g. `7:blocks.0.attention.wqkv.weight:1e-3`."""
    step, tensor, delta = text.split(":")
    return [int(step), tensor, float(delta)]


def _rank_and_step(text: str) -> list[int]:
    """`RANK:STEP`, e.g. `1:7`."""
    rank, step = text.split(":")
    return [int(rank), int(step)]


# Test-only fault injection, read from the environment of `bt run`/`bt verify` and passed to the
# step process. Never set in normal use; they exist so that the test suite can prove that resume,
# verify and the checkpoint protocol detect what they claim to detect.
TEST_HOOKS = {
    "BT_TEST_STEP_DELAY": ("step_delay", float),
    "BT_TEST_KILL_IN_CHECKPOINT": ("kill_in_checkpoint", int),
    "BT_TEST_SKIP_CURSOR_RESTORE": ("skip_cursor_restore", bool),
    "BT_TEST_PERTURB": ("perturb", _perturbation),
    "BT_TEST_KILL_RANK": ("kill_rank", _rank_and_step),
}


def test_hooks_from_environment() -> dict[str, Any]:
    hooks: dict[str, Any] = {}
    for variable, (name, kind) in TEST_HOOKS.items():
        value = os.environ.get(variable)
        if value:
            hooks[name] = value not in ("0", "false") if kind is bool else kind(value)  # type: ignore[operator]
    return hooks


# The module whose import, inside `import torch`, sends this process SIGTERM (tests only): a signal
# that lands in the middle of a library's import, deterministically.
SIGNAL_IN_IMPORT = "BT_TEST_SIGNAL_IN_IMPORT"


def signal_inside_import_for_tests() -> None:
    """Where `BT_TEST_SIGNAL_IN_IMPORT` names a module (e.g. `torch.nn`), SIGTERM this process
    when that module is first imported."""
    target = os.environ.get(SIGNAL_IN_IMPORT)
    if not target:
        return
    import importlib.abc
    import signal
    import sys

    class SignalOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target_module: Any = None) -> None:
            if name == target and self in sys.meta_path:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGTERM)

    sys.meta_path.insert(0, SignalOnImport())


# The step (by label) whose process, right after publishing its output and before saying so,
# sends SIGINT to itself and to the bt that started it (tests only): a terminal's Ctrl-C at the
# very end of a step, exactly.
SIGNAL_AFTER_PUBLISH = "BT_TEST_SIGNAL_AFTER_PUBLISH"


def signal_after_publish_for_tests(label: str) -> None:
    """Where `BT_TEST_SIGNAL_AFTER_PUBLISH` names `label`, SIGINT bt and this process."""
    if os.environ.get(SIGNAL_AFTER_PUBLISH) != label:
        return
    import signal

    from buildtrain.executor.process.launch import PARENT_PID

    parent = os.environ.get(PARENT_PID)
    if parent:
        os.kill(int(parent), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
