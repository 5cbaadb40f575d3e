"""The sources room: facts about files and data sources that the config, the plan and the store all
read, below each of them and torch-free. Regular files only (`regular.py`), written whole
(`durable.py`), hashed once (`stat_cache.py`), safetensors headers (`safetensors_header.py`), and
data files named by `s3://` URLs (`data_url.py`), found and hashed in a bucket at plan time
(`bucket_sources.py`) through the one S3 client for data (`bucket.py`, configured as every S3
client is by `s3_settings.py`). Nothing here imports the store, the config, the plan or the steps.
"""
