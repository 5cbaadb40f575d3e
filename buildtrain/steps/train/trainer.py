"""The training loop of one stage, resumable bit for bit.

Per update: forward, loss, backward (once per micro-batch, summed in a fixed order), gradient
clipping, optimizer update, zero grads, record. Everything random is a pure function of (seed,
purpose, counters): the initial weights, the data order and dropout. So the state a checkpoint must
hold is the weights, the optimizer moments and two integers, and a resume cannot get the
randomness wrong. Faults and watchers reach the loop only through its observer (`observer.py`).

An update's line (its loss checked, its record, its log) is made while the next update computes,
once that update's forward and backward are queued (`arriving.py`): a GPU then never waits for
the host's share of an update. Where something must see the line first (a checkpoint, an
evaluation, the last update, an observer that reads each line), it is made at once.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch

from buildtrain.errors import Interrupted
from buildtrain.steps.data.index import embedding_rows
from buildtrain.steps.seeds import derive_seed
from buildtrain.steps.train import checkpoint
from buildtrain.steps.train.arriving import Arriving, Waiting
from buildtrain.steps.train.batches import Batches, TokenStream
from buildtrain.steps.train.controls import TrainControls
from buildtrain.steps.train.gradient import batch_gradient, seeded
from buildtrain.steps.train.heldout import evaluate
from buildtrain.steps.train.lora import add_adapters
from buildtrain.steps.train.memory import held_bytes, max_rss_mb, out_of_memory_fails
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.record import RECORD_EVERY, Recorder, recorded_state, update_entry
from buildtrain.steps.train.schedule import checkpoint_due, learning_rate
from buildtrain.steps.train.setup import TrainSetup
from buildtrain.steps.train.sharding import Sharded, require_shared_folder
from buildtrain.steps.train.state import load_model, state_tensors
from buildtrain.store.layout import SHARDS, checkpoint_name


@attrs.frozen
class TrainResult:
    updates_done: int
    trace: checkpoint.Trace  # `trace.whole()` reads it back from update 1
    # The observer ended training (a spot check or a divergence), perhaps at the last update,
    # before that update's checkpoint: there is nothing complete to publish.
    stopped: bool = False


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices, not gains and biases; only what trains (with LoRA: only the adapters, so
    the optimizer holds no state for the frozen weights)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in trained if p.dim() >= 2]
    vectors = [p for p in trained if p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]


@attrs.define
class Training:
    """One stage's training in progress on this rank: the model, its optimizer, its data, and
    where the loop stands (the update done last, the data cursor, rank 0's trace)."""

    setup: TrainSetup
    log: Any
    controls: TrainControls
    device: torch.device
    autocast: Any
    model: Transformer
    optimizer: AdamW
    batches: Batches
    heldout: TokenStream | None  # rank 0 (sharded: every rank) evaluates during training (eval.every > 0)
    heldout_masks: TokenStream | None  # chat records: only completion tokens are scored
    sharded: Sharded | None = None  # train.sharding = "fsdp": this rank holds a shard of the state
    update: int = 0
    cursor: int = 0
    trace: checkpoint.Trace = attrs.Factory(lambda self: checkpoint.Trace(self.setup.work), takes_self=True)
    recorder: Recorder = attrs.Factory(lambda self: Recorder.of(self.model), takes_self=True)
    frozen_file: checkpoint.FrozenFile = attrs.Factory(checkpoint.FrozenFile)  # LoRA: linked, not rewritten
    waiting: Waiting | None = None  # the update done last, its line not made yet (`arriving.py`)

    @classmethod
    def start(cls, setup: TrainSetup, log: Any, controls: TrainControls) -> Training:
        """Fresh weights from the seed (or the parent stage's), then the newest checkpoint if any:
        every rank leaves with rank 0's state."""
        cfg, ranks = setup.train, controls.ranks
        device = torch.device(setup.device)
        model = Transformer.build(
            setup.model, embedding_rows(setup.model, setup.index), seeded(cfg.seed, "init")
        )
        if setup.init_weights is not None:
            load_model(model, setup.init_weights)  # a later stage starts from its parent's final weights
        if cfg.lora is not None:  # after the weights: the adapters are drawn from their own generator
            add_adapters(model, cfg.lora, setup.model, seeded(cfg.seed, "lora"))
        model.to(device)
        model.checkpointing = cfg.activation_checkpointing
        micro_batches = cfg.batch_size // cfg.micro_batch_size
        sharded = None
        if cfg.sharding == "fsdp":
            sharded = Sharded(model, ranks, device, micro_batches)
            require_shared_folder(ranks, setup.work)
        optimizer = AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        splits = setup.index["splits"]
        evaluating = (
            setup.eval is not None and setup.eval.every > 0 and (ranks.lead or cfg.sharding == "fsdp")
        )
        training = cls(
            setup=setup,
            log=log,
            controls=controls,
            device=device,
            autocast=torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.dtype == "bfloat16"),
            model=model,
            optimizer=optimizer,
            sharded=sharded,
            batches=Batches(
                TokenStream(setup.data, splits["train"]),
                cfg.seq_len,
                derive_seed(cfg.seed, "data"),
                masks=TokenStream(setup.data, splits["train"], "masks")
                if "masks" in splits["train"]
                else None,
            ),
            heldout=TokenStream(setup.data, splits["heldout"]) if evaluating else None,
            heldout_masks=(
                TokenStream(setup.data, splits["heldout"], "masks")
                if evaluating and "masks" in splits["heldout"]
                else None
            ),
        )
        if ranks.lead:
            training.resume()
        counters = [training.update, training.cursor]
        if sharded is None:
            training.update, training.cursor = ranks.share_state(model, optimizer, counters)
            return training
        # Sharded: every rank built the same weights from the seed, and reads its own rows of
        # the checkpoint rank 0 chose (at whatever world size it was written).
        training.update, training.cursor = ranks.share_counters(counters)
        if training.update > 0:
            sharded.load(setup.work / checkpoint_name(training.update) / SHARDS, model, optimizer)
        return training

    def resume(self) -> None:
        """Rank 0: continue from the newest checkpoint that verifies and is this step's own."""
        resumed = checkpoint.load_newest(
            self.setup.work,
            None if self.sharded is not None else self.model,  # sharded: every rank loads its rows
            self.optimizer,
            self.setup.identity,
            on_skip=lambda path, why: self.log.warning(
                "checkpoint_skipped", checkpoint=path.name, reason=why
            ),
        )
        if resumed is not None:
            self.update, self.trace = resumed.update, resumed.trace
            self.frozen_file = checkpoint.frozen_file(resumed.path)  # verified as it was resumed
            if not checkpoint_due(resumed.update, self.setup.train):  # taken at an interruption
                self.trace.reopen((resumed.path / checkpoint.TRACE).read_bytes())
            self.cursor = self.controls.observer.resumed(resumed.state["cursor"])
            self.log.info(
                "resumed",
                step=self.update,
                checkpoint=resumed.path.name,
                world_size=self.controls.ranks.world,
            )

    def gathered(self) -> dict[str, torch.Tensor] | None:
        """Sharded: the whole tensors this update's record digests, gathered on rank 0 (every
        rank takes part); None when unsharded (the record reads the model) or when none are due."""
        wanted = recorded_state(self.update, self.setup.train)
        if self.sharded is None or wanted is None:
            return None
        return self.sharded.full_state(self.model, self.optimizer if wanted == "state" else None)

    def evaluation(self) -> dict[str, Any] | None:
        """The held-out loss when `eval.every` says so (rank 0; sharded, every rank takes part in
        the forward passes, and rank 0's result is recorded), else None."""
        setup = self.setup
        if self.heldout is None or setup.eval is None or self.update % setup.eval.every:
            return None
        result = evaluate(
            self.model,
            self.heldout,
            setup.eval,
            self.device,
            self.autocast,
            self.heldout_masks,
            setup.separate_records,
        )
        self.model.train()
        if self.sharded is not None:
            self.sharded.reshard()
        return result

    def may_wait(self, ended: bool) -> bool:
        """Whether the line of the update just done may wait for the next update's work to be
        queued: not where something must see it first (a checkpoint, the last update's included;
        an evaluation; an observer that reads each line or ends training; a stop), nor with
        several ranks or shards, whose collectives wait for the device anyway."""
        at, cfg, controls = self.update, self.setup.train, self.controls
        observer = controls.observer
        alone = controls.ranks.world == 1 and self.sharded is None
        quiet = not ended and controls.stop.signal_name is None
        seen = checkpoint_due(at, cfg) or observer.wants_checkpoint(at) or observer.wants_record(at)
        evaluated = self.waiting is not None and self.waiting.evaluated is not None
        return alone and quiet and not seen and not evaluated

    def settle(self, until: float | None = None) -> bool:
        """The waiting update's line: its loss checked (every rank) and recorded (rank 0); its
        time ends at `until` (when the next update began), else now. True: the observer says stop."""
        waiting, self.waiting = self.waiting, None
        if waiting is None:
            return False
        loss, grad_norm = waiting.checked(self.setup.work)
        if not self.controls.ranks.lead:
            return False
        seconds = (until if until is not None else time.perf_counter()) - waiting.started
        return self.record(waiting, loss, grad_norm, seconds)

    def record(self, done: Waiting, loss: float, grad_norm: float, seconds: float) -> bool:
        """Rank 0's part of an update: record, log, and at a checkpoint, every RECORD_EVERY
        updates or when the observer wants each update, write the trace and observe. True: the
        observer says stop."""
        setup, at, gathered = self.setup, done.update, done.gathered
        wanted = recorded_state(at, setup.train)
        whole = self.optimizer if wanted == "state" else None
        tensors = lambda: gathered if gathered is not None else state_tensors(self.model, whole)  # noqa: E731
        self.recorder.update(update_entry(at, loss, grad_norm, done.lr, done.cursor), wanted, tensors)
        if done.evaluated is not None:
            self.recorder.evaluated(at, done.evaluated)
            self.log.info("eval", step=at, **done.evaluated)
        self.log.info(
            "train_step",
            step=at,
            steps=setup.train.steps,
            loss=round(loss, 6),
            lr=done.lr,
            grad_norm=round(grad_norm, 6),
            tokens_per_s=round(setup.train.batch_size * setup.train.seq_len / seconds, 1),
            max_rss_mb=round(max_rss_mb(), 1),
        )
        observer = self.controls.observer
        if wanted == "state" or observer.wants_record(at) or len(self.recorder) >= RECORD_EVERY:
            return self.flush(gathered)
        return False

    def stopped(self) -> TrainResult:
        """The observer ended training: rank 0 writes the waiting lines into the trace."""
        if self.controls.ranks.lead:
            self.flush()
        return TrainResult(self.update, self.trace, stopped=True)

    def flush(self, gathered: dict[str, torch.Tensor] | None = None) -> bool:
        """Rank 0: the waiting lines into the trace (one copy from the device), each update's
        shown to the observer with the state as it is now (`gathered`, whole, when sharded
        training gathered it for this update). True: the observer says stop."""
        written = self.recorder.flush(self.trace.append)
        if not written:
            return False
        tensors = gathered or state_tensors(self.model, self.optimizer)
        return any([self.controls.observer.recorded(entry, tensors) for entry in written])

    def save(self) -> None:
        """Rank 0 writes the checkpoint of the update done last (sharded: every rank writes its
        shards, rank 0 the rest); every rank tells the observer."""
        at, observer = self.update, self.controls.observer
        if self.controls.ranks.lead:
            self.flush()  # an interruption's or a fault's checkpoint: its trace holds every update
        if self.sharded is not None:
            self.save_sharded()
        elif self.controls.ranks.lead:
            tokens = at * self.setup.train.batch_size * self.setup.train.seq_len
            state = {**self.setup.identity, "step": at, "cursor": self.cursor, "tokens": tokens}
            midway = observer.checkpoint_half_written
            train = self.setup.train
            path = checkpoint.save(
                self.setup.work,
                at,
                self.model,
                self.optimizer,
                state,
                self.trace,
                midway=midway,
                boundary=checkpoint_due(at, train),
                frozen=self.frozen_file,
            )
            checkpoint.prune(self.setup.work, train.keep_checkpoints, lambda u: checkpoint_due(u, train))
            self.log.info("checkpoint_saved", step=at, checkpoint=path.name)
        observer.checkpoint_written(at)

    def save_sharded(self) -> None:
        at, train, ranks = self.update, self.setup.train, self.controls.ranks
        assert self.sharded is not None
        sharded, model, optimizer = self.sharded, self.model, self.optimizer
        tokens = at * train.batch_size * train.seq_len
        path = checkpoint.save_sharded(
            self.setup.work,
            at,
            lambda folder: sharded.save(folder / SHARDS, model, optimizer),
            {**self.setup.identity, "step": at, "cursor": self.cursor, "tokens": tokens},
            self.trace,
            midway=self.controls.observer.checkpoint_half_written,
            boundary=checkpoint_due(at, train),
            ranks=ranks,
        )
        if ranks.lead:
            checkpoint.prune(self.setup.work, train.keep_checkpoints, lambda u: checkpoint_due(u, train))
            self.log.info("checkpoint_saved", step=at, checkpoint=path.name)
        ranks.barrier("a checkpoint")  # nobody resumes or prunes past a checkpoint still being written


def train(setup: TrainSetup, log: Any, controls: TrainControls | None = None) -> TrainResult:
    """Train one stage to the end, resuming from its newest checkpoint. With several ranks, every
    rank runs this loop in step; rank 0 alone reads and writes checkpoints and keeps the trace. A
    rank that dies fails the collectives of the others: a step failure, not a traceback."""
    controls = controls or TrainControls()
    with controls.ranks.peer_failures("training"):
        return _train(setup, log, controls)


def _train(setup: TrainSetup, log: Any, controls: TrainControls) -> TrainResult:
    cfg = setup.train
    ranks, observer, stop = controls.ranks, controls.observer, controls.stop
    run = Training.start(setup, log, controls)
    model, optimizer = run.model, run.optimizer
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    # Compiled: the same parameters, a generated forward and backward (imports torch._dynamo, so
    # only when asked for).
    compute = torch.compile(model) if setup.compile else model
    model.train()
    measured = False
    while run.update < cfg.steps:
        started = time.perf_counter()
        run.update += 1
        lr = learning_rate(run.update, cfg)
        optimizer.set_lr(lr)
        with out_of_memory_fails(run.update, setup.work):
            # forward, loss and backward of every micro-batch of this rank, summed across ranks
            loss_sum = batch_gradient(
                compute,
                run.batches,
                run.cursor,
                run.update,
                setup,
                run.device,
                run.autocast,
                ranks,
                run.sharded,
            )
            if run.sharded is not None:
                norm = run.sharded.clip([p for p in model.parameters() if p.grad is not None], max_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            values = Arriving.copy(torch.stack([loss_sum.float(), norm.float()]))
            if run.settle(until=started):  # the previous update's line, this update's work queued
                run.update -= 1  # this update's gradient is dropped: the state is the previous one's
                return run.stopped()
            optimizer.update()
            if not measured:  # once per process: the training state this rank holds, measured
                log.info("rank_state", world_size=ranks.world, **held_bytes(model, optimizer))
                measured = True
            optimizer.zero_grad()
        run.cursor += cfg.batch_size
        ended = observer.updated(run.update, model)
        gathered, evaluated = run.gathered(), run.evaluation()
        run.waiting = Waiting(run.update, run.cursor, lr, started, values, gathered, evaluated)
        if not run.may_wait(ended):
            ended = run.settle() or ended
        stopping, ended = ranks.any(stop.signal_name is not None, ended)
        if stopping or ended:  # one rank alone: a signal may have come after `may_wait`
            ended = run.settle() or ended
        if ended:
            return run.stopped()  # a spot check or a divergence
        if checkpoint_due(run.update, cfg) or stopping or observer.wants_checkpoint(run.update):
            run.save()
        if stopping:
            signal_name = stop.signal_name or "a signal to another rank"
            raise Interrupted(f"stopped by {signal_name} after step {run.update}; checkpoint written")
    run.settle()
    return TrainResult(run.update, run.trace)
