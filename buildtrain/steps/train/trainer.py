"""The training loop of one stage, resumable bit for bit.

Per update: forward, loss, backward (once per micro-batch, summed in a fixed order), gradient
clipping, optimizer step, zero grads, log. Everything random is a pure function of (seed, purpose,
counters): the initial weights, the data order and dropout. So the state a checkpoint must hold is
the weights, the optimizer moments and two integers, and a resume cannot get the randomness wrong.
"""

from __future__ import annotations

import contextlib
import math
import resource
import signal
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from buildtrain.config.schema import BYTE_VOCAB_SIZE, EvalConfig, ModelConfig, TrainConfig
from buildtrain.errors import Interrupted, StepFailed
from buildtrain.steps.heldout import evaluate
from buildtrain.steps.seeds import derive_seed
from buildtrain.steps.train import checkpoint
from buildtrain.steps.train.batches import Batches, TokenStream
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.ranks import Ranks
from buildtrain.steps.train.reduce import cover, flatten, tree_sum, unflatten
from buildtrain.steps.train.schedule import learning_rate
from buildtrain.steps.train.state import checksums, digests, load_model, state_tensors
from buildtrain.store.tensors import combine

TENSOR_DIGEST_CHARS = 16


def float_bits(value: float) -> str:
    """The exact float32 bit pattern of a value, as hex: the trace compares bits, not decimals."""
    return struct.pack(">f", value).hex()


def seeded(seed: int, purpose: str, *counters: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one purpose; on the device that draws from it (CUDA kernels refuse a CPU one)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, purpose, *counters))
    return generator


@attrs.frozen(kw_only=True)
class TrainJob:
    """What one train step needs: its typed config sections and where its inputs and state live."""

    model: ModelConfig
    train: TrainConfig
    eval: EvalConfig | None
    device: str
    dtype: str
    compile: bool = False  # the forward pass through torch.compile (numerics.compile)
    data: tuple[Path, dict[str, Any]]  # the data step's output folder and its index
    init_weights: Path | None
    work: Path  # checkpoints of this step in progress
    identity: dict[str, Any]  # what a checkpoint must match to be resumed (the step hash)


@attrs.frozen(kw_only=True)
class Hooks:
    """Deliberate faults and limits, used by `bt verify` and by the test suite."""

    kill_after: tuple[int, ...] = ()  # checkpoint, then SIGKILL this process after these updates
    kill_in_checkpoint: int | None = None  # SIGKILL while writing this checkpoint
    step_delay: float = 0.0  # seconds to sleep per update, to make signals land mid-run in tests
    perturb: tuple[int, str, float] | None = None  # (update, tensor, delta): inject a difference
    skip_cursor_restore: bool = False  # negative control: a resume that forgets the data cursor
    stop_after: int | None = None  # spot checks: train only this many updates
    kill_rank: tuple[int, int] | None = None  # (rank, update): that rank SIGKILLs itself, no checkpoint


@attrs.define
class StopRequest:
    """Set by SIGINT/SIGTERM; the loop finishes the update in flight, checkpoints and exits."""

    signal_name: str | None = None

    def install(self) -> None:
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, self._handle)

    def _handle(self, number: int, _: object) -> None:
        self.signal_name = signal.Signals(number).name


@attrs.frozen
class TrainResult:
    steps_done: int
    trace: list[dict[str, Any]]
    resumed_from: int


Watch = Callable[[dict[str, Any], dict[str, torch.Tensor]], bool]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices, not gains and biases."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]


def out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA OOM error, or the CPU allocator's failure (a RuntimeError)."""
    return type(exc).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(exc)


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def out_of_memory_fails(step: int, work: Path) -> Iterator[None]:
    """Turn an allocation failure during an update into a step failure that names the update."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not out_of_memory(exc):
            raise
        raise StepFailed(
            f"out of memory at step {step} (newest checkpoint: {newest(work)}, intact); "
            "lower train.micro_batch_size (the batch stays the same) or train.seq_len"
        ) from None


def newest(folder: Path) -> str:
    saved = checkpoint.candidates(folder)
    return saved[0][1].name if saved else "none"


def trace_entry(
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    cursor: int,
    model: torch.nn.Module,
    optimizer: AdamW,
    cfg: TrainConfig,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The deterministic record of one update (and the tensors it digested).

    Weights are digested every `digest_every` updates, the whole state (weights and AdamW moments)
    at every regular checkpoint step and at the end. Only the cadence decides, never an
    interruption, so the trace of a resumed run equals that of an uninterrupted one. Between
    checkpoints, weights on a GPU are checksummed where they are (`state.checksums`) instead of
    copied to the host for blake3.
    """
    entry: dict[str, Any] = {
        "step": step,
        "loss": float_bits(loss),
        "grad_norm": float_bits(grad_norm),
        "lr": lr,
        "cursor": cursor,
    }
    full = step % cfg.checkpoint_every == 0 or step == cfg.steps
    if not (full or step % cfg.digest_every == 0):
        return entry, {}
    tensors = state_tensors(model, optimizer if full else None)
    on_host = full or next(model.parameters()).device.type == "cpu"
    tensor_digests = digests(tensors) if on_host else checksums(tensors)
    entry["weights"] = combine({k: v for k, v in tensor_digests.items() if k.startswith("model.")})
    if full:
        entry["state"] = combine(tensor_digests)
    entry["tensors"] = {k: v[:TENSOR_DIGEST_CHARS] for k, v in tensor_digests.items()}
    return entry, tensors


def batch_gradient(
    model: torch.nn.Module,
    batches: Batches,
    cursor: int,
    step: int,
    job: TrainJob,
    device: torch.device,
    autocast: Any,
    ranks: Ranks,
) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches, then the reduction `train.reduction`
    names; leaves the batch gradient in `.grad` on every rank and returns the batch loss."""
    cfg = job.train
    micro_batches = cfg.batch_size // cfg.micro_batch_size
    parameters = list(model.parameters())

    def backward(micro: int) -> torch.Tensor:
        x, y = batches.micro_batch(cursor, micro, cfg.micro_batch_size)
        if device.type == "cuda":  # copied from page-locked memory, without waiting for the GPU
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        else:
            x, y = x.to(device), y.to(device)
        generator = seeded(cfg.seed, "dropout", step, micro, device=device) if job.model.dropout else None
        with autocast:
            logits = model(x, generator)  # (B, T, vocab)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / micro_batches
        loss.backward()
        return loss.detach()

    first, end = ranks.share(micro_batches)
    if cfg.reduction == "allreduce":
        loss_sum = torch.zeros((), device=device)
        for micro in range(first, end):
            loss_sum += backward(micro)  # autograd adds each micro-batch into .grad, in order
        if ranks.world == 1:
            return loss_sum
        return unflatten(ranks.sum(flatten(parameters, loss_sum)), parameters)

    def leaf(micro: int) -> torch.Tensor:
        for parameter in parameters:
            parameter.grad = None  # each micro-batch's gradient on its own, for the tree to sum
        return flatten(parameters, backward(micro))

    partials = {node: tree_sum(node, leaf) for node in cover((0, micro_batches), first, end)}
    return unflatten(ranks.finish_tree(partials, micro_batches), parameters)


def train(
    job: TrainJob,
    log: Any,
    stop: StopRequest,
    hooks: Hooks,
    watch: Watch | None = None,
    ranks: Ranks | None = None,
) -> TrainResult:
    """Train one stage to the end, resuming from its newest checkpoint. With several ranks, every
    rank runs this loop in step; rank 0 alone reads and writes checkpoints and keeps the trace."""
    cfg = job.train
    ranks = ranks or Ranks()
    device = torch.device(job.device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.dtype == "bfloat16")

    data_dir, index = job.data
    vocab_size = index.get("tokenizer", {}).get("vocab_size", BYTE_VOCAB_SIZE)  # the tokenizer's
    model = Transformer.build(job.model, vocab_size, seeded(cfg.seed, "init"))
    if job.init_weights is not None:
        load_model(model, job.init_weights)  # a later stage starts from its parent's final weights
    model.to(device)
    optimizer = AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    batches = Batches(
        TokenStream(data_dir, index["splits"]["train"]), cfg.seq_len, derive_seed(cfg.seed, "data")
    )
    evaluating = job.eval is not None and ranks.lead
    heldout = TokenStream(data_dir, index["splits"]["heldout"]) if evaluating else None
    tokens_per_step = cfg.batch_size * cfg.seq_len

    step, cursor, trace = 0, 0, checkpoint.Trace()
    resumed = None
    if ranks.lead:
        resumed = checkpoint.load_newest(
            job.work,
            model,
            optimizer,
            job.identity,
            on_skip=lambda path, why: log.warning("checkpoint_skipped", checkpoint=path.name, reason=why),
        )
    if resumed is not None:
        step, trace = resumed.step, resumed.trace
        cursor = 0 if hooks.skip_cursor_restore else resumed.state["cursor"]
        log.info("resumed", step=step, checkpoint=resumed.path.name, world_size=ranks.world)
    step, cursor = ranks.share_state(model, optimizer, [step, cursor])
    resumed_from = step
    last = cfg.steps if hooks.stop_after is None else min(cfg.steps, hooks.stop_after)

    def save(at: int, *, kill_midway: bool = False) -> None:
        if not ranks.lead:
            return
        state = {**job.identity, "step": at, "cursor": cursor, "tokens": at * tokens_per_step}
        path = checkpoint.save(job.work, at, model, optimizer, state, trace, kill_midway=kill_midway)
        checkpoint.prune(job.work, cfg.keep_checkpoints)
        log.info("checkpoint_saved", step=at, checkpoint=path.name)

    def keep_record(at: int, loss_value: float, grad_norm: float, lr: float, started: float) -> bool:
        """Rank 0's part of an update: trace, evaluate, log, watch. True: the watcher says stop."""
        entry, tensors = trace_entry(at, loss_value, grad_norm, lr, cursor, model, optimizer, cfg)
        trace.append(entry)
        if heldout is not None and job.eval is not None and at % job.eval.every == 0:
            result = evaluate(model, heldout, job.eval, device, autocast)
            trace.append({"step": at, "eval": result})
            log.info("eval", step=at, **result)
            model.train()
        log.info(
            "train_step",
            step=at,
            steps=cfg.steps,
            loss=round(loss_value, 6),
            lr=lr,
            grad_norm=round(grad_norm, 6),
            tokens_per_s=round(tokens_per_step / (time.perf_counter() - started), 1),
            max_rss_mb=round(max_rss_mb(), 1),
        )
        return watch is not None and watch(entry, tensors or state_tensors(model, optimizer))

    # Compiled: the same parameters, a generated forward and backward (imports torch._dynamo, so
    # only when asked for).
    compute = torch.compile(model) if job.compile else model
    model.train()
    while step < last:
        started = time.perf_counter()
        step += 1
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        with out_of_memory_fails(step, job.work):
            loss_sum = batch_gradient(compute, batches, cursor, step, job, device, autocast, ranks)
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            loss_value, grad_norm = torch.stack([loss_sum.float(), norm.float()]).tolist()  # one sync
            if not math.isfinite(loss_value):
                raise StepFailed(
                    f"loss is {loss_value} at step {step}; nothing was written for this step "
                    f"(newest checkpoint: {newest(job.work)}). "
                    "Lower train.lr or raise train.warmup_steps."
                )
            optimizer.step()
            optimizer.zero_grad()
        cursor += cfg.batch_size

        if hooks.perturb is not None and hooks.perturb[0] == step:
            with torch.no_grad():
                dict(model.named_parameters())[hooks.perturb[1]].view(-1)[0] += hooks.perturb[2]
        if hooks.kill_rank is not None and hooks.kill_rank == (ranks.rank, step):
            log.info("hard_kill", step=step, rank=ranks.rank)
            signal.raise_signal(signal.SIGKILL)  # no checkpoint: the other ranks must cope

        watched = ranks.lead and keep_record(step, loss_value, grad_norm, lr, started)
        if hooks.step_delay:
            time.sleep(hooks.step_delay)
        stopping, watched = ranks.any(stop.signal_name is not None, watched)
        if watched:
            return TrainResult(step, trace.entries, resumed_from)  # a spot check or a divergence ends here

        if step in hooks.kill_after:
            save(step)
            log.info("hard_kill", step=step)
            signal.raise_signal(signal.SIGKILL)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
            save(step, kill_midway=hooks.kill_in_checkpoint == step)
        if stopping:
            signal_name = stop.signal_name or "a signal to another rank"
            raise Interrupted(f"stopped by {signal_name} after step {step}; checkpoint written")
    return TrainResult(step, trace.entries, resumed_from)
