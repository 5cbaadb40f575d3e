"""What computes: one folder per step kind, as `kinds/` has one module per kind (`data/`,
`tokenizer/`, `train/`, `eval/`, `export/`, `import_hf/`). A module that describes a step's output
lives with the step that makes it, and later steps reach back for it (train reads `data/index.py`,
eval `train/model.py`). At this level sits what no one kind makes: the step's context
(`context.py`), sources read by content (`sources.py`), the raw text read by the tokenizer and
data steps alike (`corpus.py`, `formats.py`, `text.py`), seeds (`seeds.py`), failures, `bt
sample`'s generation (`sample.py`), and the n-gram filter (`ngrams.py`, becoming a kind)."""
