"""Pre-flight checks that need the machine: data presence, the memory estimate, the device.

(The arithmetic of the memory estimate is tested in test_shape.py; that `parameter_count` matches
the real model, beside the model, in test_model.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import MICRO, BtRunner

from buildtrain.config import preflight as preflight_module
from buildtrain.config.loader import load_preset
from buildtrain.config.preflight import cuda_available, expand_sources, machine_memory, preflight
from buildtrain.config.problems import display
from buildtrain.config.schema import TrainConfig
from buildtrain.config.shape import memory_estimate
from buildtrain.errors import ConfigError, ExitCode
from buildtrain.plan.planner import plan_preset
from buildtrain.store.store import Store

HUGE_MODEL = "[model]\ndim = 65536\nn_layers = 4096\nn_heads = 64\nn_kv_heads = 8\nffn_hidden = 262144\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_valid_preset_passes(tmp_path: Path) -> None:
    write(tmp_path / "corpus" / "a.txt", "hello")
    preset = write(tmp_path / "p.toml", '[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\n')
    sources, problems = preflight(load_preset(preset))
    assert problems == []
    assert sources == {"main": [tmp_path / "corpus" / "a.txt"]}


def test_globs_are_relative_to_the_preset_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "presets" / "corpus" / "a.txt", "hello")
    preset = write(tmp_path / "presets" / "p.toml", '[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\n')
    monkeypatch.chdir(tmp_path)
    sources, problems = preflight(load_preset("presets/p.toml"))
    assert problems == [] and [p.name for p in sources["main"]] == ["a.txt"]
    assert preset.is_file()


def test_glob_that_matches_no_file(tmp_path: Path) -> None:
    write(tmp_path / "corpus" / "a.txt", "hello")
    preset = write(
        tmp_path / "p.toml",
        '[data]\nsource = "files"\nfiles = ["corpus/*.txt", "missing/*.txt", "gone.txt"]\n',
    )
    _, problems = preflight(load_preset(preset))
    label = display(preset)
    assert problems == [
        f"{label}: data.files: '{tmp_path / 'missing' / '*.txt'}' matches no file",
        f"{label}: data.files: '{tmp_path / 'gone.txt'}' matches no file",
    ]


def test_a_directory_is_not_a_data_file(tmp_path: Path) -> None:
    (tmp_path / "corpus" / "sub.txt").mkdir(parents=True)
    files, empty, _ = expand_sources((str(tmp_path / "corpus" / "*.txt"),))
    assert files == [] and empty == [str(tmp_path / "corpus" / "*.txt")]


def test_a_file_matched_twice_is_read_once(tmp_path: Path) -> None:
    write(tmp_path / "corpus" / "a.txt", "hello")
    files, empty, _ = expand_sources((str(tmp_path / "corpus" / "*.txt"), str(tmp_path / "corpus" / "a.txt")))
    assert len(files) == 1 and empty == []


def test_missing_stage_data_is_reported_at_the_stage_key(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "")
    preset = write(
        tmp_path / "p.toml",
        '[[stages]]\nname = "pre"\n[[stages]]\nname = "ft"\ndata = { source = "files", files = ["nothing/*"] }\n',
    )
    _, problems = preflight(load_preset(preset))
    assert problems == [
        f"{display(preset)}: stages[1].data.files: '{tmp_path / 'nothing' / '*'}' matches no file"
    ]


def test_missing_data_set_by_a_base_preset_names_the_base(tmp_path: Path) -> None:
    base = write(tmp_path / "common" / "base.toml", '[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\n')
    preset = write(tmp_path / "p.toml", 'extends = "common/base.toml"\n')
    _, problems = preflight(load_preset(preset))
    assert problems == [
        f"{display(base)}: data.files: '{tmp_path / 'common' / 'corpus' / '*.txt'}' matches no file"
    ]


def test_memory_estimate_larger_than_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preset = write(tmp_path / "p.toml", "[model]\ndim = 256\nn_layers = 4\n")
    loaded = load_preset(preset)
    needed = memory_estimate(loaded.config.model, loaded.config.stages[0].train)
    monkeypatch.setattr(preflight_module, "machine_memory", lambda: needed - 1)
    _, problems = preflight(loaded)
    assert len(problems) == 1
    assert problems[0].startswith(f"{display(preset)}: model: training stage 'main' needs about ")
    assert "reduce model.dim, model.n_layers, train.micro_batch_size or train.seq_len" in problems[0]
    monkeypatch.setattr(preflight_module, "machine_memory", lambda: needed)
    assert preflight(loaded)[1] == []


def test_the_ranks_of_a_cpu_run_share_the_machine_and_sharding_splits_their_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four unsharded ranks need four whole states; sharded, each holds a quarter of it, and the
    refusal names the parts and the settings that shrink them."""
    body = "[model]\ndim = 256\nn_layers = 4\n[train]\nbatch_size = 16\nmicro_batch_size = 4\n"
    plain = load_preset(write(tmp_path / "plain.toml", body))
    sharded = load_preset(write(tmp_path / "sharded.toml", body + 'sharding = "fsdp"\n'))
    model, train = plain.config.model, plain.config.stages[0].train
    one = memory_estimate(model, train)
    monkeypatch.setattr(preflight_module, "machine_memory", lambda: 2 * one)
    assert preflight(plain, world_size=1)[1] == []
    (problem,) = preflight(plain, world_size=4)[1]
    assert "per rank x 4 ranks" in problem and "weights " in problem and "AdamW state " in problem
    assert 'set train.sharding = "fsdp"' in problem and "train.activation_checkpointing = true" in problem
    quarter = memory_estimate(model, sharded.config.stages[0].train, world_size=4)
    assert quarter < one / 2
    monkeypatch.setattr(preflight_module, "machine_memory", lambda: 4 * quarter)
    assert preflight(sharded, world_size=4)[1] == []


def test_machine_memory_is_known() -> None:
    assert machine_memory() > 0


@pytest.mark.skipif(cuda_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_device(tmp_path: Path) -> None:
    preset = write(tmp_path / "p.toml", '[numerics]\ndevice = "cuda"\n')
    _, problems = preflight(load_preset(preset))
    assert problems == [
        f"{display(preset)}: numerics.device: is 'cuda' but no CUDA device is visible on this machine; "
        'use device = "cpu"'
    ]


def test_every_machine_problem_is_reported_and_planning_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preset = write(
        tmp_path / "p.toml",
        '[data]\nsource = "files"\nfiles = ["a/*.txt"]\n'
        '[[stages]]\nname = "one"\n[[stages]]\nname = "two"\ndata = { files = ["b/*.txt"] }\n',
    )
    monkeypatch.setattr(preflight_module, "machine_memory", lambda: 1)
    store = Store(tmp_path / ".bt")
    with pytest.raises(ConfigError) as caught:
        plan_preset(preset, [], store)
    assert caught.value.exit_code == ExitCode.USAGE
    keys = [p.split(": ")[1] for p in caught.value.problems]
    assert keys == ["data.files", "stages[1].data.files", "model"]
    assert not store.plans.hashes()  # nothing was stored


# -- through the real command line ----------------------------------------------------------------


def test_bt_plan_refuses_missing_data(tmp_path: Path, bt: BtRunner) -> None:
    write(tmp_path / "p.toml", '[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\n')
    result = bt("plan", "p.toml", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert f"p.toml: data.files: '{tmp_path / 'corpus' / '*.txt'}' matches no file" in result.stderr
    assert "Traceback" not in result.stderr


def test_bt_plan_refuses_a_model_larger_than_the_machine(tmp_path: Path, bt: BtRunner) -> None:
    write(tmp_path / "p.toml", HUGE_MODEL)
    assert (
        memory_estimate(load_preset(tmp_path / "p.toml").config.model, TrainConfig()) > 64 * machine_memory()
    )
    result = bt("plan", "p.toml", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "p.toml: model: training stage 'main' needs about " in result.stderr
    assert "but this machine has" in result.stderr
    assert "Traceback" not in result.stderr


# -- what a path names, and what a tokenizer file declares ---------------------------------------


def special_file(path: Path, kind: str) -> str:
    """Make `path` a FIFO or a link to /dev/zero; the words a refusal uses for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO"
    path.symlink_to("/dev/zero")
    return "a device"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link"])
def test_bt_plan_refuses_a_fifo_or_device_among_the_data_files(
    tmp_path: Path, bt: BtRunner, kind: str
) -> None:
    write(tmp_path / "corpus" / "a.txt", "hello")
    said = special_file(tmp_path / "corpus" / "b.txt", kind)
    write(tmp_path / "p.toml", '[data]\nsource = "files"\nfiles = ["corpus/*.txt"]\n')
    result = bt("plan", "p.toml", cwd=tmp_path, timeout=60)  # a read of either would never end
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[0] == (
        f"p.toml: data.files: {tmp_path / 'corpus' / 'b.txt'} is {said}, not a regular file; "
        f"remove it or narrow '{tmp_path / 'corpus' / '*.txt'}'"
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link"])
def test_bt_plan_refuses_a_fifo_or_device_as_the_tokenizer_file(
    tmp_path: Path, bt: BtRunner, kind: str
) -> None:
    said = special_file(tmp_path / "tok.json", kind)
    write(tmp_path / "p.toml", 'data = { tokenizer = { file = "tok.json" } }\n')
    result = bt("plan", "p.toml", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[0] == (
        f"p.toml: data.tokenizer.file: cannot read {tmp_path / 'tok.json'}: is {said}, not a regular file; "
        "give a tokenizer.json"
    )


def sparse_tokenizer(path: Path, largest: int) -> Path:
    """A tokenizer.json of 257 tokens whose last id is `largest` (the tokenizers library loads it)."""
    vocab = {chr(0x100 + i): i for i in range(256)} | {"<|endoftext|>": largest}
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []}}))
    return path


def test_a_tokenizer_id_of_50_million_is_refused_with_the_file_and_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sized by the vocabulary the file really declares, not the byte tokenizer's 257: the train
    step would otherwise take the machine's memory and be killed."""
    sparse_tokenizer(tmp_path / "tok.json", 50_000_000)
    preset = write(
        tmp_path / "p.toml", f'extends = "{MICRO}"\ndata = {{ tokenizer = {{ file = "tok.json" }} }}\n'
    )
    monkeypatch.setattr(preflight_module, "machine_memory", lambda: 24 << 30)  # the machine of the report
    _, problems = preflight(load_preset(preset))
    assert len(problems) == 1
    assert problems[0].startswith(
        f"{display(preset)}: data.tokenizer.file: {tmp_path / 'tok.json'} declares a vocabulary of 50,000,001 ids "
        "(its largest id is 50,000,000; it lists 257 tokens), so training stage 'main' needs about "
    )
    assert problems[0].endswith("but this machine has 24.0 GiB; number its ids from 0 without gaps")
    sparse_tokenizer(tmp_path / "tok.json", 256)
    assert preflight(load_preset(preset))[1] == []


def test_bt_plan_refuses_a_tokenizer_vocabulary_larger_than_the_machine(tmp_path: Path, bt: BtRunner) -> None:
    sparse_tokenizer(tmp_path / "tok.json", 2**31)  # 2**31 rows of 32 floats: more than any machine
    write(tmp_path / "p.toml", f'extends = "{MICRO}"\ndata = {{ tokenizer = {{ file = "tok.json" }} }}\n')
    result = bt("plan", "p.toml", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "p.toml: data.tokenizer.file: " in result.stderr
    assert "declares a vocabulary of 2,147,483,649 ids" in result.stderr and "Traceback" not in result.stderr


def test_a_tokenizer_path_with_a_nul_byte_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    preset = write(tmp_path / "p.toml", 'data.tokenizer.file = "a\\u0000b"\n')
    _, problems = preflight(load_preset(preset))
    assert problems == [
        f"{display(preset)}: data.tokenizer.file: '{tmp_path}/a\\x00b' is not a path a file can have "
        "(a NUL byte); give a tokenizer.json"
    ]
