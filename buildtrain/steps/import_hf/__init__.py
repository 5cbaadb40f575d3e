"""The import_hf kind's computation (`kinds/import_hf.py`): `step.py` reads a Hugging Face
checkpoint into buildtrain's tensor names and model settings."""
