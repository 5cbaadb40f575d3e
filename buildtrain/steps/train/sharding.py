"""Sharded training (`train.sharding = "fsdp"`): PyTorch's FSDP2 holds each rank's shard of the
weights, gradients and AdamW moments, and the gradient is still the canonical tree's sum.

FSDP2 reduce-scatters each block's gradient as the backward pass leaves it: a sum across ranks
whose order depends on the world size. Here that collective is replaced (FSDP2's custom
reduce-scatter seam) by an exchange that adds nothing: every rank receives, for its own shard,
the micro-batch gradient of every rank, and adds them into the canonical tree (`reduce.Tree`).
The micro-batches are dealt round robin (pass p computes micro-batches pW .. pW+W-1, one per
rank), so the leaves arrive in tree order whatever the world size W, and each element of a
shard's gradient is the sum an unsharded run computes, bit for bit. AdamW is element-wise, so the
sharded update is the unsharded one. The clipping norm is summed row by row (FSDP2 cuts shards
between rows of dim 0), so it does not depend on where the cuts fall either; it is not summed in
the order of torch's `clip_grad_norm_`, which is why a clipped update can differ from the
unsharded run's in its last bits (docs/clusters.md, "Sharded training (FSDP2)").

On CUDA (NCCL; at world size 1 too, where the process group is one in memory), FSDP2 works on
streams of its own, and the exchange and the tree follow them. The backward pass computes a
unit's gradient on the default stream; FSDP2 copies it into the reduce-scatter input there, makes
its reduce-scatter stream wait for the default stream, and calls the exchange under that stream:
NCCL starts the all-to-all only after the work queued on the current stream, and a call that is
not async makes the current stream wait for NCCL's, so `received` is complete on the
reduce-scatter stream when the call returns. (At world size 1 FSDP2 copies the input to its
output on that stream instead; no exchange is called.) FSDP2 then makes its all-reduce stream
wait for the reduce-scatter stream and calls the hook (`_reduced`) under the all-reduce stream,
so the tree adds leaves that are complete, in order, on one stream, and its total is copied into
FSDP2's output there; FSDP2 makes the default stream wait for that stream before the gradient is
read (clipping, AdamW). One hazard is left to us: the tree keeps a leaf from one pass to the next,
memory allocated on the reduce-scatter stream and read on the all-reduce stream. The caching
allocator would hand that memory back to the reduce-scatter stream once the leaf is dropped, while
an addition queued on the all-reduce stream may still read it, so every leaf is recorded on the
all-reduce stream (`record_stream`), which makes the allocator wait for that stream first.
Clipping and the loss exchange run on the default stream, like the update, with NCCL ordered
after them in the same way.

Checkpoints are torch.distributed.checkpoint's: every rank writes its shards as one safetensors
file (no pickle on any path) with the offsets of its rows, and a load at another world size
reads the rows it now owns. Those files are the work folder's, for resume; the step's output
gets each kept checkpoint whole (`checkpoint.publish`, reading the rows back without
torch.distributed), so its bytes do not depend on the world size.
"""

from __future__ import annotations

import functools
import math
import secrets
from pathlib import Path
from typing import Any

import torch

from buildtrain.errors import StepFailed
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.ranks import Ranks
from buildtrain.steps.train.reduce import Tree
from buildtrain.store.tensors import settle_header


class Exchange:
    """Stands in for FSDP2's reduce-scatter: an all-to-all that keeps the ranks' contributions
    apart (row r of `received`: rank r's micro-batch gradient of this rank's shard)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.received: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        import torch.distributed as dist

        received = torch.empty_like(input_tensor)
        with self.ranks.peers("the gradient exchange"):
            dist.all_to_all_single(received, input_tensor, group=group)
        self.received = received.view(group.size(), -1)


class Sharded:
    """The model's FSDP2 units (each block, then the root) and the trees that sum their gradients."""

    def __init__(
        self, model: torch.nn.Module, ranks: Ranks, device: torch.device, micro_batches: int
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.ranks, self.micro_batches = ranks, micro_batches
        ranks.join_alone(device.type)
        mesh = init_device_mesh(device.type, (ranks.world,))
        blocks = list(model.blocks)  # type: ignore[attr-defined]
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.units: list[Any] = [*blocks, model]
        for index, unit in enumerate(self.units):
            exchange = Exchange(ranks)
            unit.set_custom_reduce_scatter(exchange)
            unit.set_force_sum_reduction_for_comms(True)  # nothing divides: the loss is already a mean
            unit.set_gradient_divide_factor(1.0)
            unit.set_all_reduce_hook(functools.partial(self._reduced, index, exchange))
        self.begin_update()

    def begin_update(self) -> None:
        self.trees = [Tree(self.micro_batches) for _ in self.units]
        self.losses = Tree(self.micro_batches)

    def reshard(self) -> None:
        """Back to shards after forward passes with no backward (an evaluation): FSDP2 keeps the
        root's weights gathered after a forward pass, for the backward it expects."""
        for unit in self.units:
            unit.reshard()

    def passes(self) -> range:
        """The micro-batch of this rank in each pass: micro-batch pass * world + rank."""
        return range(self.ranks.rank, self.micro_batches, self.ranks.world)

    def _reduced(self, unit: int, exchange: Exchange, output: torch.Tensor) -> None:
        """After a unit's backward: this pass's micro-batch gradients of our shard into the tree;
        after the last pass, the tree's sum is what FSDP2 stores as the shard's gradient."""
        leaves = exchange.received if self.ranks.world > 1 else output.view(1, -1)
        exchange.received = None
        assert leaves is not None
        if leaves.is_cuda:  # kept past this call, read on this stream: see the module's note
            leaves.record_stream(torch.cuda.current_stream(leaves.device))
        tree = self.trees[unit]
        for leaf in leaves:
            tree.push(leaf)
        total = tree.total()
        if total is not None:
            output.copy_(total)

    def add_losses(self, loss: torch.Tensor) -> torch.Tensor | None:
        """This pass's micro-batch losses of every rank into their tree; the batch loss at the end."""
        if self.ranks.world == 1:
            self.losses.push(loss.reshape(1).clone())
        else:
            import torch.distributed as dist

            everyone = torch.empty(self.ranks.world, device=loss.device)
            with self.ranks.peers("the loss exchange"):
                dist.all_gather_into_tensor(everyone, loss.reshape(1))
            for value in everyone:
                self.losses.push(value.reshape(1))
        total = self.losses.total()
        return None if total is None else total[0]

    def clip(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the sharded gradients to a global norm of at most `max_norm`; returns the norm.

        Each rank sums squares along its rows, the rows of every parameter are gathered whole, and
        every rank adds them up in parameter order: the same additions at any world size.
        """
        import torch.distributed as dist

        world = self.ranks.world
        grads = [p.grad.to_local() for p in parameters]  # type: ignore[union-attr]
        chunks = [math.ceil(p.shape[0] / world) if p.dim() else 1 for p in parameters]
        send = torch.zeros(sum(chunks), device=grads[0].device)
        offset = 0
        for p, grad, chunk in zip(parameters, grads, chunks, strict=True):
            width = math.prod(p.shape[1:])
            send[offset : offset + grad.shape[0]] = grad.reshape(grad.shape[0], width).square().sum(1)
            offset += chunk
        # all_gather_into_tensor, not all_gather_single: the latter is new in torch 2.13 (2.11 on a
        # GPU machine had none), and pyproject.toml allows torch >= 2.5
        gathered = torch.empty(world * send.numel(), device=send.device)
        with self.ranks.peers("the gradient norm"):
            dist.all_gather_into_tensor(gathered, send)
        gathered = gathered.view(world, -1)
        sums, offset = [], 0
        for p, chunk in zip(parameters, chunks, strict=True):
            rows = [
                gathered[r, offset : offset + max(0, min(chunk, p.shape[0] - r * chunk))]
                for r in range(world)
            ]
            sums.append(torch.cat(rows).sum())
            offset += chunk
        norm = torch.stack(sums).sum().sqrt()
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ formula
        torch._foreach_mul_(grads, coefficient)
        return norm

    def full_state(self, model: torch.nn.Module, optimizer: AdamW | None) -> dict[str, torch.Tensor]:
        """Whole tensors of the training state, by the names `state.state_tensors` gives them, on
        rank 0 (every rank takes part in gathering each one; the others keep none of them)."""
        from buildtrain.steps.train.state import state_tensors

        whole = {}
        for name, tensor in state_tensors(model, optimizer).items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.ranks.lead:
                whole[name] = full
        return whole

    def save(self, folder: Path, model: torch.nn.Module, optimizer: AdamW) -> None:
        """Every rank writes its shards of the weights and AdamW state into `folder` (collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        from buildtrain.steps.train.state import state_tensors

        with self.ranks.peers("a checkpoint"):
            dcp.save(
                state_tensors(model, optimizer),
                storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True),
            )
        for path in sorted(folder.glob(f"shard-{self.ranks.rank + 1:05d}-*.safetensors")):
            settle_header(path)  # this rank's file (torch numbers them from 1), before the seal

    def load(self, folder: Path, model: torch.nn.Module, optimizer: AdamW) -> None:
        """Every rank reads the rows it owns at this world size, whatever the world size that wrote
        them (collective). The AdamW moments are created first, for the load to fill."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        from buildtrain.steps.train.state import state_tensors

        for parameter in model.parameters():
            if parameter.requires_grad:
                optimizer.slots(parameter)
        with self.ranks.peers("a resume"):
            dcp.load(state_tensors(model, optimizer), storage_reader=HuggingFaceStorageReader(str(folder)))


def require_shared_folder(ranks: Ranks, folder: Path) -> None:
    """Refuse to train unless every rank sees the same work folder: each rank writes its shards
    of a checkpoint into it and rank 0 seals them all. Ranks on one machine share it; ranks on
    several need it on a shared filesystem (with separate stores, each node's folder is its own)."""
    if ranks.world == 1:
        return
    import torch.distributed as dist

    token = torch.tensor(list(secrets.token_bytes(16)), dtype=torch.uint8, device=ranks.device)
    with ranks.peers("the start of training"):
        dist.broadcast(token, src=0)  # rank 0's
    mark = folder / f".ranks-{bytes(token.tolist()).hex()}"
    if ranks.lead:
        folder.mkdir(parents=True, exist_ok=True)
        mark.touch()
    ranks.barrier("the start of training")
    shared = torch.tensor([float(mark.is_file())], device=ranks.device)
    with ranks.peers("the start of training"):
        dist.all_reduce(shared, op=dist.ReduceOp.MIN)
    ranks.barrier("the start of training")
    if ranks.lead:
        mark.unlink(missing_ok=True)
    if shared.item() < 1:
        raise StepFailed(
            "sharded training needs every rank to see one work folder (each rank writes its shards of a "
            "checkpoint there): run the ranks on one machine, or give the nodes one store on a shared "
            "filesystem"
        )
