"""RoPE at arbitrary positions, through the model's own rotary embedding (so scaled RoPE variants work)."""

from __future__ import annotations

import torch
from torch import nn


def rotate(model: nn.Module, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate pre-RoPE ``keys`` ``[..., P, D]`` to ``positions`` ``[P]`` (any leading dims).

    Uses ``model.model.rotary_emb`` for cos/sin and the attention module's ``rotate_half``, i.e. the
    exact code the forward pass uses, so cached keys match freshly computed ones bit for bit.
    """
    if keys.shape[-2] == 0:
        return keys
    pos = positions.to(keys.device).reshape(1, -1)
    cos, sin = model.model.rotary_emb(keys, pos)  # [1, P, D]
    rotate_half = model.model.layers[0].self_attn._rotate_half
    return keys * cos[0] + rotate_half(keys) * sin[0]
