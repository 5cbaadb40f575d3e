"""Forgeries on the team cache (issue 45, R1 and R2), made as an attacker with write access to a
remote makes them: honest outputs pushed, then bytes changed, blobs uploaded, and manifests,
checkpoints and evaluation entries sealed again with the library's own (unkeyed) digests.

A pull trusts nothing it can recompute: an output whose declared digests its files do not give
is refused at pull and by `bt fsck`; an evaluation entry that is not what its step's result
records is never pulled; a checkpoint whose tensors are not the state its trace records is
never resumed from; and a build that resumed from a pulled checkpoint never attests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import MICRO, Reference, plan_hash, run_bt, step_digests

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.plan.stored import load_plan
from buildtrain.sources import durable
from buildtrain.store import evals, objects
from buildtrain.store.remote import keyring, keys, signing
from buildtrain.store.remote.attest import Attestation, attest, attestations
from buildtrain.store.remote.remote import Remote
from buildtrain.store.store import Store


def bt_at(store: Path, *args: str) -> object:
    store.parent.mkdir(parents=True, exist_ok=True)
    return run_bt(*args, store=store)


@pytest.fixture
def url(tmp_path: Path) -> str:
    (tmp_path / "remote").mkdir()
    return f"file://{tmp_path / 'remote'}"


def steps_of(micro_built: Reference) -> dict[str, str]:
    store, plan, _ = micro_built
    return {step.label: step.hash for step in load_plan(Store(store), plan).steps}


def flip(raw: bytes) -> bytes:
    """Four bytes changed near the end (inside the last tensor's data)."""
    changed = bytearray(raw)
    for at in range(len(raw) - 8, len(raw) - 4):
        changed[at] ^= 0x5A
    return bytes(changed)


def seal_manifest(body: dict) -> bytes:
    """What `objects.seal` writes: the body under its own (unkeyed) digest."""
    body = {k: v for k, v in body.items() if k != "self"}
    return canonical_bytes({**body, "self": digest("manifest", body)})


def forge_output(url: str, step_hash: str, edits: dict[str, bytes]) -> None:
    """Replace files of a pushed output (`edits`: path -> new bytes) and seal its manifest again
    with the honest declared digests and the new files' blake3."""
    backend = Remote.open(url).backend
    body = json.loads(backend.get(keys.step(step_hash)))
    for name, raw in edits.items():
        blob = objects.blake3.blake3(raw).hexdigest()
        backend.put(keys.blob(blob), raw)
        body["files"][name] = {"blake3": blob, "size": len(raw)}
    backend.delete(keys.step(step_hash))
    backend.put(keys.step(step_hash), seal_manifest(body))


def blob_of(url: str, step_hash: str, name: str) -> bytes:
    backend = Remote.open(url).backend
    body = json.loads(backend.get(keys.step(step_hash)))
    return backend.get(keys.blob(body["files"][name]["blake3"]))


def second_attestation(url: str, step_hash: str, digests: dict[str, str]) -> None:
    """A second build agreeing with the honest declared digests and the files now on the remote,
    signed by a key the reader trusts: a colleague who forged, or was fooled. Two trusted signers
    then agree, so only the re-derived digests stand between the forgery and a pull."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    public = signing.raw_public(key)
    if signing.key_id(public) not in keyring.load_keyring().names:
        keyring.trust(public, f"mallory-{signing.key_id(public)[:8]}")
    backend = Remote.open(url).backend
    files = {
        name: entry["blake3"]
        for name, entry in json.loads(backend.get(keys.step(step_hash)))["files"].items()
    }
    record = Attestation(
        step=step_hash,
        plan="0" * 64,
        builder=signing.key_id(public),
        machine="mallory",
        toolchain={},
        built_at="2026-01-01T00:00:00",
        inputs={},
        digests=digests,
        files=files,
    )
    attest(backend, record, key)


def test_forged_export_weights_are_refused_at_pull(tmp_path: Path, url: str, micro_built: Reference) -> None:
    store, plan, honest = micro_built
    assert bt_at(store, "push", plan, "--remote", url).returncode == 0
    export = steps_of(micro_built)["export"]
    edits = {name: flip(blob_of(url, export, name)) for name in ("model.safetensors", "hf/model.safetensors")}
    forge_output(url, export, edits)
    for label, step_hash in steps_of(micro_built).items():  # two "builds" agree on every step
        second_attestation(url, step_hash, honest[label])
    b = tmp_path / "b" / ".bt"
    # The honest builder signed the honest files: with a forger trusted too, one agrees, one not.
    counted = bt_at(b, "pull", plan, "--remote", url, "--min-attestations", "2")
    assert counted.returncode == 4 and "1 disagree" in counted.stderr, counted.stderr
    # Asking for no signatures at all, the bytes alone refuse it: the weights do not follow.
    pull = bt_at(b, "pull", plan, "--remote", url)
    assert pull.returncode == 5, pull.stderr
    assert "export" in pull.stderr and "model.safetensors: gives weights" in pull.stderr, pull.stderr
    assert not Store(b).outputs.has(export)  # never counted, never exported
    assert bt_at(b, "export", plan, str(tmp_path / "shipped")).returncode != 0
    assert not (tmp_path / "shipped" / "model.safetensors").exists()
    assert bt_at(b, "fsck").returncode == 0  # what was kept is intact; the forgery is in quarantine/


def test_a_forged_package_file_is_named(tmp_path: Path, url: str, micro_built: Reference) -> None:
    """hf/ alone changed: the weights digest still holds, the package digest names the file."""
    store, plan, _ = micro_built
    assert bt_at(store, "push", plan, "--remote", url).returncode == 0
    export = steps_of(micro_built)["export"]
    forge_output(url, export, {"hf/model.safetensors": flip(blob_of(url, export, "hf/model.safetensors"))})
    pull = bt_at(tmp_path / "b" / ".bt", "pull", plan, "--remote", url)
    assert pull.returncode == 5, pull.stderr
    assert "hf/model.safetensors: gives package" in pull.stderr, pull.stderr


@pytest.mark.parametrize("checkpoint", ["step-000012", "step-000008"])
def test_forged_train_checkpoints_are_refused_at_pull(
    tmp_path: Path, url: str, micro_built: Reference, checkpoint: str
) -> None:
    """The final checkpoint (its weights are the output's) or a kept earlier one (verify resumes
    from it, curves score it): its tensors must be the state the trace records."""
    store, plan, _ = micro_built
    assert bt_at(store, "push", plan, "--remote", url).returncode == 0
    train = steps_of(micro_built)["train:main"]
    name = f"checkpoints/{checkpoint}/model.safetensors"
    forge_output(url, train, {name: flip(blob_of(url, train, name))})
    b = tmp_path / "b" / ".bt"
    pull = bt_at(b, "pull", plan, "--remote", url)
    assert pull.returncode == 5, pull.stderr
    assert f"train:main: remote {url}: step {train[:12]} refused: checkpoints/{checkpoint}" in pull.stderr
    assert not Store(b).outputs.has(train)


def test_forged_tokens_are_refused_at_pull(tmp_path: Path, url: str, micro_built: Reference) -> None:
    """A data step's shard changed: every step trained on it would learn from other tokens."""
    store, plan, _ = micro_built
    assert bt_at(store, "push", plan, "--remote", url).returncode == 0
    data = steps_of(micro_built)["data:main"]
    forge_output(url, data, {"train-00000.bin": flip(blob_of(url, data, "train-00000.bin"))})
    b = tmp_path / "b" / ".bt"
    pull = bt_at(b, "pull", plan, "--remote", url)
    assert pull.returncode == 5, pull.stderr
    assert "data:main" in pull.stderr and "train-00000.bin: gives train-00000.bin" in pull.stderr
    assert not Store(b).outputs.has(data)


def test_a_forged_ngram_filter_is_refused_at_pull(tmp_path: Path, url: str) -> None:
    """The contamination check's filter (an ngrams step's) emptied: every question would read as clean."""
    from test_suites import suite_preset

    store = tmp_path / "a" / ".bt"
    preset = suite_preset(tmp_path, '{ name = "arith", file = "arithmetic.jsonl" }')
    plan = plan_hash(bt_at(store, "plan", str(preset)))
    assert bt_at(store, "run", plan).returncode == 0
    assert bt_at(store, "push", plan, "--remote", url).returncode == 0
    (recorded,) = [s.hash for s in load_plan(Store(store), plan).steps if s.kind == "ngrams"]
    honest = blob_of(url, recorded, "ngrams.bloom")
    header = 8 * 4 + 16 * int.from_bytes(honest[24:32], "little")  # format, n, hashes, count, sizes
    forge_output(url, recorded, {"ngrams.bloom": honest[:header] + bytes(len(honest) - header)})
    b = tmp_path / "b" / ".bt"
    pull = bt_at(b, "pull", plan, "--remote", url)
    assert pull.returncode == 5, pull.stderr
    assert "ngrams:main" in pull.stderr and "ngrams.bloom: gives ngrams.bloom" in pull.stderr, pull.stderr
    assert not Store(b).outputs.has(recorded)


def plant_entry(url: str, forged: dict) -> str:
    """A sealed evaluation cache entry holding the forged result, put on the remote; its key."""
    key = evals.key_of(forged["identity"])
    entry = {"identity": forged["identity"], "result": forged["result"]}
    Remote.open(url).backend.put(keys.evaluation(key), durable.framed(evals.seal_entry(key, entry)))
    return key


def forged_eval(body: dict) -> dict:
    """The held-out result with better numbers (every float scaled), its identity kept."""
    result = {k: (v * 0.5 if isinstance(v, float) else v) for k, v in body["result"].items()}
    assert result != body["result"]
    return {**body, "result": result}


def test_a_forged_evaluation_is_refused_and_never_reused(
    tmp_path: Path, url: str, micro_built: Reference
) -> None:
    store, plan, _ = micro_built
    assert bt_at(store, "push", plan, "--remote", url).returncode == 0
    hashes = steps_of(micro_built)
    honest = json.loads(blob_of(url, hashes["eval"], "eval.json"))
    forged = forged_eval(honest)
    forge_output(url, hashes["eval"], {"eval.json": canonical_bytes(forged)})
    key = plant_entry(url, forged)
    b = tmp_path / "b" / ".bt"
    pull = bt_at(b, "pull", plan, "--remote", url)
    assert pull.returncode == 5, pull.stderr
    assert "eval.json: gives eval" in pull.stderr, pull.stderr
    assert not Store(b).outputs.has(hashes["eval"]) and not Store(b).results.eval_path(key).exists()


def test_a_forged_evaluation_entry_beside_an_honest_output_is_not_pulled(
    tmp_path: Path, url: str, micro_built: Reference
) -> None:
    """The entry alone forged: the output is honest, the entry (reused by any other plan that
    evaluates the same weights) is not what the output records, so it stays on the remote."""
    store, plan, _ = micro_built
    assert bt_at(store, "push", plan, "--remote", url).returncode == 0
    hashes = steps_of(micro_built)
    honest = json.loads(blob_of(url, hashes["eval"], "eval.json"))
    key = plant_entry(url, forged_eval(honest))
    b = tmp_path / "b" / ".bt"
    pull = bt_at(b, "pull", plan, "--remote", url)
    assert "forged" in pull.stderr, pull.stderr
    assert Store(b).outputs.has(hashes["eval"]) and not Store(b).results.eval_path(key).exists()


def test_fsck_re_derives_declared_digests(tmp_path: Path, micro_built: Reference) -> None:
    """A forged output already in a store (pulled by an older bt): every blake3 holds, fsck
    still names it, by the file its declared digests do not follow from."""
    source, _, _ = micro_built
    store = tmp_path / ".bt"
    shutil.copytree(source, store, symlinks=True)
    export = Store(store).outputs.path(steps_of(micro_built)["export"])
    declared = objects.sealed_digests(export)
    for name in ("model.safetensors", "hf/model.safetensors"):
        path = export / name
        path.chmod(0o644)
        raw = flip(path.read_bytes())
        path.unlink()
        path.write_bytes(raw)
    (export / objects.MANIFEST).unlink()
    objects.seal(export, declared)
    found = bt_at(store, "fsck")
    assert found.returncode != 0, found.stderr
    assert "model.safetensors: gives weights" in found.stdout + found.stderr


# -- checkpoints (R2) -------------------------------------------------------------------------------


def push_first_checkpoint(micro_built: Reference, url: str) -> tuple[str, str]:
    """The honest checkpoint of update 4 (its trace segment the first: it links to none) pushed
    for the train step, as a builder's run pushes it; (train step hash, checkpoint name)."""
    store, _, _ = micro_built
    train = steps_of(micro_built)["train:main"]
    folder = Store(store).outputs.path(train) / "checkpoints" / "step-000004"
    Remote.open(url).push_checkpoint(train, folder)
    return train, folder.name


def forge_checkpoint(url: str, train: str, name: str) -> None:
    """Change 4 bytes of its weights and seal the manifest and the remote seal again."""
    backend = Remote.open(url).backend
    body = json.loads(backend.get(keys.checkpoint(train, name)))
    body.pop("seal")
    manifest = body["manifest"]
    entry = manifest["files"]["model.safetensors"]
    raw = flip(backend.get(keys.blob(entry["blake3"])))
    blob = objects.blake3.blake3(raw).hexdigest()
    backend.put(keys.blob(blob), raw)
    manifest["files"]["model.safetensors"] = {"blake3": blob, "size": len(raw)}
    body["manifest"] = json.loads(seal_manifest(manifest))
    backend.delete(keys.checkpoint(train, name))
    backend.put(
        keys.checkpoint(train, name), canonical_bytes({**body, "seal": digest("remote-checkpoint", body)})
    )


def test_a_forged_checkpoint_is_never_resumed_from(tmp_path: Path, url: str, micro_built: Reference) -> None:
    _, plan, honest = micro_built
    train, name = push_first_checkpoint(micro_built, url)
    forge_checkpoint(url, train, name)
    b = tmp_path / "b" / ".bt"
    assert plan_hash(bt_at(b, "plan", str(MICRO))) == plan
    run = bt_at(b, "run", plan, "--remote", url)
    assert run.returncode == 0, run.stderr
    assert "resuming from" not in run.stderr
    assert "its tensors give state" in run.stderr and name in run.stderr, run.stderr
    assert step_digests(b, plan) == honest  # built from scratch: the honest bits


def test_a_forged_checkpoint_in_the_work_folder_is_skipped_at_resume(
    tmp_path: Path, micro_built: Reference
) -> None:
    """Wherever it came from (an older bt pulled it): resume checks its tensors against its trace."""
    source, plan, honest = micro_built
    train = steps_of(micro_built)["train:main"]
    b = tmp_path / "b" / ".bt"
    shutil.copytree(source, b, symlinks=True)
    shutil.rmtree(Store(b).outputs.path(train).parent / train)
    for later in ("train:main", "eval", "export"):
        shutil.rmtree(Store(b).outputs.path(steps_of(micro_built)[later]), ignore_errors=True)
    folder = Store(b).outputs.checkpoints_dir(train) / "step-000004"
    folder.parent.mkdir(parents=True)
    shutil.copytree(Store(source).outputs.path(train) / "checkpoints" / "step-000004", folder)
    weights = folder / "model.safetensors"
    raw = flip(weights.read_bytes())
    weights.chmod(0o644)
    weights.unlink()
    weights.write_bytes(raw)
    (folder / objects.MANIFEST).unlink()
    objects.seal(folder)
    fsck = bt_at(b, "fsck")
    assert fsck.returncode != 0 and "its tensors give state" in fsck.stdout + fsck.stderr
    run = bt_at(b, "run", plan)
    assert run.returncode == 0, run.stderr
    assert step_digests(b, plan) == honest


def test_a_build_resumed_from_a_pulled_checkpoint_never_attests(
    tmp_path: Path, url: str, micro_built: Reference
) -> None:
    _, plan, honest = micro_built
    train, _ = push_first_checkpoint(micro_built, url)
    b = tmp_path / "b" / ".bt"
    assert plan_hash(bt_at(b, "plan", str(MICRO))) == plan
    run = bt_at(b, "run", plan, "--remote", url)
    assert run.returncode == 0, run.stderr
    assert "resuming from step-000004 pulled from" in run.stderr
    assert step_digests(b, plan) == honest
    backend = Remote.open(url).backend
    assert Remote.open(url).has_output(train)  # pushed (its bits are good)...
    everyone = keyring.load_keyring()
    assert attestations(backend, train, everyone) == []  # ...but not attested: not an independent build
    data = steps_of(micro_built)["data:main"]
    assert len(attestations(backend, data, everyone)) == 1  # what it built alone, it attests


def test_every_kind_derives_what_it_declared_for_a_bpe_plan(tmp_path: Path) -> None:
    """Honest outputs of a plan with a tokenizer step: each kind's derivation agrees with every
    digest it declared (nothing honest is refused), and fsck finds the store whole."""
    from test_tokenizer import bpe_preset

    from buildtrain.kinds import kind_of
    from buildtrain.kinds.kind import stored_problems

    store = tmp_path / ".bt"
    planned = plan_hash(bt_at(store, "plan", str(bpe_preset(tmp_path))))
    assert bt_at(store, "run", planned).returncode == 0
    steps = load_plan(Store(store), planned).steps
    assert "tokenizer" in {step.kind for step in steps}
    for step in steps:
        kind = kind_of(step.kind)
        output = Store(store).outputs.path(step.hash)
        assert kind.derive_digests(output), step.label  # every kind here derives something
        assert stored_problems(kind, step.hash, output, step.config) == [], step.label
    assert bt_at(store, "fsck").returncode == 0
