"""The ngrams step: the Bloom filters of a stage's n-grams of words, which the contamination check
of an eval step's suites reads (`bloom.py`: the hashing and the filter; `step.py`: the step).
It reads the text as the data step does and never the token shards; the data step records no
filter, so training never waits for one."""
