"""Fine-tuning from a pretrained checkpoint: LoRA tokens/s against peft, and the import's cost.

A random llama checkpoint is written once by transformers (`save_pretrained`, nothing is
downloaded) with a byte-level BPE tokenizer, and a plain-text corpus beside it.

LoRA training throughput, contenders alternated round by round, each a fresh process with the
portable numerics environment and one thread (what a portable train step computes with):

  buildtrain   `bt run` of a LoRA preset on the checkpoint (rank 8, alpha 16, targets q, k, v,
               o), data step built once before the rounds; tokens/s is the median of the
               run's train_step events after the first few updates (common.updates_per_second).
  peft         the same checkpoint through transformers with `peft.get_peft_model` (the same
               LoRA settings), torch.optim.AdamW over the adapters, the same batch, micro-batch,
               sequence length and gradient clipping, random windows of random tokens; timed
               in-process from the end of the warm-up updates to the last update.

Import cost, alternated: `bt run --target import_hf` of a plan in a fresh store (planning done
before, not timed), its wall time and the import step's own duration from the run record (its
process from start to the sealed output: reading and checking the files while their tensors are
written to their places, digesting, sealing), against a fresh process that reads the same
safetensors files with the safetensors library (`safetensors.deserialize`: every tensor's bytes,
no torch; `safetensors.torch.load_file` would add torch's import, about a second here, to the
reader). The checkpoint is stored in bfloat16, as published ones usually are; the import keeps
the dtype (training widens it). Each round writes into a new store, so the output always takes
new page-cache pages, as a first import does; on this VM that dominates the noise (320 MB
written through the page cache took 0.1 s on one day and 0.75 s on the next, the disk itself
about 0.1 s with O_DIRECT).

Goals: LoRA tokens/s >= 1.0 x peft's; the import step's time <= 2 x the reading process's.

Run: python benchmarks/finetune.py [--quick] [--part lora|import]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    Workspace,
    alternate,
    fmt_ratio,
    fmt_seconds,
    fmt_spread,
    goal_line,
    make_parser,
    median,
    note,
    print_goals,
    print_header,
    print_table,
    ratio,
    rounds,
    time_process,
    updates_per_second,
    workspace,
)

LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q", "k", "v", "o"]}
TRAIN = {"seq_len": 128, "batch_size": 8, "micro_batch_size": 4}
# (hidden, layers, heads, kv heads, intermediate, vocab): the trained model; the imported one
SHAPES = {
    "quick": ((256, 4, 4, 2, 688, 2048), (512, 4, 8, 4, 1376, 8192)),
    "full": ((512, 6, 8, 4, 1376, 4096), (1024, 8, 16, 8, 2816, 32000)),
}


def make_checkpoint(folder: Path, shape: tuple[int, ...], dtype: str) -> None:
    """A random llama checkpoint and a BPE tokenizer (transformers' own save_pretrained)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hidden, layers, heads, kv_heads, intermediate, vocab = shape
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [f"line {i}: {i} + {i * 7} = {i * 8}, the quick brown fox {i % 13}" for i in range(4000)]
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab, 2048),
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text, trainer=trainer)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    corpus = folder.parent.parent / "corpus.txt"  # beside the presets, in the workspace
    if not corpus.exists():
        corpus.write_text("\n".join(text * 3) + "\n")


PRESET = """\
name = "finetune-bench"
[model]
init = {{ hf = "{folder}" }}
[data]
source = "files"
files = ["corpus.txt"]
split_block = 4096
[train]
steps = {steps}
lr = 1e-3
warmup_steps = 0
checkpoint_every = {steps}
seq_len = {seq_len}
batch_size = {batch_size}
micro_batch_size = {micro_batch_size}
lora = {{ rank = {rank}, alpha = {alpha}, dropout = {dropout}, targets = {targets} }}
[eval]
max_batches = 1
[export]
enabled = false
"""

PEFT_LOOP = """
import json, sys, time, torch, transformers, peft
folder, steps, settings = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
lora = settings["lora"]
names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
config = peft.LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                         target_modules=[names[t] for t in lora["targets"]], task_type="CAUSAL_LM")
model = peft.get_peft_model(model, config).train()
trained = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(trained, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
train = settings["train"]
micro, seq = train["micro_batch_size"], train["seq_len"]
count = train["batch_size"] // micro
generator = torch.Generator().manual_seed(0)
vocab = model.config.vocab_size
marks = []
for step in range(steps):
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=generator)
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / count
        loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks.append(time.perf_counter())
warm = settings["warm"]
print(json.dumps({"tokens_per_s": train["batch_size"] * seq * (steps - 1 - warm) / (marks[-1] - marks[warm])}))
"""

READ_FILES = """
import sys, safetensors
for path in sys.argv[1:]:
    with open(path, "rb") as handle:
        safetensors.deserialize(handle.read())
"""


def preset(space: Workspace, folder: Path, steps: int) -> Path:
    path = space.path(f"lora-{steps}.toml")
    targets = json.dumps(LORA["targets"])
    path.write_text(
        PRESET.format(
            folder=folder,
            steps=steps,
            targets=targets,
            **TRAIN,
            **{k: v for k, v in LORA.items() if k != "targets"},
        )
    )
    return path


def lora_throughput(space: Workspace, args: Any, n: int) -> dict[str, list[float]]:
    from buildtrain.executor.process import numerics

    steps = 12 if args.quick else 30
    folder = space.path("train-checkpoint", "hf")
    make_checkpoint(folder, SHAPES["quick" if args.quick else "full"][0], "float32")
    path = preset(space, folder, steps)
    environment = numerics.environment("portable", "cpu", 1)
    plan = space.plan(path)
    space.run_bt("run", plan, "--target", "data:main", "--progress", "off")
    seeds = iter(range(1, 1_000_000))

    def ours() -> float:
        seeded = space.plan(path, f"train.seed={next(seeds)}")
        experiments = space.path("experiments", seeded[:12])
        space.run_bt(
            "run", seeded, "--threads", "1", "--progress", "off", experiments=experiments, env=environment
        )
        return updates_per_second(experiments)

    def theirs() -> float:
        settings = json.dumps({"lora": LORA, "train": TRAIN, "warm": 3})
        argv = [sys.executable, "-c", PEFT_LOOP, str(folder), str(steps), settings]
        _, done = time_process(argv, env=space.env(**environment), cwd=space.root)
        return float(json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"])

    return alternate([("buildtrain LoRA", ours), ("peft LoRA (plain loop)", theirs)], n)


def step_seconds(experiments: Path, label: str) -> float:
    """How long the run record says a step took (its process, from start to publishing)."""
    (record,) = experiments.iterdir()
    summary = json.loads((record / "summary.json").read_text())
    return float(next(step["duration_s"] for step in summary["steps"] if step["label"] == label))


def import_cost(space: Workspace, args: Any, n: int) -> tuple[dict[str, list[float]], int]:
    folder = space.path("import-checkpoint", "hf")
    make_checkpoint(folder, SHAPES["quick" if args.quick else "full"][1], "bfloat16")
    shards = sorted(str(p) for p in folder.glob("*.safetensors"))
    size = sum(Path(p).stat().st_size for p in shards)
    path = preset(space, folder, 1)
    counter = iter(range(1_000_000))
    steps: list[float] = []

    def ours() -> float:
        store = space.path("stores", str(next(counter)))
        plan = space.plan(path, store=store)  # planning (and hashing the files) is not timed
        experiments = space.path("experiments", f"import-{store.name}")
        seconds, _ = space.run_bt(
            "run", plan, "--target", "import_hf", "--progress", "off", store=store, experiments=experiments
        )
        steps.append(step_seconds(experiments, "import_hf"))
        return seconds

    def reading() -> float:
        seconds, _ = time_process(
            [sys.executable, "-c", READ_FILES, *shards], env=space.env(), cwd=space.root
        )
        return seconds

    results = alternate(
        [("bt run --target import_hf", ours), ("reading: safetensors.deserialize", reading)], n
    )
    results["import_hf step (run record)"] = steps[-n:]
    return results, size


def report_lora(space: Workspace, args: Any, n: int) -> str:
    note("LoRA: building the checkpoint and the data step once")
    lora = lora_throughput(space, args, n)
    ours, theirs = median(lora["buildtrain LoRA"]), median(lora["peft LoRA (plain loop)"])
    print_table(
        f"LoRA tokens/s (portable, one thread, {n} rounds)",
        ["contender", "median tokens/s", "spread", "ratio"],
        [
            [
                name,
                f"{median(v):,.0f}",
                fmt_spread(v, lambda x: f"{x:,.0f}"),
                fmt_ratio(ratio(median(v), theirs)),
            ]
            for name, v in lora.items()
        ],
    )
    return goal_line("LoRA tokens/s >= 1.0x peft's", ours >= theirs, fmt_ratio(ratio(ours, theirs)))


def report_import(space: Workspace, args: Any, n: int) -> str:
    note("import: building a bfloat16 checkpoint")
    cost, size = import_cost(space, args, n)
    step = median(cost["import_hf step (run record)"])
    read = median(cost["reading: safetensors.deserialize"])
    print_table(
        f"import of {size / 1e6:.0f} MB of bfloat16 safetensors ({n} rounds, fresh processes)",
        ["contender", "median", "spread", "ratio"],
        [
            [name, fmt_seconds(median(v)), fmt_spread(v), fmt_ratio(ratio(median(v), read))]
            for name, v in cost.items()
        ],
    )
    return goal_line("import step <= 2x reading the files", step <= 2 * read, fmt_ratio(ratio(step, read)))


def main() -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--part", choices=("lora", "import"), help="measure one part only")
    args = parser.parse_args()
    n = rounds(args, quick=3, full=5)
    parts = {"lora": report_lora, "import": report_import}
    with workspace("finetune", args) as space:
        print_header("fine-tuning: LoRA throughput against peft, import against reading", args, space)
        space.import_buildtrain()
        print_goals([report(space, args, n) for name, report in parts.items() if args.part in (None, name)])
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    note(f"done in {time.perf_counter() - started:.0f} s")
    sys.exit(code)
