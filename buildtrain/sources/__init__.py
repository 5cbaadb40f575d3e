"""The sources room: facts about files and data sources that the config, the plan and the store all
read, below each of them and torch-free. Regular files only (`regular.py`), written whole
(`durable.py`), hashed once (`stat_cache.py`), safetensors headers (`safetensors_header.py`), and
data files named by `s3://` URLs (`data_url.py`), found and hashed in a bucket at plan time
(`bucket_sources.py`, `bucket.py`). The one S3 client (`s3_client.py`, configured by
`s3_settings.py`) serves those and the team cache (`store/remote/s3.py`) alike: one way to build
it, one sorting of its failures. Nothing here imports the store, the config, the plan or the steps.
"""
