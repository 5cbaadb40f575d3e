"""The remote protocol: push the local store's sealed objects to a remote, pull them back, and
trust nothing that comes back.

A step output goes up as one blob per file (`blobs/<blake3>`, skipped when a blob of that name
and size is already there: uploads are idempotent) and then its MANIFEST.json (`steps/<step>.json`),
written create-only and only after every blob it lists exists, so a reader never finds a manifest
whose blobs are not all there. A manifest already on the remote is never replaced by a different
one: that is two builds of one step that disagree (`Pushed.conflict`), unless the one there is
damaged, which is replaced.

A pull checks, before anything reads the bytes: the manifest against its own digest, that it names
the step hash it was found under, that every file name stays inside the folder; then every blob's
byte stream against its blake3 and size as it is written into the store's `tmp/`; then the
assembled folder with `objects.verify` (names, sizes, links), and only then renames it into
`steps/<step hash>/`. Anything missing, damaged or foreign raises RemoteDamaged naming the object
and its key, and removes everything the pull wrote.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import CorruptObject, RemoteDamaged
from buildtrain.sources import durable
from buildtrain.store import checkpoints, durability, layout, objects, tensors
from buildtrain.store.remote import blobs, keys, manifests, traces
from buildtrain.store.remote.backend import AlreadyExists, Backend, ObjectMissing
from buildtrain.store.remote.connect import open_backend
from buildtrain.store.remote.url import RemoteUrl
from buildtrain.store.store import Store

CHECKPOINT_FORMAT = 1

Accept = Callable[[Path], "str | None"]
"""A caller's check of a pulled folder before it enters the store (a kind re-deriving the
digests its manifest declares): None when it may, else why not."""
Check = Callable[[bytes], "str | None"]
"""A caller's check of an opaque object's bytes: None when they belong under their name, else
what is wrong (a plan's bytes must hash to the plan hash; the remote cannot compute that)."""


@attrs.frozen(kw_only=True)
class Pushed:
    """What a push did."""

    uploaded: int
    """Blobs uploaded."""
    present: int
    """Blobs already on the remote (same name, same size)."""
    bytes_uploaded: int
    manifest: Literal["written", "present", "repaired", "conflict"]
    """written; present (the same bytes were there); repaired (a damaged one was replaced);
    conflict (a different, intact manifest was there and was kept)."""
    conflict: str | None = None
    """For a conflict: what differs (two builds of one step disagree: non-determinism)."""


class Remote:
    """A remote store shared by many local stores."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @classmethod
    def open(cls, url: str | RemoteUrl) -> Remote:
        return cls(open_backend(url))

    @property
    def url(self) -> RemoteUrl:
        return self.backend.url

    def damaged(self, what: str, key: str, problem: str) -> RemoteDamaged:
        return RemoteDamaged(
            f"remote {self.url}: {what} ({key}) {problem}; it was not used (nothing of it is in the "
            "local store): build it locally, and push it again to repair the remote"
        )

    # -- step outputs -----------------------------------------------------------------------------

    def has_output(self, step_hash: str) -> bool:
        return self.backend.exists(keys.step(step_hash)) is not None

    def output_digests(self, step_hash: str) -> dict[str, str] | None:
        """The logical digests the remote's manifest of a step declares, or None when there is
        none or it is damaged or foreign (a pull names which)."""
        declared = self.output_declared(step_hash)
        return None if declared is None else declared[0]

    def output_declared(self, step_hash: str) -> tuple[dict[str, str], dict[str, str]] | None:
        """(logical digests, file -> blake3) that the remote's manifest of a step declares: what
        an attestation must name to count; None as for `output_digests`."""
        try:
            body = objects.parse_manifest(self.backend.get(keys.step(step_hash)))
            files = {name: entry["blake3"] for name, entry in body["files"].items()}
        except (ObjectMissing, ValueError, TypeError, KeyError):
            return None
        return (dict(body["digests"]), files) if body.get("name") == step_hash else None

    def push_output(self, store: Store, step_hash: str) -> Pushed:
        """Upload a sealed output of the local store (checked first: damage is never pushed)."""
        problems = store.outputs.check(step_hash)
        if problems:
            raise CorruptObject(
                f"step {step_hash[:12]} in {store.root} does not verify ({problems[0]}); "
                "it was not pushed: run bt fsck"
            )
        return self._push_sealed(store.outputs.path(step_hash), keys.step(step_hash), step_hash)

    def pull_output(
        self, store: Store, step_hash: str, *, pinned: str | None = None, accept: Accept | None = None
    ) -> Path | None:
        """Download a step output into `store.output(step_hash)`, checked as the module says.
        None when the remote does not hold the step. The caller holds the step's lock and has
        found no intact local output (an output already there is left as it is and returned).
        `pinned`: the manifest's own digest that the caller accepts, and no other (a run's node
        takes exactly the inputs its coordinator holds). `accept` checks the assembled folder
        before it is renamed into place."""
        key = keys.step(step_hash)
        try:
            raw = self.backend.get(key)
        except ObjectMissing:
            return None
        destination = store.outputs.path(step_hash)
        if store.outputs.has(step_hash):
            return destination
        if pinned is not None and objects.manifest_self(raw) != pinned:
            raise self.damaged(
                f"step {step_hash[:12]}", key, f"is not the build this run holds (manifest {pinned[:12]})"
            )
        what = f"step {step_hash[:12]}"
        # Not fsynced where a stamp bound to this boot can stand for durability (durability.py):
        # fsyncing 72 MB took longer than the whole raw download here.
        boot = durability.unsynced_boot(store.root)
        self._assemble(store, raw, step_hash, destination, what=what, key=key, accept=accept, sync=not boot)
        # Hashed on the way in: not read again on this boot. Unsynced bytes never go without a
        # stamp that binds them to it, which a later re-hash on this boot keeps.
        if not store.outputs.stamp_hashed(step_hash, boot=boot) and boot:
            durability.flush_files(destination)
        return destination

    # -- checkpoints of a step in progress --------------------------------------------------------

    def push_checkpoint(self, step_hash: str, folder: Path) -> Pushed:
        """Upload one sealed checkpoint folder (its manifest names the folder) for `step_hash`."""
        problems = objects.verify(folder)
        if problems:
            raise CorruptObject(f"checkpoint {folder} does not verify ({problems[0]}); it was not pushed")
        raw = (folder / objects.MANIFEST).read_bytes()
        manifest = {**objects.parse_manifest(raw), "self": json.loads(raw)["self"]}  # whole, as sealed
        body = {"format": CHECKPOINT_FORMAT, "step": step_hash, "name": folder.name, "manifest": manifest}
        sealed = canonical_bytes({**body, "seal": digest("remote-checkpoint", body)})
        traces.push(self.backend, folder)
        return self._push_files(folder, manifest, keys.checkpoint(step_hash, folder.name), sealed)

    def push_newest_checkpoint(self, step_hash: str, parent: Path) -> Pushed | None:
        """Push the newest checkpoint folder in `parent` that verifies (names such as
        `step-000120` sort by age; hidden folders are checkpoints still being written)."""
        for folder in sorted(parent.iterdir() if parent.is_dir() else (), reverse=True):
            if not folder.name.startswith(".") and not objects.verify(folder):
                return self.push_checkpoint(step_hash, folder)
        return None

    def checkpoints(self, step_hash: str) -> list[str]:
        """Names of the checkpoints the remote holds for a step, newest first (names such as
        `step-000120` sort by age)."""
        folder = keys.checkpoints(step_hash)
        names = (keys.name_in(folder, key) for key in self.backend.list(folder))
        return sorted((name for name in names if name), reverse=True)

    def pull_checkpoint(self, store: Store, step_hash: str, name: str, into: Path) -> Path:
        """Download one checkpoint into `into/<name>` (assembled in the store's tmp/, which must be
        on the file system of `into`); RemoteDamaged when it is missing, damaged or foreign."""
        key = keys.checkpoint(step_hash, name)
        what = f"checkpoint {name} of step {step_hash[:12]}"
        try:
            raw = self.backend.get(key)
        except ObjectMissing:
            raise self.damaged(what, key, "is missing") from None
        manifest = self._checkpoint_manifest(raw, step_hash, name, what=what, key=key)
        destination = into / name
        if not os.path.lexists(destination):
            self._assemble(store, canonical_bytes(manifest), name, destination, what=what, key=key)
        try:
            # Sealed by an unkeyed digest: its tensors must be the state its trace records.
            update = layout.checkpoint_update(name)
            problem = "is not named for an update" if update is None else None
            problem = problem or checkpoints.state_problem(destination, update or 0, required=True)
            if problem:
                raise self.damaged(what, key, f"is refused: {problem}")
            fault = traces.pull(self.backend, destination)
            if fault is not None:
                raise self.damaged(what, *fault)
        except RemoteDamaged:
            objects.remove_tree(destination)  # never resumed from: forged, or its trace unpublishable
            raise
        return destination

    def pull_newest_checkpoint(
        self, store: Store, step_hash: str, into: Path
    ) -> tuple[Path | None, list[str]]:
        """The newest checkpoint on the remote that verifies, pulled into `into`; with the problems
        of every newer one that did not (each named; the caller logs them)."""
        problems = []
        for name in self.checkpoints(step_hash):
            try:
                return self.pull_checkpoint(store, step_hash, name, into), problems
            except RemoteDamaged as exc:
                problems.append(str(exc))
        return None, problems

    def _checkpoint_manifest(self, raw: bytes, step_hash: str, name: str, *, what: str, key: str) -> Any:
        try:
            body = manifests.json_object(raw)
            claimed = body.pop("seal", None)
            intact = (
                claimed == digest("remote-checkpoint", body)
                and canonical_bytes({**body, "seal": claimed}) == raw
            )
        except (ValueError, TypeError):
            intact = False
        if not intact or body.get("format") != CHECKPOINT_FORMAT:
            raise self.damaged(what, key, "does not match its seal")
        if body.get("step") != step_hash or body.get("name") != name:
            found = f"{str(body.get('name'))[:24]} of step {str(body.get('step'))[:12]}"
            raise self.damaged(what, key, f"is sealed as {found} (a foreign object)")
        return body["manifest"]

    # -- plans and evaluation entries (opaque bytes) ----------------------------------------------

    def push_plan(self, plan_hash: str, raw: bytes) -> None:
        self._push_opaque(keys.plan(plan_hash), raw)

    def pull_plan(self, plan_hash: str, check: Check) -> bytes | None:
        """A plan's bytes, or None when the remote has none. `check` binds them to the hash."""
        return self._pull_opaque(keys.plan(plan_hash), f"plan {plan_hash[:12]}", check)

    def plans(self) -> list[str]:
        """The hashes of the plans the remote holds."""
        names = (keys.name_in("plans", key) for key in self.backend.list("plans"))
        return sorted(name for name in names if name and keys.HASH.match(name))

    def push_eval(self, key: str, raw: bytes) -> None:
        self._push_opaque(keys.evaluation(key), raw)

    def pull_eval(self, key: str, check: Check) -> bytes | None:
        return self._pull_opaque(keys.evaluation(key), f"evaluation {key[:12]}", check)

    def _push_opaque(self, key: str, raw: bytes) -> None:
        # Framed by their blake3, so the remote itself tells damaged bytes from foreign ones.
        framed = durable.framed(raw)
        if self.backend.exists(key) != len(framed):
            self.backend.put(key, framed)

    def _pull_opaque(self, key: str, what: str, check: Check) -> bytes | None:
        try:
            framed = self.backend.get(key)
        except ObjectMissing:
            return None
        raw = durable.unframed(framed)
        if raw is None:
            raise self.damaged(what, key, "does not match its blake3")
        problem = check(raw)
        if problem is not None:
            raise self.damaged(what, key, f"does not belong under its name ({problem})")
        return raw

    # -- pushing ----------------------------------------------------------------------------------

    def _push_sealed(self, folder: Path, key: str, name: str) -> Pushed:
        raw = (folder / objects.MANIFEST).read_bytes()
        return self._push_files(folder, objects.parse_manifest(raw), key, raw, name=name)

    def _push_files(
        self, folder: Path, manifest: Mapping[str, Any], key: str, sealed: bytes, *, name: str | None = None
    ) -> Pushed:
        """Every blob first (each once), then the object that names them, create-only."""
        listed = {
            entry["blake3"]: (folder / relative, entry["size"])
            for relative, entry in manifest["files"].items()
        }
        sizes = blobs.upload(self.backend, listed)
        uploaded = [size for size in sizes if size >= 0]
        state, conflict = self._put_manifest(key, sealed, name)
        return Pushed(
            uploaded=len(uploaded),
            present=len(sizes) - len(uploaded),
            bytes_uploaded=sum(uploaded),
            manifest=state,
            conflict=conflict,
        )

    def _put_manifest(self, key: str, sealed: bytes, name: str | None) -> tuple[Any, str | None]:
        for attempt in range(2):
            try:
                self.backend.put(key, sealed, create_only=True)
                return ("written" if attempt == 0 else "repaired"), None
            except AlreadyExists:
                pass
            try:
                there = self.backend.get(key)
            except ObjectMissing:  # removed since: try again
                continue
            if there == sealed:
                return "present", None
            if manifests.sealed_intact(there, name):
                mine, theirs = manifests.describe(sealed), manifests.describe(there)
                return "conflict", f"{key} holds another build's result ({theirs}), this build has ({mine})"
            self.backend.delete(key)  # damaged: replace it with ours
        return "conflict", f"{key} kept changing while it was written; push again"

    # -- pulling ----------------------------------------------------------------------------------

    def _assemble(
        self,
        store: Store,
        raw: bytes,
        name: str,
        destination: Path,
        *,
        what: str,
        key: str,
        accept: Accept | None = None,
        sync: bool = True,
    ) -> None:
        """Build the folder `name` from a manifest's bytes and its blobs under the store's tmp/,
        check it (and `accept` it), and rename it to `destination`; on any problem remove
        everything and raise. `sync`: fsync every file and folder first."""
        temporary = store.new_temp(f"pull-{name[:12]}")
        try:
            folder = temporary / name
            folder.mkdir()
            files = self._listed(raw, name, folder, what=what, key=key)
            self._fetch(files, folder, what, sync)  # each file hashed as written (and fsynced)
            (folder / objects.MANIFEST).write_bytes(raw)
            if sync:
                blobs.fsync(folder / objects.MANIFEST)
            # Contents were hashed piece by piece on their way to disk (the same buffers), so
            # the folder is checked for everything else: the manifest, its name, exactly the
            # listed files, their sizes, no links. A full re-hash here, and the store's own
            # before first use (spared by the stamp a pull writes), each cost about as much as
            # the copy itself from a shared folder (benchmarks/remote.py).
            problems = objects.verify(folder, contents=False)
            if problems:
                raise self.damaged(what, key, f"does not verify once assembled ({problems[0]})")
            problem = accept(folder) if accept is not None else None
            if problem is not None:
                raise RemoteDamaged(
                    f"remote {self.url}: {what} refused: {problem}; it was not used (nothing of it is "
                    "in the local store): build it locally, and push it again to repair the remote"
                )
            for parent in ({path.parent for path in folder.rglob("*")} | {folder}) if sync else ():
                durable.fsync_dir(parent)
            objects.commit(folder, destination)
        finally:
            tensors.forget(temporary)  # digests computed as its files came in
            objects.remove_tree(temporary)

    def _listed(
        self, raw: bytes, name: str, folder: Path, *, what: str, key: str
    ) -> dict[str, tuple[str, int]]:
        """The files a manifest's bytes list (relative path -> blake3, size), refused unless it
        is intact, names `name`, stays inside its folder and fits on the store's disk."""
        try:
            body = objects.parse_manifest(raw)
        except ValueError as exc:
            raise self.damaged(what, key, f"has a damaged manifest ({exc})") from None
        if body["name"] != name:
            raise self.damaged(what, key, f"is sealed for {body['name'][:24]} (a foreign object)")
        files = manifests.file_entries(body["files"])
        if files is None:
            raise self.damaged(
                what,
                key,
                "lists a file outside its folder, a name with a NUL byte, one name as both a "
                "file and a folder, or an unknown entry",
            )
        declared, free = sum(size for _, size in files.values()), shutil.disk_usage(folder).free
        if declared > free:  # sizes are the remote's word: never fill the disk on it
            raise self.damaged(
                what, key, f"declares {declared} bytes of files, the store's disk has {free} free"
            )
        return files

    def _fetch(self, files: dict[str, tuple[str, int]], folder: Path, what: str, sync: bool) -> None:
        problems = blobs.fetch(self.backend, files, folder, what, sync=sync)
        if problems:
            raise RemoteDamaged(
                f"remote {self.url}: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + "; it was not used (nothing of it is in the local store): build it locally, "
                "and push it again to repair the remote"
            )
