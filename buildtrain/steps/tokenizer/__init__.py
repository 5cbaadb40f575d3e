"""The tokenizer kind's computation (`kinds/tokenizer.py`): `step.py` trains a BPE tokenizer,
`pieces.py` cuts text into the pieces it is trained on, `files.py` names and loads its files. The
data step tokenizes with the same pieces and files, and export and eval load the files: they live
here, where a tokenizer is made; the data kind's code never reaches `step.py`."""
