"""The store: plans by hash, step outputs by step hash, and the working state of steps in progress.

Layout under the store root (default `./.bt`, or `--store` / `BT_STORE`):

    plans/<plan hash>.json        the canonical plan bytes (the hash is of exactly these bytes)
    plans/<plan hash>.meta.json   when and from which preset it was planned (never hashed)
    steps/<step hash>/            a completed step output, sealed by MANIFEST.json, immutable
    work/<step hash>/             checkpoints of a step in progress
    evals/<key>.json              evaluation results by (suite, version, weights, data)
    locks/<step hash>.lock        one writer per step
    tmp/                          outputs being built; renamed into steps/ when complete
    quarantine/                   outputs that failed verification, moved aside, never loaded
    cache/files.json              stat cache of source file digests
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from buildtrain.errors import CorruptObject, Locked, UsageError
from buildtrain.plan.canonical import canonical_bytes
from buildtrain.plan.plan import Plan
from buildtrain.store import objects
from buildtrain.store.sources import StatCache

DEFAULT_STORE = ".bt"
HEX = re.compile(r"^[0-9a-f]+$")
MIN_PREFIX = 4


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.plans = root / "plans"
        self.steps = root / "steps"
        self.work = root / "work"
        self.evals = root / "evals"
        self.locks = root / "locks"
        self.tmp = root / "tmp"
        self.quarantined = root / "quarantine"

    @classmethod
    def at(cls, option: str | None) -> Store:
        """The store named by `--store`, else `BT_STORE`, else `./.bt`."""
        return cls(Path(option or os.environ.get("BT_STORE") or DEFAULT_STORE).absolute())

    # -- plans ------------------------------------------------------------------------------------

    def save_plan(self, plan: Plan, **meta: Any) -> None:
        self.plans.mkdir(parents=True, exist_ok=True)
        path = self.plans / f"{plan.hash}.json"
        if not path.exists():
            objects.write_bytes_durably(path, canonical_bytes(plan.to_body()))
        previous = self.plan_meta(plan.hash)
        record = {"created": previous.get("created", utc_now()), **previous, **meta, "planned": utc_now()}
        objects.write_bytes_durably(
            self.plans / f"{plan.hash}.meta.json", json.dumps(record, indent=1).encode()
        )

    def plan_hashes(self) -> list[str]:
        if not self.plans.is_dir():
            return []
        return sorted(p.name[:-5] for p in self.plans.glob("*.json") if not p.name.endswith(".meta.json"))

    def resolve(self, ref: str) -> str:
        """The full hash of the one stored plan that `ref` (a hash or unique prefix) names."""
        ref = ref.strip().lower()
        if not HEX.match(ref) or len(ref) < MIN_PREFIX:
            raise UsageError(f"'{ref}' is not a plan hash or a prefix of at least {MIN_PREFIX} hex digits")
        matches = [h for h in self.plan_hashes() if h.startswith(ref)]
        if not matches:
            raise UsageError(f"no plan {ref} in the store {self.root}; compile one with: bt plan PRESET")
        if len(matches) > 1:
            listed = ", ".join(m[:12] for m in matches[:5])
            raise UsageError(f"plan prefix {ref} is ambiguous ({listed}); give more digits")
        return matches[0]

    def load_plan(self, ref: str) -> Plan:
        plan_hash = self.resolve(ref)
        path = self.plans / f"{plan_hash}.json"
        try:
            raw = path.read_bytes()
            plan = Plan.from_body(json.loads(raw))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptObject(
                f"plan {plan_hash[:12]} in {self.root} is damaged ({exc}); run bt fsck"
            ) from None
        if plan.hash != plan_hash or canonical_bytes(plan.to_body()) != raw:
            raise CorruptObject(f"plan {plan_hash[:12]} does not match its hash; run bt fsck")
        return plan

    def plan_meta(self, plan_hash: str) -> dict[str, Any]:
        try:
            meta = json.loads((self.plans / f"{plan_hash}.meta.json").read_bytes())
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}  # never hashed: damaged reads as absent

    # -- step outputs -----------------------------------------------------------------------------

    def output(self, step_hash: str) -> Path:
        return self.steps / step_hash

    def has_output(self, step_hash: str) -> bool:
        return (self.output(step_hash) / objects.MANIFEST).is_file()

    def verify_output(self, step_hash: str, *, contents: bool = True) -> list[str]:
        return objects.verify(self.output(step_hash), contents=contents)

    def _stamp(self, step_hash: str) -> Path:
        return self.root / "cache" / "verified" / f"{step_hash}.json"

    def check_output(self, step_hash: str) -> list[str]:
        """`verify_output`, remembered: after a full re-hash, the (size, mtime, inode) of every
        file is stamped, and while the stamp matches the files are not hashed again. This keeps a
        null build instant with gigabytes of outputs; anything written to an output changes its
        stamp. (Decay that changes no metadata is what `bt fsck` is for: it always re-hashes.)"""
        folder = self.output(step_hash)
        try:
            stats = {
                p.relative_to(folder).as_posix(): [s.st_size, s.st_mtime_ns, s.st_ino]
                for p in sorted(folder.rglob("*"))
                if (s := p.stat()) and p.is_file()
            }
        except OSError:
            return ["output folder unreadable"]
        stamp = self._stamp(step_hash)
        try:
            if json.loads(stamp.read_bytes()) == stats:
                return []
        except (OSError, ValueError):
            pass
        problems = self.verify_output(step_hash)
        if not problems:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            objects.write_bytes_durably(stamp, json.dumps(stats).encode())
        return problems

    def quarantine(self, step_hash: str) -> Path:
        """Move a damaged output aside so that it is rebuilt and never loaded."""
        self.quarantined.mkdir(parents=True, exist_ok=True)
        target = self.quarantined / f"{step_hash}.{int(time.time())}"
        os.rename(self.output(step_hash), target)
        return target

    def work_dir(self, step_hash: str) -> Path:
        return self.work / step_hash

    def new_temp(self, label: str) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{label}.", dir=self.tmp))

    def stat_cache(self) -> StatCache:
        return StatCache(self.root / "cache" / "files.json")

    # -- locks ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(
        self, step_hash: str, *, wait: bool = True, on_wait: Callable[[str], None] | None = None
    ) -> Iterator[int]:
        """Hold the step's lock; yields the file descriptor so a child process can inherit it.

        flock belongs to the open file description, so a child that inherits the descriptor keeps
        the step locked even if this process is killed first.
        """
        self.locks.mkdir(parents=True, exist_ok=True)
        path = self.locks / f"{step_hash}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
                if not wait:
                    raise Locked(f"step {step_hash[:12]} is being built by pid {holder}") from None
                if on_wait is not None:
                    on_wait(holder)
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield fd
        finally:
            os.close(fd)
