"""The config a step reads is declared once (`config/steps.py`): what the planner writes into the
plan, the step reads back as a typed value that writes out the same dict (a key that says nothing,
such as the Parquet column of a plain-text corpus, is not written, so it is not read back either).
"""

from __future__ import annotations

from hypothesis import given, settings
from strategies import configs

from buildtrain.config.schema import Config, TokenizerConfig
from buildtrain.config.steps import (
    DataSettings,
    DataStep,
    EvalStep,
    NgramsStep,
    TextSettings,
    TokenizerSettings,
    TokenizerStep,
    TrainStep,
)


@settings(max_examples=60, deadline=None)
@given(configs())
def test_every_step_config_reads_back_as_it_was_written(config: Config) -> None:
    for stage in config.stages:
        data = DataSettings.of(stage.data)
        written = DataStep(data=data).to_config()
        assert DataStep.from_config(written).to_config() == written
        assert data.text == TextSettings.of(stage.data)
        tokenizer = stage.data.tokenizer
        if isinstance(tokenizer, TokenizerConfig):
            step = TokenizerStep(tokenizer=TokenizerSettings.of(tokenizer), text=TextSettings.of(stage.data))
            assert TokenizerStep.from_config(step.to_config()).to_config() == step.to_config()
        train = TrainStep(model=config.model, train=stage.train, eval=config.eval)
        assert TrainStep.from_config(train.to_config()) == train
        recorded = NgramsStep(text=TextSettings.of(stage.data), ngrams=(8, 13))
        assert NgramsStep.from_config(recorded.to_config()).to_config() == recorded.to_config()
    evaluation = EvalStep(eval=config.eval, model=config.model, version=1)
    assert EvalStep.from_config(evaluation.to_config()).to_config() == evaluation.to_config()


@settings(max_examples=60, deadline=None)
@given(configs())
def test_format_and_corpus_keys_enter_only_where_they_say_something(config: Config) -> None:
    for stage in config.stages:
        written = DataSettings.of(stage.data).to_config()
        assert ("synthetic" in written) == (stage.data.source == "synthetic")
        assert ("format" in written) == (stage.data.format != "text")
        assert ("text_field" in written) == (stage.data.format == "jsonl")
        assert ("text_column" in written) == (stage.data.format == "parquet")
        assert "files" not in written  # paths never enter a step
