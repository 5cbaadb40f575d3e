"""A team cache: the store's content-addressed objects on a remote that many stores share.

`url.py` names a remote (`s3://bucket/prefix`, `file:///path`); `backend.py` is the narrow
interface every back end implements (bytes and files by key); `folder.py` and `s3.py` implement it
and `connect.py` picks one for a URL (the S3 client is imported only inside `s3.py` and
`bucket.py`, so nothing that does not use it loads it);
`keys.py` lays the objects out; `remote.py` pushes and pulls plans, step outputs, checkpoints and
evaluation entries and checks every byte that comes back; `leases.py` and `attest.py` coordinate
builders. `bucket.py` and `data_sources.py` read data files from a bucket (`s3://` entries of
`data.files`): hashed at plan time, fetched into the store's source cache at run time (URLs are
parsed in `store/data_url.py`, which a plain `bt plan` reads without loading this package). Nothing
here imports the plan, the steps or the executor: objects are bytes, digests and manifests.
"""
