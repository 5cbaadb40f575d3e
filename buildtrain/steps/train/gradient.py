"""Forward, loss and backward of one update: the batch gradient, summed in the order
`train.reduction` names, whichever process computes which micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from buildtrain.steps.seeds import derive_seed
from buildtrain.steps.train.batches import Batches
from buildtrain.steps.train.model import record_mask
from buildtrain.steps.train.ranks import Ranks
from buildtrain.steps.train.reduce import cover, gradients_to_vector, tree_sum, vector_to_gradients
from buildtrain.steps.train.setup import TrainSetup
from buildtrain.steps.train.sharding import Sharded


def seeded(seed: int, purpose: str, *counters: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one purpose; on the device that draws from it (CUDA kernels refuse a CPU one)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, purpose, *counters))
    return generator


def token_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy of the targets (B, T), or of those the mask (B, T) marks: for chat
    records the completions' tokens only (a micro-batch with none counts zero)."""
    if mask is None:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    weights = mask.flatten().float()
    return (losses * weights).sum() / weights.sum().clamp(min=1.0)


def batch_gradient(
    model: torch.nn.Module,
    batches: Batches,
    cursor: int,
    update: int,
    setup: TrainSetup,
    device: torch.device,
    autocast: Any,
    ranks: Ranks,
    sharded: Sharded | None = None,
) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches, then the reduction `train.reduction`
    names; leaves the batch gradient in `.grad` on every rank (sharded: each rank's shard of it)
    and returns the batch loss."""
    cfg = setup.train
    micro_batches = cfg.batch_size // cfg.micro_batch_size
    parameters = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters

    def backward(micro: int) -> torch.Tensor:
        x, y = batches.micro_batch(cursor, micro, cfg.micro_batch_size)
        mask = batches.target_masks(cursor, micro, cfg.micro_batch_size)  # chat records only
        if device.type == "cuda":  # copied from page-locked memory, without waiting for the GPU
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        else:
            x, y = x.to(device), y.to(device)
        dropping = setup.model.dropout or (cfg.lora is not None and cfg.lora.dropout)
        generator = seeded(cfg.seed, "dropout", update, micro, device=device) if dropping else None
        with autocast:
            records = None if setup.separate_records is None else record_mask(x, setup.separate_records)
            logits = model(x, generator, records)  # (B, T, vocab)
            loss = token_loss(logits, y, None if mask is None else mask.to(device)) / micro_batches
        loss.backward()
        return loss.detach()

    if sharded is not None:  # FSDP2 sums each shard's gradient in the tree as backward leaves it
        sharded.begin_update()
        for micro in sharded.passes():
            for parameter in parameters:
                parameter.grad = None  # each pass's gradient on its own: the tree keeps the sums
            loss = sharded.add_losses(backward(micro))
        assert loss is not None
        return loss

    if cfg.reduction == "allreduce":
        first, end = ranks.share(micro_batches)
        loss_sum = torch.zeros((), device=device)
        for micro in range(first, end):
            loss_sum += backward(micro)  # autograd adds each micro-batch into .grad, in order
        if ranks.world == 1:
            return loss_sum
        return vector_to_gradients(ranks.sum(gradients_to_vector(parameters, loss_sum)), parameters)

    return tree_gradient(parameters, backward, micro_batches, ranks)


def tree_gradient(
    parameters: list[torch.Tensor], backward: Callable[[int], torch.Tensor], micro_batches: int, ranks: Ranks
) -> torch.Tensor:
    """The invariant reduction: this rank's micro-batch gradients summed in the canonical tree,
    the tree finished across ranks; returns the batch loss."""
    if micro_batches == 1 and ranks.world == 1:
        # The tree is its one leaf, and the vector a copy out and back (1 ms an update at 85M
        # parameters on an H200): the gradients stay where backward left them, the same bits.
        return backward_alone(parameters, lambda: backward(0))

    def leaf(micro: int) -> torch.Tensor:
        for parameter in parameters:
            parameter.grad = None  # each micro-batch's gradient on its own, for the tree to sum
        return gradients_to_vector(parameters, backward(micro))

    first, end = ranks.share(micro_batches)
    partials = {node: tree_sum(node, leaf) for node in cover((0, micro_batches), first, end)}
    return vector_to_gradients(ranks.finish_tree(partials, micro_batches), parameters)


def backward_alone(parameters: list[torch.Tensor], backward: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One micro-batch's gradient left in `.grad`, as the vector round trip would leave it: zeros
    for a parameter backward did not reach (`gradients_to_vector`)."""
    for parameter in parameters:
        parameter.grad = None
    loss = backward()
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    return loss
