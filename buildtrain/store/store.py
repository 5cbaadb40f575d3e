"""The store: its folders and identity (`folders.py`), and four parts over the same layout
(`store/layout.py`), each the one owner of its paths: fsck, gc, the executor and the tables ask a
part for them and never spell one.

    store.plans     plan bytes by hash, their metadata, the index by prefix (`plans.py`)
    store.outputs   sealed step outputs, stamps, work folders, the run loop's claim (`outputs.py`)
    store.results   evaluation results, plan cards, steps' metrics summaries (`results.py`)
    store.locks     a step's lock, a plan's run and drop locks (`locks.py`)

A store identifies itself by a marker (`STORE.json`, written when it is created), and a folder in
place of a store folder must be a real folder: a link or a file there is damage, never written
through (`Folders.folder`, `Folders.set_aside`).
"""

from __future__ import annotations

import os
from pathlib import Path

from buildtrain.store.folders import Folders
from buildtrain.store.locks import Locks
from buildtrain.store.outputs import Outputs
from buildtrain.store.plans import Plans
from buildtrain.store.results import Results

DEFAULT_STORE = ".bt"


class Store(Folders):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.plans = Plans(self)
        self.locks = Locks(self, self.plans)
        self.outputs = Outputs(self, self.locks)
        self.results = Results(self)

    @classmethod
    def at(cls, option: str | None) -> Store:
        """The store named by `--store`, else `BT_STORE`, else `./.bt`."""
        return cls(Path(option or os.environ.get("BT_STORE") or DEFAULT_STORE).absolute())
