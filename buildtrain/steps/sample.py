"""`bt sample`: text from a built plan's exported weights.

Reads only the export package (weights, config, and the tokenizer in hf/), each verified against
its manifest first; the prompt follows an end-of-document token, as every document in training
did. One thread: the same seed gives the same text on any machine the plan reproduces on.
"""

from __future__ import annotations

import json

import attrs

from buildtrain.plan.plan import Plan
from buildtrain.steps.export import built_export
from buildtrain.store.store import Store


@attrs.frozen(kw_only=True)
class SampleOptions:
    prompt: str = ""
    tokens: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    temperature: float = attrs.field(default=0.8, validator=attrs.validators.ge(0.0))
    top_k: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    seed: int = 0


def sample(store: Store, plan: Plan, options: SampleOptions) -> str:
    """The text generated after `options.prompt` (the prompt itself not included)."""
    import torch
    from tokenizers import Tokenizer

    from buildtrain.config.convert import converter
    from buildtrain.config.schema import ModelConfig
    from buildtrain.steps.train.generate import generate
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.state import load_model

    folder = built_export(store, plan, "; enable it to sample")
    torch.set_num_threads(1)
    config = json.loads((folder / "config.json").read_bytes())
    hf_config = json.loads((folder / "hf" / "config.json").read_bytes())
    tokenizer = Tokenizer.from_file(str(folder / "hf" / "tokenizer.json"))
    model = Transformer.build(
        converter.structure(config["model"], ModelConfig), hf_config["vocab_size"], torch.Generator()
    )
    load_model(model, folder / "model.safetensors")
    model.eval()
    end = hf_config["eos_token_id"]
    prompt = [end, *tokenizer.encode(options.prompt, add_special_tokens=False).ids]
    ids = generate(model, prompt, options.tokens, options.temperature, options.top_k, options.seed, stop=end)
    return tokenizer.decode(ids)
