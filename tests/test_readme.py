"""The README says what the code does: its commands, its reference and its exit codes."""

from __future__ import annotations

import platform
import re

import pytest
from conftest import REPO, run_bt

from buildtrain.config.reference import render
from buildtrain.errors import ExitCode
from buildtrain.plan.toolchain import torch_build

README = (REPO / "README.md").read_text(encoding="utf-8")
TOUR = README.split("## A tour", 1)[1].split("\n## ", 1)[0]


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)


def test_readme_starts_with_the_install_and_run_and_the_test_command():
    first, second = shell_blocks(README)[:2]
    assert first.strip() == "pip install torch==2.13.0 && pip install -e . && bt run presets/tiny.toml"
    assert second.strip() == "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    test_command = shell_blocks(README)[1].strip()
    assert test_command in ci.splitlines()


def test_preset_reference_in_the_readme_is_current():
    section = (
        README.split("<!-- reference:start", 1)[1].split("-->", 1)[1].split("<!-- reference:end -->", 1)[0]
    )
    assert section.strip() == render().strip(), (
        "run python -m buildtrain.config.reference and paste it into README.md"
    )


def test_exit_code_table_matches_the_code():
    table = README.split("### Exit codes", 1)[1].split("\n## ", 1)[0]
    documented = {int(code) for code in re.findall(r"^\| (\d) \|", table, flags=re.MULTILINE)}
    assert documented == {int(code) for code in ExitCode}


def test_the_readme_says_its_timings_hold_on_a_quiet_machine():
    """A newcomer on a loaded 2-core machine measured twice the README's figures."""
    head = README.split("## A tour", 1)[0]
    assert "Every timing in this README was measured on a quiet machine" in head
    assert "On a loaded one expect up to twice as long" in head


def test_the_tours_plan_hashes_are_what_bt_plan_prints_here(tmp_path):
    """The tour's hashes include a digest of buildtrain's source: an edit as small as a comment
    re-hashes every plan, and the tour went stale that way once. With the pinned torch they are
    the same on every x86-64 machine, Intel or AMD (the portable target names no vendor), so this
    checks them on every machine CI may run on."""
    if platform.machine() not in ("x86_64", "AMD64") or not torch_build().startswith("2.13.0+cpu@"):
        pytest.skip("the tour's hashes are an x86-64 machine's, planned with torch 2.13.0+cpu")
    tiny = run_bt("plan", str(REPO / "presets" / "tiny.toml"), store=tmp_path / ".bt")
    stages = run_bt("plan", "-q", str(REPO / "examples" / "pretrain_finetune.toml"), store=tmp_path / ".bt")
    assert tiny.returncode == 0 and stages.returncode == 0, tiny.stderr + stages.stderr
    shown = re.search(r"^\$ echo \$H\n([0-9a-f]{64})\n", TOUR, re.M)
    shown_stages = re.search(
        r"^\$ A=\$\(bt plan -q examples/pretrain_finetune\.toml\) +# ([0-9a-f]{12})\.\.\.", TOUR, re.M
    )
    assert shown and shown_stages, "the tour's first two bt plan commands are not where this test looks"
    fix = "re-run the tour (README.md, A tour) and update its hashes"
    assert (shown[1], shown_stages[1]) == (tiny.stdout.strip(), stages.stdout.strip()[:12]), fix
    assert tiny.stderr.strip() in TOUR, fix  # the summary: the plan's and its steps' hashes


def test_the_tours_commands_carry_their_hashes_and_run_anywhere():
    """Copied verbatim, the tour works on any machine: a command names a plan by a variable that
    an earlier `bt plan` set, never by a hash printed on the machine that wrote the README (`bt
    run ab51` failed elsewhere with "no plan ab51" while the hashes named the CPU vendor)."""
    commands = re.findall(r"^\$ (.*?)(?:\s+#.*)?$", TOUR, re.M)
    assigned: set[str] = set()
    for command in commands:
        assert not re.search(r"\b[0-9a-f]{4,64}\b", command), f"a literal hash in the tour: {command}"
        for name in re.findall(r"\$(\w+)", command):
            assert name in assigned, f"${name} is used before the tour sets it: {command}"
        if match := re.match(r"^(\w+)=\$\(bt plan ", command):
            assigned.add(match[1])
    assert {"H", "A", "B"} <= assigned, "the tour's bt plan commands are not where this test looks"
