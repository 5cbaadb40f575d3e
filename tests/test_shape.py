"""The model's arithmetic without torch (`config.shape`): the memory estimate of a training update.

(That `parameter_count` counts the parameters of the real model is tested beside the model, in
test_model.py.)
"""

from __future__ import annotations

from buildtrain.config.schema import ModelConfig, TrainConfig
from buildtrain.config.shape import memory_estimate, parameter_count


def test_memory_estimate_grows_with_every_size() -> None:
    model, train = ModelConfig(), TrainConfig()
    base = memory_estimate(model, train)
    for bigger_model in (ModelConfig(dim=128), ModelConfig(n_layers=4), ModelConfig(ffn_hidden=352)):
        assert memory_estimate(bigger_model, train) > base
    for bigger_train in (TrainConfig(micro_batch_size=32, batch_size=32), TrainConfig(seq_len=128)):
        assert memory_estimate(model, bigger_train) > base


def test_memory_estimate_counts_the_partial_sums_of_the_invariant_tree() -> None:
    model = ModelConfig()
    plain = memory_estimate(model, TrainConfig(batch_size=16, micro_batch_size=1, reduction="allreduce"))
    tree = memory_estimate(model, TrainConfig(batch_size=16, micro_batch_size=1, reduction="invariant"))
    assert tree - plain == parameter_count(model) * 4 * (1 + 4)  # 16 leaves: a tree 4 levels deep
