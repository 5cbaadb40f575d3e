"""Shared fixtures: a temporary store, the micro preset, and a way to run `bt` as a user does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MICRO = REPO / "tests" / "presets" / "micro.toml"
TINY = REPO / "presets" / "tiny.toml"
PRETRAIN_FINETUNE = REPO / "examples" / "pretrain_finetune.toml"


BtRunner = Callable[..., subprocess.CompletedProcess]


def run_bt(
    *args: str,
    store: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`bt ARGS` in a fresh process against `store`, the way a user runs it (text output)."""
    environment = {**os.environ, "BT_STORE": str(store), **(env or {})}
    environment.setdefault("BT_EXPERIMENTS", str(store.parent / "experiments"))
    return subprocess.run(
        [sys.executable, "-m", "buildtrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd or store.parent,
        env=environment,
        timeout=timeout,
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / ".bt"


@pytest.fixture
def bt(store: Path) -> BtRunner:
    """Run `bt` against this test's store: `bt("plan", str(MICRO))`."""

    def runner(*args: str, **kwargs: object) -> subprocess.CompletedProcess:
        return run_bt(*args, store=store, **kwargs)  # type: ignore[arg-type]

    return runner
