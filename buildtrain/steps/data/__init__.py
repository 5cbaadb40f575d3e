"""The data kind's computation (`kinds/data.py`): `step.py` runs it (read, tokenize, split, shard),
`tokenized.py` and `chat.py` tokenize text and conversations, `split.py` with `short_blake3.py`
assigns each document to its split, `shards.py` writes the token shards, `documents.py` records
every document read and `index.py` says what an output holds. Later steps read a data output
through `index.py` and `documents.py` (train, eval): they live here, where that output is made."""
