"""buildtrain's AdamW makes exactly torch.optim.AdamW's update (its single-tensor path)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.steps.train.optimizer import AdamW


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


def test_parameters_without_gradient_are_left_alone() -> None:
    model = torch.nn.Linear(3, 3)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = AdamW(
        [{"params": model.parameters(), "weight_decay": 0.1}], lr=0.1, betas=(0.9, 0.95), eps=1e-8
    )
    optimizer.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state == {}
