"""buildtrain's AdamW: with torch's eager operations exactly torch.optim.AdamW's update (its
single-tensor path); with the fused CPU kernel the same operations, each exactly rounded, in one
pass, whatever the thread count or the split of a tensor into shards."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import computing_with
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain import native
from buildtrain.executor.process import numerics
from buildtrain.steps.train import kernels
from buildtrain.steps.train import optimizer as adamw
from buildtrain.steps.train.optimizer import AdamW

needs_a_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@settings(max_examples=15, deadline=None)
@given(
    lr=st.floats(1e-4, 1e-1),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    beta1=st.floats(0.5, 0.99),
    beta2=st.floats(0.9, 0.999),
    seed=st.integers(0, 2**16),
)
def test_matches_torch_adamw_bit_for_bit(lr, weight_decay, beta1, beta2, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    ours, theirs = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    with torch.no_grad():
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            a.copy_(torch.randn(a.shape, generator=generator))
            b.copy_(a)
    betas = (beta1, beta2)
    mine = AdamW([{"params": ours.parameters(), "weight_decay": weight_decay}], lr=lr, betas=betas, eps=1e-8)
    reference = torch.optim.AdamW(
        theirs.parameters(), lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay, foreach=False
    )
    with computing_with("eager"):  # the written-out update
        for _ in range(6):
            inputs = torch.randn(5, 8, generator=generator)
            for model, update, zero_grad in (
                (ours, mine.update, mine.zero_grad),
                (theirs, reference.step, reference.zero_grad),
            ):
                model(inputs).pow(2).mean().backward()
                update()
                zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(mine.state[a]["exp_avg_sq"], reference.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("mode", kernels.MODES)
def test_parameters_without_gradient_are_left_alone(mode: str) -> None:
    model = torch.nn.Linear(3, 3)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = AdamW(
        [{"params": model.parameters(), "weight_decay": 0.1}], lr=0.1, betas=(0.9, 0.95), eps=1e-8
    )
    with computing_with(mode):
        optimizer.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state == {}


def exactly_rounded_reference(
    params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[list[torch.Tensor]], count: int
) -> None:
    """The written-out update with torch's operations but an exactly rounded square root (taken in
    float64: exact for a float32), the one operation the fused kernel is not torch's in."""
    lr, (beta1, beta2), eps, weight_decay = 3e-3, (0.9, 0.95), 1e-8, 0.1
    exp_avgs, exp_avg_sqs = moments
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denominators = [v.double().sqrt().float() for v in exp_avg_sqs]
    torch._foreach_div_(denominators, math.sqrt(1 - beta2**count))
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-lr / (1 - beta1**count))


@needs_a_compiler
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-6, 1e-3, 1.0]))
def test_the_fused_kernel_is_torchs_update_with_an_exactly_rounded_square_root(seed, scale) -> None:
    generator = torch.Generator().manual_seed(seed)
    sizes = (7, 40_013)  # one with a tail in any vector width, one split among threads
    ours = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in sizes]
    theirs = [p.detach().clone() for p in ours]
    optimizer = AdamW([{"params": ours, "weight_decay": 0.1}], lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    moments = [[torch.zeros(n) for n in sizes] for _ in range(2)]
    for count in range(1, 5):
        grads = [torch.randn(n, generator=generator) * scale for n in sizes]
        for param, grad in zip(ours, grads, strict=True):
            param.grad = grad
        with computing_with("fused"):
            optimizer.update()
        exactly_rounded_reference(theirs, grads, moments, count)
        for param, reference in zip(ours, theirs, strict=True):
            assert torch.equal(param.detach(), reference), count
        for param, exp_avg, exp_avg_sq in zip(ours, *moments, strict=True):
            assert torch.equal(optimizer.state[param]["exp_avg"], exp_avg)
            assert torch.equal(optimizer.state[param]["exp_avg_sq"], exp_avg_sq)


@needs_a_compiler
def test_the_fused_kernel_updates_a_shard_as_that_part_of_the_whole() -> None:
    """What sharded training's bits rest on: pieces updated apart (odd lengths, any offsets) equal
    the whole tensor updated at once, bit for bit."""
    generator = torch.Generator().manual_seed(3)
    whole = torch.nn.Parameter(torch.randn(70_001, generator=generator))
    spans = list(itertools.pairwise((0, 13, 33_333, 70_001)))
    pieces = [torch.nn.Parameter(whole.detach()[a:b].clone()) for a, b in spans]
    optimizers = [
        AdamW([{"params": params, "weight_decay": 0.1}], lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
        for params in ([whole], pieces)
    ]
    for _ in range(3):
        grad = torch.randn(whole.shape, generator=generator)
        whole.grad = grad
        for piece, (a, b) in zip(pieces, spans, strict=True):
            piece.grad = grad[a:b].clone()
        with computing_with("fused"):
            for optimizer in optimizers:
                optimizer.update()
    assert torch.equal(whole.detach(), torch.cat([piece.detach() for piece in pieces]))


PORTABLE_UPDATES = """
import sys
from buildtrain.executor.process import numerics
torch, _ = numerics.import_torch("portable", "cpu", 1)
from buildtrain.steps.train import kernels
from buildtrain.steps.train import optimizer as adamw
from buildtrain.steps.train.optimizer import AdamW
results = []
for mode in kernels.MODES:
    kernels.select(mode)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in (7, 40_013)]
    optimizer = AdamW([{"params": params, "weight_decay": 0.1}], lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(4):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * 1e-3
        optimizer.update()
    results.append(torch.cat([p.detach() for p in params]))
sys.exit(0 if torch.equal(*results) else 3)
"""


@needs_a_compiler
def test_under_portable_the_fused_kernel_makes_torchs_update_bit_for_bit() -> None:
    """What keeps every portable plan's weights: MKL's strict mode rounds torch's square root
    exactly, so there the one pass of C and torch's eight make the same bits."""
    env = {**os.environ, **numerics.environment("portable", "cpu", 1)}
    done = subprocess.run([sys.executable, "-c", PORTABLE_UPDATES], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_fused_update_is_torch_optim_adamws_fused_one_bit_for_bit(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the update is torch's fused kernel; called as torch.optim.AdamW(fused=True) calls
    it, it gives that optimizer's bits. On the CPU (where a step never takes it, but torch has
    the kernel too) the test routes the update there, so the call itself is checked anywhere.
    Two groups, one decayed, and a parameter that joins at the third update: two step counts."""
    if device == "cpu":  # past the C kernel, to torch's
        monkeypatch.setattr(kernels, "applies", lambda *tensors: False)
        monkeypatch.setattr(adamw, "runs_fused", lambda params: True)
    generator = torch.Generator().manual_seed(0)
    ours, theirs = torch.nn.Linear(8, 4).to(device), torch.nn.Linear(8, 4).to(device)
    late = [torch.nn.Parameter(torch.randn(4, generator=generator).to(device)) for _ in range(2)]
    with torch.no_grad():
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            a.copy_(torch.randn(a.shape, generator=generator))
            b.copy_(a)
        late[1].copy_(late[0])
    mine = AdamW(
        [
            {"params": [ours.weight, late[0]], "weight_decay": 0.1},
            {"params": [ours.bias], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    reference = torch.optim.AdamW(
        [
            {"params": [theirs.weight, late[1]], "weight_decay": 0.1},
            {"params": [theirs.bias], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    for update in range(5):
        inputs = torch.randn(5, 8, generator=generator).to(device)
        for model, extra, step in ((ours, late[0], mine.update), (theirs, late[1], reference.step)):
            loss = model(inputs).pow(2).mean()
            if update >= 2:  # until then `extra` has no gradient, and no step count
                loss = loss + (model.weight.sum(1) * extra).sum()
            loss.backward()
            step()
            for parameter in (*model.parameters(), extra):
                parameter.grad = None
        for a, b in zip((*ours.parameters(), late[0]), (*theirs.parameters(), late[1]), strict=True):
            assert torch.equal(a, b), update
