"""RoPE's inverse frequencies: the default rule, and Llama 3.x's rescaling of them.

The llama3 rule (Meta's reference code, and transformers' `_compute_llama3_parameters`, written
again here op for op in float32 so that an imported Llama 3.x computes its own angles): with
L = original_max_position_embeddings, a frequency whose wavelength 2 pi / f exceeds
L / low_freq_factor is divided by `factor`, one shorter than L / high_freq_factor is kept, and
those between are interpolated by s = (L / wavelength - low) / (high - low):
(1 - s) f / factor + s f. The tables are computed once per length, so this costs nothing per step.
"""

from __future__ import annotations

import math

import torch

from buildtrain.config.schema import RopeScalingConfig


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScalingConfig | None = None
) -> torch.Tensor:
    """(head_dim / 2,) float32: the rotation speed of each channel pair."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return frequencies
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(wavelength > context / low, frequencies / scaling.factor, frequencies)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    between = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(between, smoothed, scaled)
