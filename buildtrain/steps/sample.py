"""`bt sample`: text from a built plan's exported weights.

Reads only the export package (weights, config, and the tokenizer in hf/), each verified against
its manifest first. One convention with the exported tokenizer: the prompt is encoded exactly as
`AutoTokenizer.from_pretrained("hf")(prompt)` encodes it (no token added in front), so greedy
`bt sample` and greedy `model.generate` in transformers continue a prompt with the same text; an
empty prompt starts from the end-of-document token, the `bos_token_id` transformers starts from
when given no input. Generation ends after `tokens` tokens, at an end-of-document token, or at
the model's context (the training sequence length), whichever comes first, and says which.
One thread: the same seed gives the same text on any machine the plan reproduces on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import UsageError

# Below this a temperature divides float32 logits into infinities (1e-39 did); 0 means greedy.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a 64-bit seed


def _temperature(_: object, __: object, value: float) -> None:
    if not (value == 0.0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise ValueError(f"temperature must be 0 or in {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, got {value}")


@attrs.frozen(kw_only=True)
class SampleOptions:
    prompt: str = ""
    tokens: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    temperature: float = attrs.field(default=0.8, validator=_temperature)
    top_k: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    seed: int = attrs.field(default=0, validator=[attrs.validators.ge(0), attrs.validators.le(MAX_SEED)])


@attrs.frozen(kw_only=True)
class Sampled:
    """What `bt sample` generated after the prompt, and why it stopped."""

    text: str
    prompt_tokens: int
    tokens: int  # generated
    context: int  # the model's context: prompt and generated tokens together
    stop: str = attrs.field(validator=attrs.validators.in_(("tokens", "end of document", "context")))


def prompt_ids(tokenizer: Any, prompt: str, end: int, context: int) -> list[int]:
    """The prompt as the exported tokenizer encodes it (the end-of-document token alone when
    empty); refuses a prompt that leaves no room in the context."""
    ids = tokenizer.encode(prompt).ids or [end]
    if len(ids) >= context:
        raise UsageError(
            f"--prompt is {len(ids)} tokens; the model's context is {context} tokens (prompt and "
            f"generated text together): give a prompt of at most {context - 1} tokens"
        )
    return ids


def sample(folder: Path, options: SampleOptions) -> Sampled:
    """The text the export package in `folder` generates after `options.prompt` (the prompt itself
    not included)."""
    from tokenizers import Tokenizer

    hf_config = json.loads((folder / "hf" / "config.json").read_bytes())
    tokenizer = Tokenizer.from_file(str(folder / "hf" / "tokenizer.json"))
    end, context = hf_config["eos_token_id"], hf_config["max_position_embeddings"]
    prompt = prompt_ids(tokenizer, options.prompt, end, context)
    room = min(options.tokens, context - len(prompt))
    ids = _generate(folder, hf_config["vocab_size"], prompt, room, options, end)
    stop = "tokens" if len(ids) == options.tokens else "end of document" if len(ids) < room else "context"
    return Sampled(
        text=tokenizer.decode(ids), prompt_tokens=len(prompt), tokens=len(ids), context=context, stop=stop
    )


def _generate(
    folder: Path, vocab: int, prompt: list[int], tokens: int, options: SampleOptions, end: int
) -> list[int]:
    import torch

    from buildtrain.steps.train.generate import generate

    torch.set_num_threads(1)
    model = package_model(folder, vocab)
    return generate(model, prompt, tokens, options.temperature, options.top_k, options.seed, stop=end)


def package_model(folder: Path, vocab: int) -> Any:
    """The export package's model (its weights verified by the caller), in eval mode."""
    import torch

    from buildtrain.config.convert import converter
    from buildtrain.config.schema import ModelConfig
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.state import load_model

    config = json.loads((folder / "config.json").read_bytes())
    model = Transformer.build(converter.structure(config["model"], ModelConfig), vocab, torch.Generator())
    load_model(model, folder / "model.safetensors")
    model.eval()
    return model
