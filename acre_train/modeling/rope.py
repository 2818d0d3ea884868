"""The one RoPE module: rotate, un-rotate and move keys with the model's own rotary embedding.

Every place that handles positions outside the library's forward -- the adapter's L1 memory keys,
the bi-layer cache, refilling, the evaluation engine and its cache-editing methods -- goes through
:class:`Rope`, built from the model (``Rope.of(model)``): the frequencies and scaled variants
(linear / llama3 / yarn, baked into ``inv_freq`` and ``attention_scaling``) come from the model's
``rotary_emb`` and ``rotate_half`` from its attention code, so a key rotated here is bit-identical
(float32) to the key the model computes at that position.

This module must stay self-contained (torch only): exports copy it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Rope:
    """A model's RoPE. Keys are ``(..., n, head_dim)``; ``positions`` are 1-D integer tensors of length n."""

    rotary_emb: nn.Module
    rotate_half: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> "Rope":
        """The RoPE of a ``*ForCausalLM`` (its decoder's ``rotary_emb``, its attention's ``rotate_half``)."""
        attn = model.model.layers[0].self_attn
        rotate_half = getattr(attn, "_rotate_half", None) or inspect.getmodule(type(attn)).rotate_half
        return cls(model.model.rotary_emb, rotate_half)

    @property
    def scale(self) -> float:
        return float(getattr(self.rotary_emb, "attention_scaling", 1.0))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for ``positions``, shape ``(n, head_dim)``, already scaled.

        float32/bf16/fp16: through the module's ``forward`` (what attention uses). float64:
        recomputed from ``inv_freq`` (for exact tests).
        """
        positions = positions.to(self.rotary_emb.inv_freq.device)
        if dtype == torch.float64:
            freqs = positions.double()[:, None] * self.rotary_emb.inv_freq.double()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos() * self.scale, emb.sin() * self.scale
        dummy = torch.empty(0, dtype=dtype, device=self.rotary_emb.inv_freq.device)
        cos, sin = self.rotary_emb(dummy, positions[None, :])
        return cos[0], sin[0]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` (cos/sin broadcast over ``x``'s leading dims)."""
        return x * cos + self.rotate_half(x) * sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys ``x`` rotated to ``positions`` (what the model's attention does)."""
        _check(x, positions)
        if x.shape[-2] == 0:
            return x
        cos, sin = self.cos_sin(positions, x.dtype)
        return self.apply(x, cos.to(x.device), sin.to(x.device))

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Invert :meth:`rotate`: RoPE is ``s * R(theta)`` per pair, so its inverse is ``R(-theta) / s``."""
        _check(x, positions)
        cos, sin = self.cos_sin(positions, x.dtype)
        return (x * cos - self.rotate_half(x) * sin) / (self.scale ** 2)

    def reposition(self, x: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Move post-RoPE keys from ``old`` to ``new`` positions (un-rotate, then rotate: ~1e-7 relative)."""
        if torch.equal(old.cpu(), new.cpu()):
            return x
        return self.rotate(self.unrotate(x, old), new)

    def delta_rotate(self, x: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
        """Shift post-RoPE keys by ``delta`` positions with one unscaled rotation by ``delta * theta``
        (angle in float64; ``delta`` an int or one per key, negative moves earlier)."""
        n = x.shape[-2]
        if isinstance(delta, int):
            delta = torch.full((n,), delta, dtype=torch.long)
        _check(x, delta)
        freqs = delta.to(self.rotary_emb.inv_freq.device).double()[:, None] * self.rotary_emb.inv_freq.double()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return self.apply(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def _check(x: torch.Tensor, positions: torch.Tensor) -> None:
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    if x.shape[-2] != positions.shape[0]:
        raise ValueError(f"{x.shape[-2]} keys but {positions.shape[0]} positions")
