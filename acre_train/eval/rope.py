"""RoPE helpers on cached keys: rotate, un-rotate, re-position and delta-rotate.

All helpers take the model's own rotary embedding module (``model.model.rotary_emb``) so the
frequencies, the RoPE variant (linear / llama3 / yarn scaling baked into ``inv_freq``) and the
``attention_scaling`` factor are exactly the model's. Rotation uses the library's ``rotate_half``.

Conventions: keys are ``(..., n, head_dim)``; ``positions`` is a 1-D integer tensor of length ``n``.

Precision: in float32, angles are computed by the module's own ``forward`` so a key rotated here is
bit-identical to the key the model computes at that position. In float64 (used by the tests) angles
are computed in float64 from the module's ``inv_freq``. ``reposition`` (un-rotate then rotate) is
what the methods use: its result matches the model's own key at the new position to ~1e-7
relative, whereas a delta rotation composes two rounded fp32 angles and drifts by ~pos * 1e-7 rad.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half


def _check(x: torch.Tensor, positions: torch.Tensor) -> None:
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    if x.shape[-2] != positions.shape[0]:
        raise ValueError(f"{x.shape[-2]} keys but {positions.shape[0]} positions")


def cos_sin(rotary_emb: nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's ``(cos, sin)`` for ``positions``, shape ``(n, head_dim)``, already scaled.

    float32/bf16/fp16: through the module's ``forward`` (identical to what attention uses).
    float64: recomputed in float64 from ``inv_freq`` and ``attention_scaling`` (for exact tests).
    """
    positions = positions.to(rotary_emb.inv_freq.device)
    if dtype == torch.float64:
        freqs = positions.double()[:, None] * rotary_emb.inv_freq.double()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(rotary_emb, "attention_scaling", 1.0))
        return emb.cos() * scale, emb.sin() * scale
    dummy = torch.empty(0, dtype=dtype, device=rotary_emb.inv_freq.device)
    cos, sin = rotary_emb(dummy, positions[None, :])
    return cos[0], sin[0]


def _scale(rotary_emb: nn.Module) -> float:
    return float(getattr(rotary_emb, "attention_scaling", 1.0))


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary_emb: nn.Module) -> torch.Tensor:
    """Apply RoPE at ``positions`` to pre-RoPE keys ``x`` (what the model's attention does)."""
    _check(x, positions)
    cos, sin = cos_sin(rotary_emb, positions, x.dtype)
    return x * cos + rotate_half(x) * sin


def unrotate(x: torch.Tensor, positions: torch.Tensor, rotary_emb: nn.Module) -> torch.Tensor:
    """Invert ``rotate``: post-RoPE keys at ``positions`` back to pre-RoPE keys.

    RoPE is ``s * R(theta)`` per 2-D pair (``s`` = ``attention_scaling``); its inverse is
    ``R(-theta) / s``, i.e. ``(x*cos - rotate_half(x)*sin) / s**2`` with the scaled cos/sin.
    """
    _check(x, positions)
    cos, sin = cos_sin(rotary_emb, positions, x.dtype)
    return (x * cos - rotate_half(x) * sin) / (_scale(rotary_emb) ** 2)


def reposition(x: torch.Tensor, old: torch.Tensor, new: torch.Tensor, rotary_emb: nn.Module) -> torch.Tensor:
    """Move post-RoPE keys from positions ``old`` to ``new`` (un-rotate, then rotate)."""
    if torch.equal(old.cpu(), new.cpu()):
        return x
    return rotate(unrotate(x, old, rotary_emb), new, rotary_emb)


def delta_rotate(x: torch.Tensor, delta: torch.Tensor | int, rotary_emb: nn.Module) -> torch.Tensor:
    """Shift post-RoPE keys by ``delta`` positions with one rotation by ``delta * theta``.

    ``R(p + d) = R(d) R(p)``, so one unscaled rotation by the delta angle moves a key from ``p`` to
    ``p + d``. The delta angle is computed in float64 to keep rounding to that of ``x``'s own angle.
    ``delta`` is an int or a 1-D tensor (one per key); negative deltas move keys earlier.
    """
    n = x.shape[-2]
    if isinstance(delta, int):
        delta = torch.full((n,), delta, dtype=torch.long)
    _check(x, delta)
    freqs = delta.to(rotary_emb.inv_freq.device).double()[:, None] * rotary_emb.inv_freq.double()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin
