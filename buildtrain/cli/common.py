"""What every command module uses: the store an invocation names and a line on stderr. It sits
below the command modules (`commands.py`, `upkeep.py`, `delivery.py`, `team.py`, `queries.py`,
`trust.py`), so that none of them imports another for these (commands and team used to import
each other)."""

from __future__ import annotations

import argparse
import sys

from buildtrain.store.store import Store


def store_of(args: argparse.Namespace) -> Store:
    return Store.at(args.store)


def err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
