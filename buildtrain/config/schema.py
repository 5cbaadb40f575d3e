"""The typed preset language: one frozen attrs class per preset section.

Every field has a default, a one-line doc and its validators beside it; cross-field rules live in
validator methods of the field they guard, marked with the fields they read (`@reads`). Each rule
reads only fields declared before its own, so attrs, which validates in field order and stops at
the first failure, never runs a rule on an invalid value either (a test checks both). Each
component later receives only its own section. The resolved `Config` is what a plan is compiled from: every default materialized, one fully
merged `Stage` per training stage.
"""

from __future__ import annotations

from typing import Any

import attrs

from buildtrain.config.checks import (
    OneOf,
    at_least,
    at_most,
    below,
    greater_than,
    name_problem,
    never_hashed,
    one_of,
    reads,
    renamed_from,
    setting,
    since,
)
from buildtrain.config.suites import SUITE_KINDS, suite_kind

# Byte-level tokenizer: 256 byte values plus one end-of-document token.
BYTE_VOCAB_SIZE = 257
END_OF_DOCUMENT = 256
# More intra-op threads than any machine has cores is a typo, not a setting (torch would fail late).
MAX_THREADS = 4096
# The synthetic corpus is generated in Python at about 3.3 us a line (9.4 bytes of text), so 10**8
# lines is about 0.9 GB of text and 6 minutes of generation here: a larger one is a typo (2**63-1
# documents would fill tmp/ forever), and a corpus that large belongs in data files.
MAX_SYNTHETIC_LINES = 100_000_000
MAX_SYNTHETIC_DOCUMENTS = MAX_SYNTHETIC_LINES
MAX_NGRAM = 64  # words per n-gram of a suite's overlap check: a data step keeps n words in hand
# A shard is built in memory before it is written: 2**30 tokens is 2 to 4 GiB of buffer.
MAX_SHARD_TOKENS = 1 << 30
# Gradient accumulation runs in tens or hundreds of micro-batches; 2**62 of them (batch_size 2**62,
# micro_batch_size 1) is an update that never ends, and listing the world sizes that share them
# hung `bt plan --nproc 3`.
MAX_MICRO_BATCHES = 1 << 16


@attrs.frozen(kw_only=True)
class SyntheticConfig:
    """A built-in corpus generated from a seed, so a preset runs on any machine with no data."""

    kind: str = setting("arithmetic", "generator of the synthetic corpus", one_of("arithmetic"))
    documents: int = setting(
        2000, "number of documents generated", at_least(1), at_most(MAX_SYNTHETIC_DOCUMENTS)
    )
    lines: int = setting(
        16,
        f"lines (problems) per document; documents x lines at most {MAX_SYNTHETIC_LINES:,}",
        at_least(1),
        at_most(MAX_SYNTHETIC_LINES),
    )
    seed: int = setting(0, "seed of the generator", at_least(0))

    @lines.validator
    @reads("documents")
    def _corpus_is_bounded(self, _: attrs.Attribute[Any], value: int) -> None:
        total = self.documents * value
        if total > MAX_SYNTHETIC_LINES:
            raise ValueError(
                f"{value} lines x data.synthetic.documents {self.documents} = {total:,} lines, more than "
                f"the {MAX_SYNTHETIC_LINES:,} the synthetic corpus allows; use data files for a larger corpus"
            )


@attrs.frozen(kw_only=True)
class TokenizerConfig:
    """A tokenizer other than bytes: a byte-level BPE trained on the stage's training text, or an
    existing `tokenizer.json` (hashed by content, never by path)."""

    file: str | None = setting(
        None, "an existing Hugging Face tokenizer.json, relative to the preset (instead of training one)"
    )
    kind: str = setting(
        attrs.Factory(lambda self: "file" if self.file is not None else "bpe", takes_self=True),
        "bpe (trained by a tokenizer step; the default) or file (the default when `file` is set)",
        one_of("bpe", "file"),
    )
    vocab_size: int = setting(
        4096, "tokens in the trained vocabulary, special tokens included", at_least(258)
    )
    min_frequency: int = setting(2, "merges seen fewer times than this are not learned", at_least(1))
    end_of_document: str = setting("<|endoftext|>", "the special token that ends each document")

    @kind.validator
    @reads("file")
    def _kind_matches_file(self, _: attrs.Attribute[Any], value: str) -> None:
        if value == "file" and self.file is None:
            raise ValueError("is 'file' but no file is given; add data.tokenizer.file = \"tokenizer.json\"")
        if value == "bpe" and self.file is not None:
            raise ValueError("is 'bpe' but a file is given; drop kind (a file is used as it is)")


class TokenizerChoice(OneOf):
    """`"bytes"`, or a tokenizer table (whose own fields validate it)."""

    def __call__(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, TokenizerConfig):
            super().__call__(instance, attribute, value)


DATA_FORMATS = ("text", "jsonl", "parquet", "chat")


@attrs.frozen(kw_only=True)
class DataConfig:
    """Where the tokens come from and how they are split and sharded."""

    source: str = setting(
        "synthetic", "'synthetic' (built-in corpus) or 'files'", one_of("synthetic", "files")
    )
    files: tuple[str, ...] = setting(
        (),
        "paths or globs of data files, relative to the preset that names them, or s3://bucket/key URLs and globs",
    )
    synthetic: SyntheticConfig = setting(attrs.Factory(SyntheticConfig), "the built-in corpus")
    format: str = setting(
        "text",
        "format of the data files: text (one document per file), jsonl or parquet (one per row), or chat "
        '(JSONL records {"prompt", "completion"} or {"messages": [...]}, loss on the completions only)',
        one_of(*DATA_FORMATS),
    )
    text_field: str = setting("text", "the key of a JSONL record that holds its text (format = jsonl)")
    text_column: str = setting("text", "the string column of a Parquet file (format = parquet)")
    chat_template: str = since(
        setting(
            "",
            "the Jinja chat template that renders chat records (format = chat); with model.init, the "
            "checkpoint's own",
        )
    )
    tokenizer: str | TokenizerConfig = setting(
        "bytes",
        'bytes (256 values + end-of-document), or a table: { kind = "bpe", vocab_size = N } or '
        '{ file = "tokenizer.json" }',
        TokenizerChoice(("bytes",)),
    )
    heldout_fraction: float = setting(
        0.05, "fraction of split blocks held out for evaluation", greater_than(0.0), at_most(0.5)
    )
    split_block: int = setting(
        1024,
        "tokens per block when assigning train/held-out (with a BPE or file tokenizer: at most this many "
        "bytes of text per piece, cut after a newline where one fits, split before tokenizing)",
        at_least(16),
    )
    split_seed: int = setting(0, "seed of the train/held-out assignment", at_least(0))
    shard_tokens: int = setting(
        1 << 20,
        "tokens per shard file (held in memory while it fills)",
        at_least(1024),
        at_most(MAX_SHARD_TOKENS),
    )

    @files.validator
    @reads("source")
    def _files_match_source(self, _: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        if self.source == "files" and not value:
            raise ValueError("source is 'files' but no files are listed; add data.files = [\"corpus/*.txt\"]")
        if self.source == "synthetic" and value:
            raise ValueError("files are listed but source is 'synthetic'; set data.source = \"files\"")


# Derived hidden widths are rounded up to a multiple of 16 floats: GEMMs of other widths are slow
# on the CPU. At width 256, a SwiGLU hidden width of 683 (8/3 x 256) ran at 111 GFLOP/s against
# 155-175 for other widths, and 688 took 0.945x the step time of 683 (issue 26, 2-core machine).
FFN_MULTIPLE = 16


def derived_ffn_hidden(dim: int, mlp: str) -> int:
    """The default hidden width of the feed-forward block: 8/3 x dim for swiglu (three matrices
    with the parameters of gelu's two of 4 x dim), 4 x dim for gelu, rounded up to FFN_MULTIPLE."""
    width = -(-8 * dim // 3) if mlp == "swiglu" else 4 * dim
    # at least one multiple: an invalid dim (0) is reported at model.dim, not again here
    return max(FFN_MULTIPLE, -(-width // FFN_MULTIPLE) * FFN_MULTIPLE)


@attrs.frozen(kw_only=True)
class InitConfig:
    """Where a model's first weights come from: a local Hugging Face checkpoint folder (its
    config.json, safetensors shards and tokenizer files), read by content, never by path."""

    hf: str = setting(
        "",
        "a Hugging Face checkpoint folder (llama, mistral, qwen2 or qwen3; safetensors), relative to the preset",
    )

    @hf.validator
    def _names_a_folder(self, _: attrs.Attribute[Any], value: str) -> None:
        if not value:
            raise ValueError('is empty; give the checkpoint folder: model.init = { hf = "path/to/folder" }')


@attrs.frozen(kw_only=True)
class RopeScalingConfig:
    """Llama 3's RoPE scaling: at construction, frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are divided by factor, those shorter than
    original_max_position_embeddings / high_freq_factor kept, and those between interpolated."""

    rope_type: str = setting("llama3", "the scaling rule (llama3 only)", one_of("llama3"))
    factor: float = setting(8.0, "how much the low frequencies are slowed", greater_than(0.0))
    low_freq_factor: float = setting(
        1.0,
        "wavelengths above original_max_position_embeddings / this are divided by factor",
        greater_than(0.0),
    )
    high_freq_factor: float = setting(
        4.0, "wavelengths below original_max_position_embeddings / this are kept", greater_than(0.0)
    )
    original_max_position_embeddings: int = setting(
        8192, "the context length the base model was pretrained at", at_least(1)
    )

    @high_freq_factor.validator
    @reads("low_freq_factor")
    def _above_low(self, _: attrs.Attribute[Any], value: float) -> None:
        if value <= self.low_freq_factor:
            raise ValueError(
                f"{value} must exceed low_freq_factor {self.low_freq_factor} (the two bound the interpolated band)"
            )


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU.

    Fields marked `since` entered the language after plans were first hashed: they enter a step's
    config only when set to something else than their default (`convert.py`), so older plans keep
    their hashes. `init` never enters any hash (it is a path): the checkpoint's content does, as
    the import step's input.
    """

    dim: int = setting(64, "width of the residual stream", at_least(1))
    head_dim: int = since(
        setting(
            0, "channels per attention head (0 = dim / n_heads; qwen3 checkpoints set their own)", at_least(0)
        )
    )
    n_layers: int = setting(2, "number of transformer blocks", at_least(1))
    n_heads: int = setting(4, "attention (query) heads; must divide dim", at_least(1))
    n_kv_heads: int = setting(
        2, "key/value heads (grouped-query attention); must divide n_heads", at_least(1)
    )
    mlp: str = setting("swiglu", "feed-forward block: swiglu or gelu", one_of("swiglu", "gelu"))
    ffn_hidden: int = setting(
        attrs.Factory(lambda self: derived_ffn_hidden(self.dim, self.mlp), takes_self=True),
        f"hidden width of the feed-forward block; by default 8/3 x dim (swiglu: the parameters of a "
        f"4 x dim gelu block) or 4 x dim (gelu), rounded up to a multiple of {FFN_MULTIPLE}",
        at_least(1),
    )
    norm: str = setting("rmsnorm", "normalization: rmsnorm or layernorm", one_of("rmsnorm", "layernorm"))
    norm_eps: float = setting(1e-5, "epsilon of the normalization", greater_than(0.0))
    rope_theta: float = setting(10000.0, "RoPE base frequency", greater_than(0.0))
    tie_embeddings: bool = setting(True, "share the input embedding and the output projection")
    dropout: float = setting(
        0.0, "dropout probability (seeded per step and micro-batch)", at_least(0.0), below(1.0)
    )
    init_std: float = setting(0.02, "standard deviation of the initial weights", greater_than(0.0))
    qkv_bias: bool = since(setting(False, "biases on the query, key and value projections (qwen2)"))
    qk_norm: bool = since(setting(False, "RMSNorm over each query and key head before RoPE (qwen3)"))
    rope_scaling: RopeScalingConfig | None = since(
        setting(
            None, 'RoPE frequencies rescaled as Llama 3.x does: { rope_type = "llama3", factor = 8.0, ... }'
        )
    )
    vocab_size: int = since(
        setting(
            0,
            "rows of the embedding (0 = the tokenizer's vocabulary); a checkpoint sets it to its own",
            at_least(0),
        )
    )
    init: InitConfig | None = never_hashed(
        setting(
            None,
            'start from a pretrained checkpoint: { hf = "folder" }; the shape keys above then come '
            "from its config.json (a preset that contradicts them is refused) and its tokenizer.json "
            "becomes the tokenizer",
        )
    )

    @head_dim.validator
    def _even_head_dim(self, _: attrs.Attribute[Any], value: int) -> None:
        if value % 2:
            raise ValueError(f"{value} is odd; RoPE rotates pairs of channels, so a head size must be even")

    @n_heads.validator
    @reads("dim", "head_dim")
    def _heads_divide_dim(self, _: attrs.Attribute[Any], value: int) -> None:
        if self.head_dim:
            return  # a head size of its own: the projections map dim to n_heads x head_dim and back
        if self.dim % value:
            raise ValueError(f"{value} does not divide model.dim {self.dim}; choose a divisor of {self.dim}")
        if (self.dim // value) % 2:
            raise ValueError(f"gives an odd head size {self.dim // value}; RoPE needs an even dim / n_heads")

    @qk_norm.validator
    @reads("norm", "mlp")
    def _qk_norm_in_qwen3_blocks(self, _: attrs.Attribute[Any], value: bool) -> None:
        if value and (self.norm, self.mlp) != ("rmsnorm", "swiglu"):
            raise ValueError(
                "needs model.norm = rmsnorm and model.mlp = swiglu (qwen3's blocks, which the export writes)"
            )

    @n_kv_heads.validator
    @reads("n_heads")
    def _kv_heads_divide_heads(self, _: attrs.Attribute[Any], value: int) -> None:
        if self.n_heads % value:
            raise ValueError(
                f"{value} does not divide model.n_heads {self.n_heads}; choose a divisor of {self.n_heads}"
            )


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@attrs.frozen(kw_only=True)
class LoraConfig:
    """Low-rank adapters: only they train (the model's weights stay as they were) and only they
    have optimizer state; the export merges them into the weights and also writes them for peft."""

    rank: int = setting(8, "rank of each adapter", at_least(1))
    alpha: float = setting(16.0, "scale numerator: an adapter adds alpha / rank x B A", greater_than(0.0))
    dropout: float = setting(
        0.0, "dropout on an adapter's input (seeded per step and micro-batch)", at_least(0.0), below(1.0)
    )
    targets: tuple[str, ...] = setting(
        ("q", "k", "v", "o"),
        f"projections that get an adapter: any of {', '.join(LORA_TARGETS)}",
    )

    @targets.validator
    def _known_targets(self, _: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        unknown = [t for t in value if t not in LORA_TARGETS]
        if unknown or not value or len(set(value)) != len(value):
            raise ValueError(f"must be distinct names among {', '.join(LORA_TARGETS)} (got {list(value)})")


@attrs.frozen(kw_only=True)
class TrainConfig:
    """One training stage: optimizer, schedule, batch, length, seed and checkpoint cadence."""

    steps: int = setting(
        200,
        "optimizer steps; 0: no training, the stage's weights are those it starts from (model.init or "
        "init_from), evaluated and exported as they are",
        at_least(0),
    )
    seed: int = setting(0, "seed of initial weights, data order and dropout", at_least(0))
    seq_len: int = setting(64, "tokens per training sequence (packed, no padding)", at_least(2))
    batch_size: int = setting(16, "sequences per optimizer step", at_least(1))
    micro_batch_size: int = setting(16, "sequences per forward pass; must divide batch_size", at_least(1))
    reduction: str = setting(
        "invariant",
        "how micro-batch gradients are summed: invariant (a fixed tree: the same weights at any world "
        "size that divides the micro-batches) or allreduce (the world size enters the plan hash)",
        one_of("invariant", "allreduce"),
    )
    optimizer: str = setting("adamw", "optimizer", one_of("adamw"))
    lr: float = setting(3e-3, "peak learning rate", greater_than(0.0))
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas")
    eps: float = setting(1e-8, "AdamW epsilon", greater_than(0.0))
    weight_decay: float = setting(0.1, "decoupled weight decay (matrices only)", at_least(0.0))
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = off)", at_least(0.0))
    schedule: str = setting(
        "cosine", "learning-rate schedule after warmup", one_of("cosine", "linear", "constant")
    )
    warmup_steps: int = setting(20, "linear warmup steps", at_least(0))
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of lr", at_least(0.0), at_most(1.0))
    checkpoint_every: int = setting(50, "steps between checkpoints", at_least(1))
    keep_checkpoints: int = setting(2, "checkpoints kept (the last one is the final state)", at_least(1))
    digest_every: int = setting(
        1,
        "steps between weight fingerprints in the trace (the full state is digested at each checkpoint)",
        at_least(1),
    )
    lora: LoraConfig | None = since(
        setting(None, "train low-rank adapters only: { rank, alpha, dropout, targets = [...] }")
    )
    sharding: str = since(
        setting(
            "none",
            "none (every rank holds the whole model) or fsdp (weights, gradients and AdamW moments "
            "sharded across ranks with PyTorch's FSDP2; the same bits at any world size)",
            one_of("none", "fsdp"),
        )
    )
    activation_checkpointing: bool = since(
        setting(
            False,
            "keep no activations inside blocks: recompute them in the backward pass (less memory, ~1/3 more compute)",
        )
    )

    @betas.validator
    def _betas_in_range(self, _: attrs.Attribute[Any], value: tuple[float, float]) -> None:
        for beta in value:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"each beta must be in [0, 1) (got {list(value)})")

    @micro_batch_size.validator
    @reads("batch_size")
    def _micro_divides_batch(self, _: attrs.Attribute[Any], value: int) -> None:
        if self.batch_size % value:
            raise ValueError(
                f"{value} does not divide train.batch_size {self.batch_size}; "
                f"choose a divisor of {self.batch_size}"
            )
        if self.batch_size // value > MAX_MICRO_BATCHES:
            raise ValueError(
                f"{value} makes {self.batch_size // value:,} micro-batches per update, more than "
                f"{MAX_MICRO_BATCHES:,}; raise train.micro_batch_size or lower train.batch_size"
            )

    @sharding.validator
    @reads("reduction", "lora")
    def _sharding_sums_in_the_tree(self, _: attrs.Attribute[Any], value: str) -> None:
        if value == "fsdp" and self.reduction != "invariant":
            raise ValueError(
                'fsdp sums the gradient in the invariant tree; set train.reduction = "invariant"'
            )
        if value == "fsdp" and self.lora is not None:
            raise ValueError(
                'fsdp does not shard LoRA adapters yet; remove train.lora or set sharding = "none"'
            )

    @warmup_steps.validator
    @reads("steps")
    def _warmup_within_steps(self, _: attrs.Attribute[Any], value: int) -> None:
        if self.steps and value > self.steps:  # 0 steps: no schedule to warm up
            raise ValueError(f"{value} exceeds train.steps {self.steps}")


def world_size_problem(train: TrainConfig, world_size: int) -> str | None:
    """Why `world_size` processes cannot share this stage's micro-batches evenly, if they cannot.

    Not a field validator: the world size is a property of the run, not of the preset.
    """
    micro_batches = train.batch_size // train.micro_batch_size
    if micro_batches % world_size == 0:
        return None
    fitting = [n for n in range(1, micro_batches + 1) if micro_batches % n == 0]
    return (
        f"{train.batch_size} // {train.micro_batch_size} = {micro_batches} micro-batches per step cannot be "
        f"shared by {world_size} processes; use a world size in {fitting}, or a micro_batch_size that "
        f"makes the micro-batches a multiple of {world_size} (the batch stays the same; the plan hash changes)"
    )


@attrs.frozen(kw_only=True)
class SuiteConfig:
    """A benchmark suite: a named, versioned set of questions, given by content (never by path)."""

    name: str = setting(
        "", "required: the suite's name, unique in the preset; letters, digits, '.', '_', '-'"
    )
    version: int = setting(1, "the suite's version: results are cached under (name, version)", at_least(1))
    kind: str = setting(
        "multiple_choice",
        "multiple_choice: JSONL of {context, choices, answer}, scored by log-likelihood; exact_match: "
        "JSONL of {context, target}, scored by greedy generation; lm_eval: an lm-evaluation-harness "
        "task (`task`) on local data (`file`)",
        one_of(*SUITE_KINDS),
    )
    file: str | None = setting(None, "the suite's JSONL file, relative to the preset")
    task: str | None = setting(
        None,
        "lm_eval only: the harness's task YAML, relative to the preset; `file` is the split it evaluates",
    )
    max_overlap: int | None = setting(
        None,
        "refuse to report a score when more than this many questions are among the training documents "
        "(none: always report; the overlap is reported either way)",
        attrs.validators.optional(at_least(0)),
    )
    ngram: int | None = setting(
        None,
        "words per n-gram of the overlap check (none: 13, lm-eval's and GPT-3's); the ngrams steps of "
        "the stages the weights were trained on record a filter for each n the suites ask for",
        attrs.validators.optional(attrs.validators.and_(at_least(1), at_most(MAX_NGRAM))),
    )

    @name.validator
    def _safe_name(self, _: attrs.Attribute[Any], value: str) -> None:
        if not value:
            raise ValueError('is required: give each suite a name (name = "arithmetic")')
        problem = name_problem(value)
        if problem is not None:
            raise ValueError(problem)

    @file.validator
    @reads("kind")
    def _file_given(self, _: attrs.Attribute[Any], value: str | None) -> None:
        if value is None:
            raise ValueError(f'a {self.kind} suite reads a file; add file = "questions.jsonl"')

    @task.validator
    @reads("kind")
    def _task_for_the_harness(self, _: attrs.Attribute[Any], value: str | None) -> None:
        takes = "task" in suite_kind(self.kind).config_keys()
        if takes and value is None:
            raise ValueError(f'an {self.kind} suite runs a harness task; add task = "task.yaml"')
        if not takes and value is not None:
            runners = " or ".join(k.name for k in SUITE_KINDS.values() if "task" in k.config_keys())
            raise ValueError(
                f"only an {runners} suite runs a harness task; drop it from this {self.kind} suite"
            )


@attrs.frozen(kw_only=True)
class EvalConfig:
    """Held-out evaluation, after training and optionally during it."""

    suite: str = setting("heldout", "evaluation suite", one_of("heldout"))
    every: int = setting(0, "also evaluate every N training steps (0 = only after training)", at_least(0))
    seq_len: int = setting(64, "tokens per evaluation window", at_least(2))
    batch_size: int = setting(8, "windows per evaluation batch", at_least(1))
    max_batches: int = setting(
        0, "evaluate at most this many batches (0 = the whole held-out split)", at_least(0)
    )
    suites: tuple[SuiteConfig, ...] = setting(
        (),
        "benchmark suites evaluated on the final weights, beside the held-out loss: an array of "
        '{ name, version, kind, file } tables, e.g. [{ name = "arith", file = "arith.jsonl" }]',
    )
    subset: float = setting(
        1.0,
        "fraction of each suite's questions evaluated (drawn from eval.seed)",
        greater_than(0.0),
        at_most(1.0),
    )
    seed: int = setting(0, "seed of the subset drawn from each suite", at_least(0))
    checkpoints_every: int = renamed_from(
        "eval_every",
        setting(
            0,
            "also score each suite (on eval.subset) at every kept checkpoint whose update is a multiple of "
            "N, as soon as training seals it, in a process beside training: a curve in bt report and "
            "TensorBoard (0: the final weights only; eval.every is the held-out loss during training)",
            at_least(0),
        ),
    )

    @suites.validator
    def _unique_names(self, _: attrs.Attribute[Any], value: tuple[SuiteConfig, ...]) -> None:
        names = [suite.name for suite in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"suite names must be unique (repeated: {', '.join(repeated)})")


@attrs.frozen(kw_only=True)
class NumericsConfig:
    """How numbers are computed; enters the toolchain fingerprint, not the step configs."""

    profile: str = setting(
        "portable",
        "portable: same bits at any thread count on any x86-64 CPU with AVX2 and FMA, Intel or AMD; native: fastest, pinned to this machine",
        one_of("portable", "native"),
    )
    device: str = setting("cpu", "cpu or cuda", one_of("cpu", "cuda"))
    dtype: str = setting(
        "float32", "compute dtype: float32 or bfloat16 (autocast)", one_of("float32", "bfloat16")
    )
    compile: bool = setting(
        False,
        "run the train step's model through torch.compile: faster on a GPU, deterministic, but not "
        "the bits of eager execution, so it enters the train step's hash",
    )
    kernels: str = setting(
        "auto",
        "the model's element-wise work on the CPU: fused (C kernels, one pass each; built with the "
        "machine's C compiler, $CC or cc), eager (torch's operations: slower, other bits), or auto "
        "(fused where a C compiler is found); the plan's hash records which ran",
        one_of("auto", "fused", "eager"),
    )
    threads: int = setting(
        0,
        "cores to compute with (0 = all): under native, intra-op threads, pinned in the hash; under "
        "portable, single-threaded processes, which leave the hash and the bits unchanged",
        at_least(0),
        at_most(MAX_THREADS),
    )


@attrs.frozen(kw_only=True)
class ExportConfig:
    """The exported package: final weights, config, tokenizer description, checksums."""

    enabled: bool = setting(True, "add an export step to the plan")
    dtype: str = setting("float32", "dtype of the exported weights", one_of("float32", "bfloat16"))


@attrs.frozen(kw_only=True)
class Stage:
    """One resolved training stage: its name, its parent, and its fully merged data and train."""

    name: str = setting("main", "stage name, unique within the preset; letters, digits, '.', '_', '-'")
    init_from: str | None = setting(None, "an earlier stage whose final weights start this one")
    data: DataConfig = setting(attrs.Factory(DataConfig), "this stage's data")
    train: TrainConfig = setting(attrs.Factory(TrainConfig), "this stage's training")


@attrs.frozen(kw_only=True)
class Config:
    """A fully resolved preset: what a plan is compiled from."""

    name: str = setting(
        "unnamed",
        "a label for people (and the export folder); letters, digits, '.', '_', '-'; in the plan hash, "
        "not in step hashes",
    )
    model: ModelConfig = setting(attrs.Factory(ModelConfig), "the model")
    eval: EvalConfig = setting(attrs.Factory(EvalConfig), "evaluation")
    numerics: NumericsConfig = setting(attrs.Factory(NumericsConfig), "numerics profile")
    export: ExportConfig = setting(attrs.Factory(ExportConfig), "export")
    stages: tuple[Stage, ...] = setting((Stage(),), "training stages, in order")

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    @property
    def final_stage(self) -> Stage:
        """The stage that eval and export apply to: the last one."""
        return self.stages[-1]


# The sections of a preset file, in the order the reference documents them.
SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "numerics": NumericsConfig,
    "export": ExportConfig,
}
STAGE_KEYS = ("name", "init_from", "data", "train")
TOP_LEVEL_KEYS = ("name", "extends", *SECTIONS, "stages")
