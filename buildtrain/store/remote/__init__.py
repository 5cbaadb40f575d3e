"""A team cache: the store's content-addressed objects on a remote that many stores share.

`url.py` names a remote (`s3://bucket/prefix`, `file:///path`); `backend.py` is the narrow
interface every back end implements (bytes and files by key); `folder.py` and `s3.py` implement it
and `connect.py` picks one for a URL (the one S3 client, `sources/s3_client.py`, is imported only
inside `s3.py` here and `sources/bucket.py`, so nothing that does not use it loads it);
`keys.py` lays the objects out; `remote.py` pushes and pulls plans, step outputs, checkpoints and
evaluation entries and checks every byte that comes back; `leases.py` and `attest.py` coordinate
builders. Data files in a bucket (`s3://` entries of `data.files`) are not the team cache's: they
are read in `sources/` (`bucket.py`, `bucket_sources.py`, through the same S3 client as `s3.py`)
and fetched into the store's source cache by `store/source_cache.py`.
Nothing here imports the plan, the steps or the executor: objects are bytes, digests and manifests.
"""
