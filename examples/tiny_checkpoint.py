"""Write a tiny random Hugging Face checkpoint for examples/finetune_lora.toml: a qwen2 model
(grouped-query attention, q/k/v biases) made by transformers' own `save_pretrained`, with a
byte-level BPE tokenizer and a ChatML-style chat template. Nothing is downloaded.

    python examples/tiny_checkpoint.py examples/checkpoint     # needs the test extra (transformers)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(folder: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [f"What is {a} + {b}? {a} + {b} = {a + b}" for a in range(40) for b in range(40)]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text, trainer=trainer)
    config = transformers.Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.token_to_id("<|endoftext|>"),
        # Weights 5x transformers' 0.02: LoRA leaves the tied embedding and the final norm frozen,
        # which bound every logit by |norm output| x |embedding row| (8 x 0.16 at 0.02); there the
        # example's loss stayed at 5.3 after 60 steps at any lr tried, 3e-3 to 2e-2 (issue 48).
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", chat_template=TEMPLATE
    )
    fast.save_pretrained(folder)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/checkpoint"))
