"""The config each kind of step reads, typed and declared once.

A kind (`kinds/`) builds its step's config from the resolved preset with these classes and writes
it into the plan with `to_config()`, the exact dict the step's hash is over; the step reads it
back with `from_config()`. So the planner and the step cannot drift apart, and no default is
written twice. They sit in `config/`, not beside the kinds, because a step's computing code reads
them: anything they import enters every step's code hash, and the planner must stay out of it.

A key enters a step's config only where it says something (a plain-text source records no format
keys; a corpus of files no synthetic settings), so plans made before a key existed keep their
hashes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from buildtrain.config.convert import converter
from buildtrain.config.schema import (
    BYTE_VOCAB_SIZE,
    END_OF_DOCUMENT,
    DataConfig,
    EvalConfig,
    ExportConfig,
    LoraConfig,
    ModelConfig,
    SyntheticConfig,
    TokenizerConfig,
    TrainConfig,
)

PLAIN_TEXT = attrs.fields(DataConfig).format.default
TEXT_KEY = attrs.fields(DataConfig).text_field.default  # = the default Parquet column


@attrs.frozen(kw_only=True)
class TokenizerSettings:
    """A tokenizer step's settings: a given file has no vocabulary size or frequency to set, and
    its path never enters (its content does, as the step's input)."""

    kind: str
    end_of_document: str
    vocab_size: int | None = None
    min_frequency: int | None = None

    @classmethod
    def of(cls, tokenizer: TokenizerConfig) -> TokenizerSettings:
        if tokenizer.kind == "file":
            return cls(kind="file", end_of_document=tokenizer.end_of_document)
        return cls(
            kind="bpe",
            end_of_document=tokenizer.end_of_document,
            vocab_size=tokenizer.vocab_size,
            min_frequency=tokenizer.min_frequency,
        )

    def to_config(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.frozen(kw_only=True)
class TextSettings:
    """What chooses a step's text and its train/held-out split."""

    source: str
    synthetic: SyntheticConfig | None = None  # only when it is the source
    format: str = PLAIN_TEXT
    text_field: str = TEXT_KEY  # of a JSONL record (format = jsonl)
    text_column: str = TEXT_KEY  # of a Parquet file (format = parquet)
    chat_template: str = ""  # renders chat records (format = chat)
    split_block: int
    heldout_fraction: float
    split_seed: int

    @classmethod
    def of(cls, data: DataConfig) -> TextSettings:
        return cls(**_text_fields(data))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TextSettings:
        """From a tokenizer step's text or a data step's data: the keys this class has."""
        names = {field.name for field in attrs.fields(cls)}
        return converter.structure({k: v for k, v in config.items() if k in names}, cls)

    def to_config(self) -> dict[str, Any]:
        return _text_config(self)


@attrs.frozen(kw_only=True)
class DataSettings:
    """The data section as a data step reads it: no paths (the files arrive as sources, in plan
    order), the tokenizer as "bytes" or its tokenizer step's settings."""

    source: str
    synthetic: SyntheticConfig | None = None
    format: str = PLAIN_TEXT
    text_field: str = TEXT_KEY
    text_column: str = TEXT_KEY
    chat_template: str = ""
    split_block: int
    heldout_fraction: float
    split_seed: int
    tokenizer: str | TokenizerSettings
    shard_tokens: int

    @classmethod
    def of(cls, data: DataConfig) -> DataSettings:
        tokenizer = data.tokenizer
        settings = TokenizerSettings.of(tokenizer) if isinstance(tokenizer, TokenizerConfig) else tokenizer
        return cls(**_text_fields(data), tokenizer=settings, shard_tokens=data.shard_tokens)

    @property
    def text(self) -> TextSettings:
        return TextSettings(**{field.name: getattr(self, field.name) for field in attrs.fields(TextSettings)})

    def to_config(self) -> dict[str, Any]:
        tokenizer = self.tokenizer
        return {
            **_text_config(self),
            "tokenizer": tokenizer.to_config() if isinstance(tokenizer, TokenizerSettings) else tokenizer,
            "shard_tokens": self.shard_tokens,
        }


converter.register_structure_hook(
    str | TokenizerSettings,
    lambda value, _: value if isinstance(value, str) else converter.structure(value, TokenizerSettings),
)


def _text_fields(data: DataConfig) -> dict[str, Any]:
    return {
        "source": data.source,
        "synthetic": data.synthetic if data.source == "synthetic" else None,
        "format": data.format,
        "text_field": data.text_field,
        "text_column": data.text_column,
        "chat_template": data.chat_template,
        "split_block": data.split_block,
        "heldout_fraction": data.heldout_fraction,
        "split_seed": data.split_seed,
    }


def _text_config(settings: TextSettings | DataSettings) -> dict[str, Any]:
    """The text settings as a step's config holds them: the format keys only where they say
    something (plain text files keep the hashes they had before formats existed)."""
    config: dict[str, Any] = {
        "source": settings.source,
        "split_block": settings.split_block,
        "heldout_fraction": settings.heldout_fraction,
        "split_seed": settings.split_seed,
    }
    if settings.format == "jsonl":
        config.update(format="jsonl", text_field=settings.text_field)
    elif settings.format == "parquet":
        config.update(format="parquet", text_column=settings.text_column)
    elif settings.format == "chat":  # the template's text enters the hash
        config.update(format="chat", chat_template=settings.chat_template)
    if settings.synthetic is not None:
        config["synthetic"] = converter.unstructure(settings.synthetic)
    return config


@attrs.frozen(kw_only=True)
class TokenizerDescription:
    """How text becomes tokens, as the plan describes the byte tokenizer and outputs record any."""

    type: str
    vocab_size: int
    end_of_document: int


BYTES = TokenizerDescription(type="bytes", vocab_size=BYTE_VOCAB_SIZE, end_of_document=END_OF_DOCUMENT)


@attrs.frozen(kw_only=True)
class TokenizerStep:
    """A tokenizer step's config: the tokenizer, and the text a BPE is trained on."""

    tokenizer: TokenizerSettings
    text: TextSettings | None = None  # None for a given file

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TokenizerStep:
        text = config.get("text")
        return cls(
            tokenizer=converter.structure(config["tokenizer"], TokenizerSettings),
            text=None if text is None else TextSettings.from_config(text),
        )

    def to_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"tokenizer": self.tokenizer.to_config()}
        if self.text is not None:
            config["text"] = self.text.to_config()
        return config


@attrs.frozen(kw_only=True)
class DataStep:
    """A data step's config: its data settings, and the byte tokenizer's description when no
    tokenizer step describes the tokens."""

    data: DataSettings
    tokenizer: TokenizerDescription | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DataStep:
        return converter.structure(config, cls)

    def to_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"data": self.data.to_config()}
        if self.tokenizer is not None:
            config["tokenizer"] = attrs.asdict(self.tokenizer)
        return config


@attrs.frozen(kw_only=True)
class NgramsStep:
    """An ngrams step's config: how its stage's text is read (as the data step reads it) and the
    n-gram sizes the plan's suites count, each recorded in a filter of its own."""

    text: TextSettings
    ngrams: tuple[int, ...]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> NgramsStep:
        return cls(text=TextSettings.from_config(config["text"]), ngrams=tuple(config["ngrams"]))

    def to_config(self) -> dict[str, Any]:
        return {"text": self.text.to_config(), "ngrams": list(self.ngrams)}


# The eval section's suite settings: recorded (in the plan's config and the eval step's) only where
# suites are set, so a plan without suites keeps the form, and the hashes, it had before suites.
SUITE_SETTINGS = ("suites", "subset", "seed", "checkpoints_every")


SUITE_PATHS = ("file", "task")  # a suite's files, sources of the eval step in this order


def heldout_settings(config: EvalConfig) -> dict[str, Any]:
    """The eval section without its suite settings: what held-out evaluation reads."""
    return {k: v for k, v in converter.unstructure(config).items() if k not in SUITE_SETTINGS}


def heldout_only(config: EvalConfig) -> EvalConfig:
    """The eval section with its suite settings at their defaults (what a train step records)."""
    return attrs.evolve(config, suites=(), subset=1.0, seed=0, checkpoints_every=0)


def eval_view(config: EvalConfig) -> dict[str, Any]:
    """The eval section as the plan's config records it: the suite settings only when suites are
    set, each suite without its file (whose content enters the eval step as a source)."""
    view = converter.unstructure(config)
    if not config.suites:
        return heldout_settings(config)
    view["suites"] = [  # an unset optional key (max_overlap) enters only when set
        {k: v for k, v in suite.items() if k not in SUITE_PATHS and v is not None} for suite in view["suites"]
    ]
    return view


@attrs.frozen(kw_only=True)
class SuiteStep:
    """A suite as an eval step records it: its file is a source of the step, by content."""

    name: str
    version: int
    kind: str
    max_overlap: int | None = None  # recorded only when set
    ngram: int | None = None  # words per n-gram of its overlap check, recorded only when set (none: 13)


@attrs.frozen(kw_only=True)
class TrainStep:
    """A train step's config: the model, its stage's training, and evaluation during training
    (only when `eval.every` asks for it)."""

    model: ModelConfig
    train: TrainConfig
    eval: EvalConfig | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrainStep:
        return converter.structure(config, cls)

    def to_config(self) -> dict[str, Any]:
        config = {"model": converter.unstructure(self.model), "train": converter.unstructure(self.train)}
        if self.eval is not None:
            config["eval"] = heldout_settings(self.eval)  # suites are evaluated after training
        return config


@attrs.frozen(kw_only=True)
class EvalStep:
    """An eval step's config: the held-out settings (the plan leaves out `eval.every`, a
    training setting), the model, and the held-out suite's `version`, which results are cached
    under; with benchmark suites, also the suites (their files are the step's sources, in this
    order), the subset drawn from each and its seed, and `context`, the tokens the model was
    trained on (a question longer than that is cut from the left, as the `hf/` export's
    `max_position_embeddings` makes lm-eval cut it). After LoRA training, `lora` says how a kept
    checkpoint's adapters merge into its weights (the final weights are merged already)."""

    eval: EvalConfig
    model: ModelConfig
    version: int
    suites: tuple[SuiteStep, ...] = ()
    subset: float = 1.0
    seed: int = 0
    context: int = 0
    checkpoints_every: int = 0  # a curve of each suite over the kept checkpoints (only when set)
    lora: LoraConfig | None = None  # only after LoRA training

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EvalStep:
        return converter.structure(config, cls)

    def to_config(self) -> dict[str, Any]:
        settings = {k: v for k, v in heldout_settings(self.eval).items() if k != "every"}
        config = {"eval": settings, "model": converter.unstructure(self.model), "version": self.version}
        if self.suites:
            config["suites"] = [
                {k: v for k, v in attrs.asdict(suite).items() if v is not None} for suite in self.suites
            ]
            config.update(subset=self.subset, seed=self.seed, context=self.context)
            if self.checkpoints_every:
                config["checkpoints_every"] = self.checkpoints_every
        if self.lora is not None:
            config["lora"] = converter.unstructure(self.lora)
        return config


@attrs.frozen(kw_only=True)
class ExportStep:
    """An export step's config: what it does (`export`, `tokenizer`), and the settings it
    describes in the package's config.json, kept exactly as the plan holds them (the package's
    bytes)."""

    export: ExportConfig
    tokenizer: Mapping[str, Any]  # the byte tokenizer's description, or the tokenizer step's settings
    described: Mapping[str, Any]  # model, train, data and numerics, as config.json gives them

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ExportStep:
        return cls(
            export=converter.structure(config["export"], ExportConfig),
            tokenizer=config["tokenizer"],
            described={k: v for k, v in config.items() if k != "tokenizer"},
        )

    def to_config(self) -> dict[str, Any]:
        return {
            **self.described,
            "export": converter.unstructure(self.export),
            "tokenizer": dict(self.tokenizer),
        }
