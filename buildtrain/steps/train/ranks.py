"""The processes of one train step: who computes which micro-batches, and what they exchange.

A step started by torchrun finds RANK and WORLD_SIZE in its environment and joins a process group
(gloo on CPU, NCCL on CUDA); a step started directly is world size 1 and never touches
torch.distributed. Every rank holds the whole model and optimizer state and applies the same
update; only rank 0 reads and writes checkpoints, so a checkpoint does not depend on the world size
and a run stopped at N processes resumes at M.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from buildtrain.errors import StepFailed
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.reduce import Node, cover, tree_sum

# A peer that dies closes its sockets and fails the collective at once; this bounds the wait for a
# peer that hangs instead (a held-out evaluation on rank 0 runs while the others wait).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class Ranks:
    """This process's place in the step: rank, world size, and the collectives it takes part in."""

    def __init__(self, rank: int = 0, world: int = 1, device: str = "cpu") -> None:
        self.rank, self.world, self.device = rank, world, device

    @property
    def lead(self) -> bool:
        """Rank 0: reads and writes checkpoints, keeps the trace, evaluates, publishes."""
        return self.rank == 0

    @classmethod
    def from_environment(cls, device: str) -> Ranks:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world, device)

    def agree_on(self, step_hash: str, label: str) -> None:
        """Refuse to train unless every rank builds the same step. Ranks on several machines meet
        at a rendezvous address, not at a step; without this check, machines whose stores differ
        could train two different steps together, and the mix would look like a normal run."""
        if self.world == 1:
            return
        import torch.distributed as dist

        mine = torch.tensor(list(bytes.fromhex(step_hash)), dtype=torch.uint8, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        with self.peers("the start of training"):
            dist.all_gather(everyone, mine)
        others = sorted({rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs, mine)})
        if others:
            raise StepFailed(
                f"rank {self.rank} builds {label} (step {step_hash[:12]}) but ranks {others} build another "
                "step; run the same plan on every node, from stores in the same state"
            )

    def share(self, micro_batches: int, rank: int | None = None) -> tuple[int, int]:
        """The contiguous micro-batches [first, end) a rank computes (the world size divides them)."""
        per_rank = micro_batches // self.world
        rank = self.rank if rank is None else rank
        return rank * per_rank, (rank + 1) * per_rank

    def finish_tree(self, partials: dict[Node, torch.Tensor], micro_batches: int) -> torch.Tensor:
        """Complete the canonical tree from every rank's partial sums; each rank gets the total.

        The vector is cut into one shard per rank. all_to_all sends every partial's shard to the
        rank that owns it, each rank completes the tree on its shard (the same additions, in the
        same order, as one process summing whole vectors), and all_gather assembles the shards.
        Each rank sends and receives about its partials' size once, whatever the world size.
        """
        root = (0, micro_batches)
        if self.world == 1:
            return partials[root]
        import torch.distributed as dist

        nodes = [cover(root, *self.share(micro_batches, r)) for r in range(self.world)]
        length = next(iter(partials.values())).numel()
        shard = math.ceil(length / self.world)
        send = _by_shard([partials[node] for node in nodes[self.rank]], self.world, shard)
        received = torch.empty(sum(len(n) for n in nodes) * shard, device=send.device)
        with self.peers("the gradient exchange"):
            dist.all_to_all_single(
                received,
                send.view(-1),
                output_split_sizes=[len(n) * shard for n in nodes],
                input_split_sizes=[len(nodes[self.rank]) * shard] * self.world,
            )
        pieces = iter(received.split(shard))
        known = {node: next(pieces) for rank_nodes in nodes for node in rank_nodes}
        total = tree_sum(root, _no_leaf, known)
        gathered = torch.empty(self.world * shard, device=total.device)
        with self.peers("the gradient exchange"):
            dist.all_gather(list(gathered.split(shard)), total)  # straight into one vector
        return gathered[:length]

    def sum(self, vector: torch.Tensor) -> torch.Tensor:
        """The `allreduce` reduction: the library's all-reduce, whose order depends on the world size."""
        if self.world > 1:
            import torch.distributed as dist

            with self.peers("the gradient all-reduce"):
                dist.all_reduce(vector)
        return vector

    def join_alone(self, device: str) -> None:
        """A process group of one, in memory, with no port to open: sharded training needs one
        even at world size 1 (FSDP2 shards over a device mesh)."""
        import torch.distributed as dist

        if self.world == 1 and not dist.is_initialized():
            if device != "cuda":
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                return
            # NCCL bound to this process's GPU at once (not at the first collective, on whatever
            # device is current then): FSDP2's mesh, the norm's all-gather and DCP's object
            # collectives all run on it.
            gpu = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(gpu)
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=gpu)

    def barrier(self, during: str) -> None:
        """Wait for every rank (sharded checkpoints: the folder exists before anyone writes into it)."""
        if self.world > 1:
            import torch.distributed as dist

            with self.peers(during):
                dist.barrier()

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """Agree on flags (stop requested, stop watching): true on every rank if true on one."""
        if self.world == 1:
            return flags
        import torch.distributed as dist

        shared = torch.tensor([float(f) for f in flags], device=self.device)
        with self.peers("the end of an update"):
            dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in shared.tolist())

    def share_state(self, model: torch.nn.Module, optimizer: AdamW, counters: list[int]) -> list[int]:
        """Give every rank rank 0's weights, optimizer state and counters (after a resume, or a
        later stage's initial weights): the other ranks need nothing from the store but data."""
        if self.world == 1:
            return counters
        counters = self.share_counters(counters)
        resumed = counters[0] > 0
        with torch.no_grad():
            for parameter in model.parameters():
                self._broadcast(parameter.data)
                if resumed and parameter.requires_grad:  # frozen weights (LoRA) have no moments
                    for value in optimizer.slots(parameter).values():
                        self._broadcast(value)
        return counters

    def share_counters(self, counters: list[int]) -> list[int]:
        """Rank 0's integers on every rank."""
        if self.world == 1:
            return counters
        shared = torch.tensor(counters, dtype=torch.int64)
        self._broadcast(shared)
        return [int(v) for v in shared.tolist()]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's values into `tensor`, staged through the device when it lives elsewhere
        (NCCL moves only device memory; AdamW's step counts stay on the CPU)."""
        import torch.distributed as dist

        with self.peers("the start of training"):
            if tensor.device.type == self.device:
                dist.broadcast(tensor, src=0)
                return
            staged = tensor.to(self.device)
            dist.broadcast(staged, src=0)
            tensor.copy_(staged.to(tensor.device))

    @contextlib.contextmanager
    def peer_failures(self, during: str) -> Iterator[None]:
        """Like `peers`, around code that calls collectives it does not own (FSDP2 gathers weights
        inside the forward and backward passes): only an error that `lost_peer` recognises becomes
        a step failure; any other error stays what it is."""
        try:
            yield
        except RuntimeError as exc:
            if self.world == 1 or not lost_peer(exc):
                raise
            raise self._lost(during, exc) from None

    @contextlib.contextmanager
    def peers(self, during: str) -> Iterator[None]:
        """A collective fails when another rank died or hangs: that is a step failure that names
        what this rank was doing, not a crash with a traceback."""
        try:
            yield
        except RuntimeError as exc:  # gloo and NCCL errors (DistBackendError is a RuntimeError)
            raise self._lost(during, exc) from None

    def _lost(self, during: str, exc: BaseException) -> StepFailed:
        """The step failure of this rank, naming what it did and the first sentence of the error
        (without the source location gloo puts first)."""
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(exc)).split(". ")[0]
        return StepFailed(f"rank {self.rank} lost its peers during {during} ({reason})")


# What gloo and NCCL say when the rank at the other end died or stopped answering.
PEER_LOST = re.compile(r"gloo|nccl|connection (closed|reset)|broken pipe|timed out", re.IGNORECASE)


def lost_peer(exc: BaseException) -> bool:
    """Whether an error is a collective that failed because another rank died or hangs. Raised
    inside autograd (FSDP2's gathers in the backward pass), a DistBackendError comes back as a
    plain RuntimeError, so its message tells."""
    import torch.distributed as dist

    return isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)) or bool(PEER_LOST.search(str(exc)))


def _by_shard(vectors: list[torch.Tensor], world: int, shard: int) -> torch.Tensor:
    """(ranks, vectors, shard): shard s of every vector, for rank s, side by side; one copy, with
    the tail of the last shard zero-padded."""
    length = vectors[0].numel()
    whole, rest = divmod(length, shard)
    out = torch.empty(world, len(vectors), shard, device=vectors[0].device)
    out[whole:].zero_()  # the padding (and the part of the last shard filled below)
    for index, vector in enumerate(vectors):
        out[:whole, index] = vector[: whole * shard].view(whole, shard)
        if rest:
            out[whole, index, :rest] = vector[whole * shard :]
    return out


def _no_leaf(micro: int) -> Any:
    raise AssertionError(f"micro-batch {micro} is covered by no rank's partial sums")
