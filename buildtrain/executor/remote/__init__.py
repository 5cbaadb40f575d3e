"""The team cache's client: a run's side of the remote, and `bt push`/`bt pull` by hand.

`remote.py` (`RemoteCache`) pulls a step instead of building it, pushes what was built, holds the
remote lease while building and attests builds; `remote_checkpoints.py` starts a resumable step
from the remote's newest checkpoint and pushes each new one; `transfer.py` is one function per
command (`bt push`, `bt pull`, `bt verify --push`, `bt ls/show --remote`). The remote library
itself (bytes, keys, leases, attestations) is the store's (`store/remote/`).
"""
