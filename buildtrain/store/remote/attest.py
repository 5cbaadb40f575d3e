"""Attestations: which independent builds of a step produced which outputs.

Each build adds a record (machine, toolchain fingerprint, time, the output's digests) as a new
object named by the record's own digest (`attestations/<step>/<digest>.json`), written
create-only: a record is never overwritten, the same record twice is one object, and a damaged or
moved one no longer matches its name and is reported instead of counted. Records whose digests
differ are two builds of one step that disagree: non-determinism, which the plan's hash promised
away (`disagreements`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence

import attrs
import cattrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.store.remote import keys
from buildtrain.store.remote.backend import AlreadyExists, Backend, ObjectMissing

ATTESTATION_FORMAT = 1
_converter = cattrs.Converter(forbid_extra_keys=True)


def _digests(value: Mapping[str, str]) -> dict[str, str]:
    return dict(sorted(value.items()))


@attrs.frozen(kw_only=True)
class Attestation:
    """One build of one step, as its builder reports it."""

    step: str = attrs.field(validator=attrs.validators.matches_re(keys.HASH))
    machine: str = attrs.field(validator=attrs.validators.min_len(1))
    """Who built it: a host name, or any label the team uses."""
    toolchain: str = attrs.field(validator=attrs.validators.min_len(1))
    """The toolchain fingerprint the step was built with (torch build, CPU or GPU)."""
    built_at: str = attrs.field(validator=attrs.validators.min_len(1))
    """UTC time, ISO 8601."""
    digests: dict[str, str] = attrs.field(converter=_digests)
    """The output's logical digests (its manifest's `digests`: weights, data, ...)."""


@attrs.frozen(kw_only=True)
class Disagreement:
    """One output digest on which builds of a step differ."""

    step: str
    name: str
    """The digest's name (weights, data, ...)."""
    values: dict[str, tuple[str, ...]]
    """Each value seen -> the builds (machine at time) that produced it."""

    def __str__(self) -> str:
        seen = "; ".join(
            f"{value[:12]} by {', '.join(builds)}" for value, builds in sorted(self.values.items())
        )
        return f"step {self.step[:12]}: {self.name} differs between builds ({seen}): not deterministic"


def _body(record: Attestation) -> dict[str, object]:
    return {"format": ATTESTATION_FORMAT, "record": _converter.unstructure(record)}


def attest(backend: Backend, record: Attestation) -> str:
    """Add a record; returns its key. An identical record already there is the same object."""
    body = _body(record)
    key = keys.attestation(record.step, digest("remote-attestation", body))
    # Named by its digest: what is already there is this record, or damage `attestations` reports.
    with contextlib.suppress(AlreadyExists):
        backend.put(key, canonical_bytes(body), create_only=True)
    return key


def attestations(backend: Backend, step: str) -> tuple[list[Attestation], list[str]]:
    """The step's records, and a problem line for each damaged or foreign one (not counted)."""
    records, problems = [], []
    folder = keys.attestations(step)
    for key in backend.list(folder):
        name = keys.name_in(folder, key)
        try:
            raw = backend.get(key)
            body = json.loads(raw)
            record = _converter.structure(body["record"], Attestation)
            intact = (
                body.get("format") == ATTESTATION_FORMAT
                and canonical_bytes(_body(record)) == raw
                and digest("remote-attestation", _body(record)) == name
                and record.step == step
            )
        except ObjectMissing:
            continue  # removed while we listed
        except (ValueError, TypeError, KeyError, cattrs.BaseValidationError):
            intact = False
        if intact:
            records.append(record)
        else:
            problems.append(f"{key}: damaged or foreign attestation, not counted")
    return sorted(records, key=lambda r: (r.built_at, r.machine)), problems


def disagreements(records: Sequence[Attestation]) -> list[Disagreement]:
    """Every output digest on which two records of one step differ."""
    found = []
    for step in sorted({record.step for record in records}):
        mine = [record for record in records if record.step == step]
        for name in sorted({name for record in mine for name in record.digests}):
            values: dict[str, list[str]] = {}
            for record in mine:
                if name in record.digests:
                    values.setdefault(record.digests[name], []).append(
                        f"{record.machine} at {record.built_at}"
                    )
            if len(values) > 1:
                found.append(
                    Disagreement(step=step, name=name, values={v: tuple(b) for v, b in values.items()})
                )
    return found


def agreeing(records: Sequence[Attestation], digests: Mapping[str, str]) -> int:
    """How many records report exactly these digests (for a rule such as "N agreeing builds")."""
    wanted = _digests(digests)
    return sum(1 for record in records if record.digests == wanted)
