"""The model's arithmetic without torch (`config.shape`): the memory estimate of a training update.

(That `parameter_count` counts the parameters of the real model is tested beside the model, in
test_model.py.)
"""

from __future__ import annotations

import itertools

from buildtrain.config.schema import ModelConfig, TrainConfig
from buildtrain.config.shape import memory_estimate, parameter_count, rank_memory


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


def test_sharding_divides_the_state_and_checkpointing_the_activations() -> None:
    model = ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=8)
    train = TrainConfig(batch_size=16, micro_batch_size=4, sharding="fsdp")
    whole = rank_memory(model, TrainConfig(batch_size=16, micro_batch_size=4))
    shards = [rank_memory(model, train, world_size=n) for n in (1, 2, 4, 8)]
    assert all(
        a.optimizer == 2 * b.optimizer or a.optimizer == 2 * b.optimizer - 1
        for a, b in itertools.pairwise(shards)
    )
    assert shards[0].optimizer == whole.optimizer  # AdamW state: no gathered copies
    assert all(a.total > b.total for a, b in itertools.pairwise(shards))
    checkpointed = rank_memory(
        model, TrainConfig(batch_size=16, micro_batch_size=4, activation_checkpointing=True)
    )
    assert checkpointed.activations < whole.activations and checkpointed.weights == whole.weights
