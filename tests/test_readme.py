"""The README and the docs/ pages say what the code does: their commands, the preset reference,
the exit codes and their links."""

from __future__ import annotations

import argparse
import platform
import re
import shlex

import pytest
from conftest import REPO, run_bt

from buildtrain.cli.parser import build_parser
from buildtrain.config.reference import render
from buildtrain.errors import ExitCode
from buildtrain.plan.toolchain import torch_build

README = (REPO / "README.md").read_text(encoding="utf-8")
TOUR = README.split("## A tour", 1)[1].split("\n## ", 1)[0]
DOCS = {path.name: path.read_text(encoding="utf-8") for path in sorted((REPO / "docs").glob("*.md"))}
PAGES = {"README.md": README} | {f"docs/{name}": text for name, text in DOCS.items()}
MAX_README_LINES = 300
HASH = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{4,64}\b"  # digits and letters: 29500 is a port


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


def test_preset_reference_in_the_docs_is_current():
    section = (
        DOCS["reference.md"]
        .split("<!-- reference:start", 1)[1]
        .split("-->", 1)[1]
        .split("<!-- reference:end -->", 1)[0]
    )
    assert section.strip() == render().strip(), (
        "run python -m buildtrain.config.reference and paste it into docs/reference.md"
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


def test_the_readme_is_a_front_door():
    """What it is, install, the tour and where to go next; every topic lives in a docs/ page."""
    assert len(README.splitlines()) <= MAX_README_LINES, "move the new section into a page under docs/"
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", README))
    assert linked == set(DOCS), "the README's 'Where to go next' must link every docs/ page"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return {github_anchor(heading) for heading in re.findall(r"^#{1,6} (.+)$", prose, flags=re.MULTILINE)}


def relative_links(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [target for target in targets if not re.match(r"^[a-z]+:", target)]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_relative_link_resolves(page: str):
    """A link from the README or a docs/ page names a file that exists (an image, a page, a
    source file) and, for a page, a heading that it has."""
    here = (REPO / page).parent
    for target in relative_links(PAGES[page]):
        path, _, anchor = target.partition("#")
        file = (here / path).resolve() if path else REPO / page
        assert file.is_file(), f"{page}: the link {target} names no file"
        assert REPO in file.parents, f"{page}: the link {target} leaves the repository"
        if anchor:
            assert file.suffix == ".md", f"{page}: an anchor into a file that is not a page: {target}"
            assert anchor in anchors(file.read_text(encoding="utf-8")), f"{page}: no heading for {target}"


def commands(text: str) -> list[str]:
    """The commands of a page: every line of its ```sh blocks and every `$ ` line of its ```console
    blocks, continuation lines joined, comments dropped."""
    found = []
    for language, block in re.findall(r"```(sh|console)\n(.*?)```", text, flags=re.DOTALL):
        lines = block.replace("\\\n", " ").splitlines()
        if language == "console":
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        found += [re.sub(r"(^|\s+)#.*$", "", line).strip() for line in lines]
    return [line for line in found if line]


def shell_words(command: str) -> list[str]:
    """The words of a command as a POSIX shell splits them, with `|`, `&&`, `;` and redirections
    as words of their own."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def bt_invocations(command: str) -> list[list[str]]:
    """The argument lists of `bt` (or `python -m buildtrain`) in one shell command, those inside
    `$(...)` included; pipes, `&&`, `;`, redirections and leading VAR=value assignments split off."""
    parts: list[str] = []
    while "$(" in command:  # the innermost substitutions first, each a command of its own
        command = re.sub(r"\$\(([^()]*)\)", lambda match: parts.append(match[1]) or "SUBSTITUTED", command)
    found = []
    for part in [command, *parts]:
        simple: list[str] = []
        for word in [*shell_words(part), ";"]:
            if word not in ("|", "||", "&&", ";", "&"):
                simple.append(word)
                continue
            if redirected := [i for i, w in enumerate(simple) if w[0] in "<>"]:
                first = redirected[0] - (redirected[0] > 0 and simple[redirected[0] - 1].isdigit())
                simple = simple[:first]
            while simple and re.match(r"^\w+=", simple[0]):
                simple = simple[1:]
            if simple[:1] == ["bt"]:
                found.append(simple[1:])
            elif simple[:3] == ["python", "-m", "buildtrain"]:
                found.append(simple[3:])
            simple = []
    return found


def test_bt_invocations_are_found_where_a_shell_would_run_them():
    line = "B=$(bt plan -q x.toml --set a=1) && bt run $B 2>&1 | tee log; python -m buildtrain ls > out"
    assert bt_invocations(line) == [["run", "$B"], ["ls"], ["plan", "-q", "x.toml", "--set", "a=1"]]
    assert commands("```console\n$ bt run \\\n  $H   # built\nrun: done\n```\n```sh\nbt ls  # all\n```") == [
        "bt run    $H",
        "bt ls",
    ]


def test_the_checks_see_the_pages_commands_and_headings():
    """The readers above find what is there (40 bt commands when this was written), so a change
    to them that finds nothing cannot pass for pages that are all correct."""
    found = sum(len(bt_invocations(command)) for text in PAGES.values() for command in commands(text))
    assert found >= 30
    assert "a-team-cache-remote" in anchors(DOCS["remote.md"])
    assert relative_links("[a](x.md#y) `[b](no.md)` [c](https://example.org)") == ["x.md#y"]


def strict_parser() -> argparse.ArgumentParser:
    """bt's parser, taking each option only by its full name (argparse would read `--remot` as
    `--remote`, so a page could keep a renamed flag's old name when it is a prefix of the new)."""
    parser = build_parser()
    pending = [parser]
    while pending:
        current = pending.pop()
        current.allow_abbrev = False
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += list(action.choices.values())
    return parser


def test_an_abbreviated_or_unknown_option_does_not_parse():
    for argv in (["run", "PLAN", "--remot", "s3://bucket/bt"], ["run", "PLAN", "--no-such-flag"]):
        with pytest.raises(SystemExit) as exit_:
            strict_parser().parse_args(argv)
        assert exit_.value.code == ExitCode.USAGE


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_bt_command_in_the_docs_parses(page: str):
    """Each `bt ...` of a page's command blocks parses with bt's own argument parser, without
    running it, so a renamed or removed flag fails here rather than in a reader's shell."""
    parser = strict_parser()
    for command in commands(PAGES[page]):
        for argv in bt_invocations(command):
            try:
                parser.parse_args(argv)
            except SystemExit as exit_:
                assert exit_.code == 0, f"{page}: bt does not accept: {command}"


@pytest.mark.parametrize("page", sorted(DOCS))
def test_the_docs_commands_carry_their_hashes_and_run_anywhere(page: str):
    """As in the tour: a docs/ page names a plan by a variable set earlier on the page (or by a
    word such as PLAN that says what to put there), never by a hash printed on one machine."""
    assigned = {"PWD", "HOME"}  # the shell's own
    for command in commands(DOCS[page]):
        assert not re.search(HASH, command), f"docs/{page}: a literal hash in {command}"
        for simple in re.split(r"&&|\|\||;", command):
            for name in re.findall(r"\$\{?(\w+)", simple):
                assert name in assigned, f"docs/{page}: ${name} is used before the page sets it: {command}"
            assigned |= set(re.findall(r"^\s*(?:export\s+)?(\w+)=", simple))
