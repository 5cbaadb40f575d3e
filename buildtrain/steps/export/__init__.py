"""The export kind's computation (`kinds/export.py`): `step.py` seals final weights, config,
tokenizer description and checksums; `hf.py` writes the same weights for Hugging Face transformers
(and peft), whose names `steps/import_hf/` reads back."""
