"""Attestations: signed statements that a builder built a step and got these outputs.

Each build adds a DSSE envelope (`signing.py`) around an in-toto Statement v1 whose subjects are
the output's files with their blake3 (a free-form algorithm name, which in-toto's DigestSet
allows) and whose predicate, in the shape of SLSA provenance v1, names the plan, the step, its
inputs' digests, the toolchain, the output's logical digests and the builder: the id of the key
that signs it. The envelope is an object named by its own digest
(`attestations/<step>/<digest>.json`), written create-only.

Counting never counts records: it counts distinct keys of the reader's keyring whose signature
verifies over a statement that names exactly this step and these outputs, and that names that
key as its builder. Everything else counts 0 and is reported by kind: unsigned (including the
unsigned records of format 1 that older buildtrains wrote), untrusted key, forged (a signature
that names a trusted key and does not verify, or a signer that is not the builder named),
damaged, or for another step. Two trusted builders whose statements differ are non-determinism
(`disagreements`).
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cattrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.store.remote import keys, signing
from buildtrain.store.remote.backend import AlreadyExists, Backend, ObjectMissing
from buildtrain.store.remote.keyring import Keyring

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://buildtrain.dev/attestation/step-build/v1"
BUILD_TYPE = "https://buildtrain.dev/step/v1"
BUILDER_ID = "urn:buildtrain:builder:ed25519:"  # + the key id
ALGORITHM = "blake3"
_converter = cattrs.Converter(forbid_extra_keys=True)


def _sorted(value: Mapping[str, str]) -> dict[str, str]:
    return dict(sorted(value.items()))


@attrs.frozen(kw_only=True)
class Attestation:
    """One build of one step, as its builder states it (and signs it)."""

    step: str = attrs.field(validator=attrs.validators.matches_re(keys.HASH))
    plan: str = attrs.field(validator=attrs.validators.matches_re(keys.HASH))
    """The plan the step was built for (a step may belong to many; counting binds the step)."""
    builder: str = attrs.field(validator=attrs.validators.matches_re(keys.HASH))
    """The id of the key that signs this statement."""
    machine: str = attrs.field(validator=attrs.validators.min_len(1))
    """A host name or any label: informative only, never what is counted."""
    toolchain: dict[str, Any]
    """The step's toolchain fingerprint (torch build, CPU or GPU, numerics)."""
    built_at: str = attrs.field(validator=attrs.validators.min_len(1))
    """UTC time, ISO 8601."""
    inputs: dict[str, str] = attrs.field(converter=_sorted)
    """Each input's digest: an upstream step's hash, or the digest of a source's description."""
    digests: dict[str, str] = attrs.field(converter=_sorted)
    """The output's logical digests (its manifest's `digests`: weights, data, ...)."""
    files: dict[str, str] = attrs.field(converter=_sorted)
    """Every file of the output (its manifest's `files`) -> its blake3."""


def statement(record: Attestation) -> dict[str, Any]:
    """The in-toto Statement v1 of a record (SLSA-provenance-shaped predicate)."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {ALGORITHM: value}} for name, value in record.files.items()],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"plan": record.plan, "step": record.step},
                "internalParameters": {"toolchain": record.toolchain, "outputDigests": record.digests},
                "resolvedDependencies": [
                    {"name": name, "digest": {ALGORITHM: value}} for name, value in record.inputs.items()
                ],
            },
            "runDetails": {
                "builder": {"id": BUILDER_ID + record.builder, "machine": record.machine},
                "metadata": {"finishedOn": record.built_at},
            },
        },
    }


def record_of(body: Any) -> Attestation:
    """The record a statement states; ValueError unless it is exactly what `statement` writes."""
    try:
        build, run = body["predicate"]["buildDefinition"], body["predicate"]["runDetails"]
        fields = {
            **build["externalParameters"],
            "builder": run["builder"]["id"].removeprefix(BUILDER_ID),
            "machine": run["builder"]["machine"],
            "toolchain": build["internalParameters"]["toolchain"],
            "built_at": run["metadata"]["finishedOn"],
            "inputs": {d["name"]: d["digest"][ALGORITHM] for d in build["resolvedDependencies"]},
            "digests": build["internalParameters"]["outputDigests"],
            "files": {s["name"]: s["digest"][ALGORITHM] for s in body["subject"]},
        }
        record = _converter.structure(fields, Attestation)
    except (KeyError, TypeError, AttributeError, cattrs.BaseValidationError) as exc:
        raise ValueError(f"not a buildtrain step statement ({exc})") from None
    if canonical_bytes(statement(record)) != canonical_bytes(body):
        raise ValueError("not a buildtrain step statement (unknown or reordered fields)")
    return record


def attest(backend: Backend, record: Attestation, key: Ed25519PrivateKey) -> str:
    """Sign a record with this builder's key and add it; returns its object key."""
    if signing.key_id(signing.raw_public(key)) != record.builder:
        raise ValueError("an attestation is signed by the builder it names")
    body = signing.envelope(statement(record), key)
    name = keys.attestation(record.step, digest("remote-attestation", body))
    # Named by its digest: what is already there is this envelope, or damage a reader reports.
    with contextlib.suppress(AlreadyExists):
        backend.put(name, canonical_bytes(body), create_only=True)
    return name


@attrs.frozen(kw_only=True)
class Checked:
    """One object under a step's attestations, as the reader's keyring judges it."""

    key: str
    record: Attestation | None
    signer: str | None = None
    """The trusted key id whose signature verified and which the statement names as builder."""
    signer_name: str = ""
    problem: str | None = None
    """Why it counts 0: unsigned, untrusted key, forged, damaged, for another step."""


def attestations(backend: Backend, step: str, keyring: Keyring) -> list[Checked]:
    """Every object under the step's attestations, each checked against `keyring`."""
    found, folder = [], keys.attestations(step)
    for key in backend.list(folder):
        try:
            raw = backend.get(key)
        except ObjectMissing:
            continue  # removed while we listed
        found.append(_check(key, raw, keys.name_in(folder, key), step, keyring))
    return sorted(found, key=lambda c: (c.record.built_at if c.record else "", c.key))


def _check(key: str, raw: bytes, name: str | None, step: str, keyring: Keyring) -> Checked:
    try:
        body = json.loads(raw)
        if isinstance(body, dict) and body.get("format") == 1 and "record" in body:
            return Checked(key=key, record=None, problem="unsigned")  # written before signatures
        if name != digest("remote-attestation", body) or canonical_bytes(body) != raw:
            return Checked(key=key, record=None, problem="damaged")
        opened = signing.open_envelope(body, keyring.public)
        record = record_of(opened.statement)
    except ValueError:
        return Checked(key=key, record=None, problem="damaged")
    if record.step != step:
        return Checked(key=key, record=record, problem="for another step")
    if record.builder in opened.signers:
        return Checked(
            key=key, record=record, signer=record.builder, signer_name=keyring.name(record.builder)
        )
    if not opened.claimed:
        return Checked(key=key, record=record, problem="unsigned")
    named_trusted = (opened.claimed | {record.builder}) & set(keyring.public)
    return Checked(key=key, record=record, problem="forged" if named_trusted else "untrusted key")


@attrs.frozen(kw_only=True)
class Tally:
    """What the attestations of one step come to for one output."""

    agreeing: dict[str, str]
    """Trusted key id -> its keyring name, for each key that signed exactly these outputs."""
    disagreeing: dict[str, str]
    """Trusted keys that signed other outputs for this step (non-determinism)."""
    ignored: dict[str, int]
    """Why records count 0 -> how many."""
    problems: tuple[str, ...]
    """One line per ignored record, naming its object."""

    def __str__(self) -> str:
        text = builders(len(self.agreeing))
        if self.agreeing:
            text += f" ({', '.join(sorted(self.agreeing.values()))})"
        if self.disagreeing:
            text += f", {len(self.disagreeing)} disagree ({', '.join(sorted(self.disagreeing.values()))})"
        return text + (f"; {ignored_line(self.ignored)}" if self.ignored else "")


def builders(count: int) -> str:
    return f"{count} trusted builder{' agrees' if count == 1 else 's agree'}"


def ignored_line(ignored: Mapping[str, int]) -> str:
    """ "3 records ignored: 2 unsigned, 1 untrusted key" """
    total = sum(ignored.values())
    kinds = ", ".join(f"{count} {why}" for why, count in sorted(ignored.items()))
    return f"{total} record{'s' if total != 1 else ''} ignored: {kinds}"


def tally(
    checked: Sequence[Checked], digests: Mapping[str, str], files: Mapping[str, str] | None = None
) -> Tally:
    """Distinct trusted keys that signed exactly these output digests (and these files, when
    given): many records by one key count once; unsigned or untrusted ones count 0."""
    agreeing, disagreeing, ignored, problems = {}, {}, Counter[str](), []
    wanted, wanted_files = _sorted(digests), None if files is None else _sorted(files)
    for found in checked:
        if found.signer is None or found.record is None:
            ignored[str(found.problem)] += 1
            problems.append(f"{found.key}: {found.problem} attestation, not counted")
            continue
        same = found.record.digests == wanted and wanted_files in (None, found.record.files)
        (agreeing if same else disagreeing)[found.signer] = found.signer_name
    return Tally(agreeing=agreeing, disagreeing=disagreeing, ignored=dict(ignored), problems=tuple(problems))


@attrs.frozen(kw_only=True)
class Disagreement:
    """One output digest on which trusted builds of a step differ."""

    step: str
    name: str
    """The digest's name (weights, data, ...)."""
    values: dict[str, tuple[str, ...]]
    """Each value seen -> the builds (signer's keyring name at time) that produced it."""

    def __str__(self) -> str:
        seen = "; ".join(
            f"{value[:12]} by {', '.join(builds)}" for value, builds in sorted(self.values.items())
        )
        return f"step {self.step[:12]}: {self.name} differs between builds ({seen}): not deterministic"


def disagreements(checked: Sequence[Checked]) -> list[Disagreement]:
    """Every output digest on which two trusted, verified records of one step differ."""
    counted = [c for c in checked if c.signer is not None and c.record is not None]
    found = []
    for step in sorted({c.record.step for c in counted if c.record}):
        mine = [(c.signer_name, c.record) for c in counted if c.record and c.record.step == step]
        for name in sorted({name for _, record in mine for name in record.digests}):
            values: dict[str, list[str]] = {}
            for who, record in mine:
                if name in record.digests:
                    values.setdefault(record.digests[name], []).append(f"{who} at {record.built_at}")
            if len(values) > 1:
                found.append(
                    Disagreement(step=step, name=name, values={v: tuple(b) for v, b in values.items()})
                )
    return found
