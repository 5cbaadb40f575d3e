"""`bt plan`, `bt show`, `bt ls` as a user meets them: stdout, stderr, exit codes, no torch."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO, PRETRAIN_FINETUNE, BtRunner

from buildtrain.cli import main
from buildtrain.errors import ExitCode
from buildtrain.plan.planner import plan_preset
from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store

HASH_LINE = re.compile(r"^[0-9a-f]{64}\n$")


def test_bt_plan_prints_only_the_hash_and_the_summary_on_stderr(bt: BtRunner, store: Path) -> None:
    result = bt("plan", str(MICRO))
    assert result.returncode == 0, result.stderr
    assert HASH_LINE.match(result.stdout), repr(result.stdout)
    planned = result.stdout.strip()
    assert Store(store).plans.hashes() == [planned]
    summary = result.stderr.splitlines()
    assert summary[0] == f"plan {planned[:12]} 'micro': 4 steps, 0 cached, 4 to run"
    assert [line.split()[0] for line in summary[1:]] == ["data:main", "train:main", "eval", "export"]
    assert all("will run: not built" in line for line in summary[1:])
    assert "Traceback" not in result.stderr


def test_plan_again_prints_the_same_hash_and_nothing_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(tmp_path / ".bt")
    assert main(["--store", store, "plan", str(MICRO)]) == 0
    first = capsys.readouterr()
    assert main(["plan", str(MICRO), "--store", store, "-q"]) == 0
    second = capsys.readouterr()
    assert HASH_LINE.match(first.out) and second.out == first.out
    assert second.err == ""  # --quiet: the hash only


def test_bt_plan_does_not_import_torch(tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "from buildtrain.cli import main\n"
        f"code = main(['--store', {str(tmp_path / '.bt')!r}, 'plan', {str(PRETRAIN_FINETUNE)!r}])\n"
        "assert code == 0, code\n"
        "assert 'torch' not in sys.modules, 'bt plan imported torch'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors', 'numpy')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


# -- show and ls ----------------------------------------------------------------------------------


@pytest.fixture
def two_plans(store: Path) -> tuple[str, str]:
    first = plan_preset(MICRO, [], Store(store)).plan.hash
    second = plan_preset(MICRO, ["train.lr=1e-3"], Store(store)).plan.hash
    return first, second


def test_bt_show_by_prefix(bt: BtRunner, two_plans: tuple[str, str]) -> None:
    planned = two_plans[0]
    result = bt("show", planned[:8])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"plan    {planned}"
    assert lines[1] == "name    micro"
    assert lines[2] == f"preset  {MICRO}"
    for label in ("data:main", "train:main", "eval", "export"):
        assert any(line.startswith(f"  {label}  ") for line in lines), label
    assert "  stages[0].train.lr = 0.003" in lines
    assert "  model.dim = 32" in lines


def test_bt_show_json(bt: BtRunner, store: Path, two_plans: tuple[str, str]) -> None:
    planned = two_plans[1]
    result = bt("show", planned[:6], "--json")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["hash"] == planned
    assert body["name"] == "micro"
    assert body["meta"]["overrides"] == ["train.lr=1e-3"]
    assert body["config"]["stages"][0]["train"]["lr"] == 1e-3
    loaded = load_plan(Store(store), planned)
    assert [s["hash"] for s in body["steps"]] == [s.hash for s in loaded.steps]
    assert {s["status"]["action"] for s in body["steps"]} == {"will run"}


def test_bt_ls(bt: BtRunner, two_plans: tuple[str, str]) -> None:
    result = bt("ls")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["plan", "name", "created", "steps", "status"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {h[:12] for h in two_plans}
    assert all(row[1] == "micro" and row[-2:] == ["not", "built"] for row in rows.values())


def test_ls_json_and_empty_store(
    tmp_path: Path, two_plans: tuple[str, str], store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--store", str(store), "ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(row["hash"] for row in rows) == sorted(two_plans)
    assert {row["steps"] for row in rows} == {4}
    assert main(["--store", str(tmp_path / "empty"), "ls"]) == 0
    assert "no plans in this store" in capsys.readouterr().out


# -- plan references that name no plan, or several ------------------------------------------------


@pytest.fixture
def lookalikes(store: Path) -> Store:
    """A store with two plans whose hashes share the prefix abcd."""
    plans = store / "plans"
    plans.mkdir(parents=True)
    for tail in ("1" * 60, "2" * 60):
        (plans / f"abcd{tail}.json").write_text("{}")
    return Store(store)


def test_ambiguous_prefix(bt: BtRunner, lookalikes: Store) -> None:
    result = bt("show", "abcd")
    assert result.returncode == ExitCode.USAGE == 2
    assert result.stderr.strip() == (
        "bt show: plan prefix abcd is ambiguous (abcd11111111, abcd22222222); give more digits"
    )
    assert "Traceback" not in result.stderr


def test_unknown_prefix(bt: BtRunner, lookalikes: Store) -> None:
    result = bt("show", "ffff")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"bt show: no plan ffff in the store {lookalikes.root}; compile one with: bt plan PRESET"
    )


@pytest.mark.parametrize("ref", ["abc", "xyz1234", "", "../../etc/passwd"])
def test_malformed_references(ref: str, lookalikes: Store, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["show", ref], ["diff", ref, "abcd1111"], ["show", ref, "--json"]):
        assert main(["--store", str(lookalikes.root), *command]) == ExitCode.USAGE
        said = capsys.readouterr().err
        if command[0] == "diff" and os.sep in ref:  # diff, as run, takes a path for a preset
            assert "1 problem in the preset; nothing was run" in said
        else:
            assert "is not a plan hash or a prefix of at least 4 hex digits" in said


def test_diff_with_unknown_plan(
    two_plans: tuple[str, str], store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--store", str(store), "diff", two_plans[0], "0000"]) == ExitCode.USAGE
    assert "no plan 0000" in capsys.readouterr().err


# -- garbled presets through the real command line ------------------------------------------------

GARBLED = {
    "random-bytes": bytes(random.Random(0).randrange(256) for _ in range(300)),
    "toml-ish": b"[model\ndim = = 64\n[[stages]]\nname = \n",
    "wrong-everything": (
        b'stages = [1, {x = 2}]\nmodel = { dim = "wide", n_heads = 1979-05-27 }\n'
        b"[train]\nlr = nan\nsteps = inf\nbetas = [[0.9], {}]\n"
    ),
    "limits": b"[train]\nsteps = 1" + b"0" * 30 + b"\n[model]\ndim = " + b"[" * 600 + b"]" * 600 + b"\n",
}


@pytest.mark.parametrize("case", list(GARBLED))
def test_garbled_presets_exit_2_without_a_traceback(tmp_path: Path, bt: BtRunner, case: str) -> None:
    (tmp_path / "garbled.toml").write_bytes(GARBLED[case])
    result = bt("plan", "garbled.toml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    problems = result.stderr.splitlines()[:-1]
    assert problems and all(line.startswith("garbled.toml") for line in problems), problems


def test_bt_version(bt: BtRunner) -> None:
    from buildtrain import __version__

    result = bt("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"bt (buildtrain) {__version__}"


def test_a_folder_in_data_files_gets_a_hint_to_use_a_glob(tmp_path: Path, bt: BtRunner) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text\n")
    preset = tmp_path / "folder.toml"
    preset.write_text(f'extends = "{MICRO}"\n[data]\nsource = "files"\nfiles = ["corpus"]\n')
    result = bt("plan", str(preset))
    assert result.returncode == ExitCode.USAGE
    assert "matches no file; it is a folder: give a glob such as '" in result.stderr
    assert "corpus/*.txt'" in result.stderr and "Traceback" not in result.stderr


def test_more_threads_than_cores_warns(micro_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import os
    import shutil

    from conftest import run_bt

    store = tmp_path / ".bt"
    shutil.copytree(micro_built[0], store)
    many = (os.cpu_count() or 1) + 1
    result = run_bt("run", micro_built[1], "--threads", str(many), "--progress", "off", store=store)
    assert result.returncode == 0, result.stderr
    assert (
        f"bt run: warning: --threads {many} is more than this machine's {os.cpu_count()} cores"
        in result.stderr
    )
    quiet = run_bt("run", micro_built[1], "--threads", "1", "--progress", "off", store=store)
    assert "warning" not in quiet.stderr


def test_planning_into_a_folder_that_is_not_a_store_writes_nothing_there(tmp_path: Path) -> None:
    """`--store ~` is one typo away: the plan is refused before anything is written there, the
    stat cache of the data files included; a new folder becomes a store with its marker."""
    from conftest import REPO, run_bt

    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    (home / "letter.txt").write_text("mine")
    refused = run_bt("plan", str(REPO / "examples" / "own_text.toml"), store=home)
    assert refused.returncode == ExitCode.USAGE, refused.stderr
    assert f"{home} is not a buildtrain store" in refused.stderr
    assert sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == ["letter.txt", "tmp"]
    fresh = tmp_path / "fresh"
    assert run_bt("plan", str(REPO / "examples" / "own_text.toml"), store=fresh).returncode == 0
    assert Store(fresh).identity() == "marked"


def test_a_deleted_working_folder_is_named(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    script = 'cd "$1" && rmdir "$1" && exec "$2" -m buildtrain plan "$3"'
    argv = ["sh", "-c", script, "sh", str(gone), sys.executable, str(MICRO)]
    env = {**os.environ, "BT_STORE": str(tmp_path / ".bt")}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("bt ")]
    assert lines == [
        f"bt plan: the working folder {gone} no longer exists (deleted or moved); "
        "cd to a folder that exists and run again"
    ], done.stderr
