"""Tiny random Hugging Face checkpoints, made by transformers itself (`save_pretrained`), for the
import and fine-tuning tests: nothing is downloaded. Every weight is random, norm gains and
biases included, so that a wrong mapping of any tensor changes the logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "12 + 34 = 46",
    "a checkpoint is read by content, never by path",
] * 20
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
PADDING = 5  # the embedding has more rows than the tokenizer has ids, as real checkpoints often do


def tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE with the chat and end-of-text special tokens."""
    made = Tokenizer(models.BPE())
    made.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    made.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    made.train_from_iterator(TEXT, trainer=trainer)
    return made


def make_checkpoint(
    folder: Path,
    architecture: str = "llama",
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **settings: Any,
) -> transformers.PreTrainedModel:
    """A checkpoint folder (config.json, model.safetensors, tokenizer files); returns the model.
    `settings` are further config keys (rope_scaling, head_dim, ...), or replace those above."""
    made = tokenizer()
    config_class, model_class = CONFIGS[architecture]
    keys = {
        "vocab_size": made.get_vocab_size() + PADDING,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "tie_word_embeddings": tie,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500.0,
        "max_position_embeddings": 128,
        "eos_token_id": made.token_to_id("<|endoftext|>"),
        "bos_token_id": made.token_to_id("<|endoftext|>"),
    }
    config = config_class(**{**keys, **settings})
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # gains and biases: not ones and zeros
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    model = model.to(dtype).eval()
    model.save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=made, eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(folder)
    return model
