"""Query-guided refilling (DESIGN.md §5): score the L1 entries, pick the top ``k``, assemble the cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .cache import BiLayerCache
from ..modeling.rope import Rope
from ..modeling.span_choice import span_tokens
from ..modeling.selection_words import POSITIONS  # compact: slots 0..P-1, the layout stage 2 trains in (DESIGN.md
# §5); text: each token at its index in the interleaved context (full attention's distances; the context
# must then fit the base's native window)


def num_selected(num_l1: int, interval: int, working_window: int, max_refill: int) -> int:
    """``k = floor(min(W - m, eta) / l)``, clamped to ``[0, m]``.

    >>> num_selected(0, 16, 100, 64), num_selected(10, 16, 1000, 8), num_selected(10, 16, 5, 4096)
    (0, 0, 0)
    >>> num_selected(10, 4, 30, 4096), num_selected(10, 4, 10_000, 4096)
    (5, 10)
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    k = math.floor(min(working_window - num_l1, max_refill) / interval)
    return max(0, min(num_l1, k))



@dataclass
class Assembled:
    """The refilled cache, ready to serve as a KV prefix (rotated at ``0..P-1``, or at text positions)."""

    keys: torch.Tensor  # [L, H_kv, P, D], rotated
    values: torch.Tensor  # [L, H_kv, P, D]
    num_refilled: int  # raw tokens inserted (selected spans + pending)
    next_position: int = -1  # where the open chunk starts (-1: right after the cache, P)

    def __post_init__(self) -> None:
        if self.next_position < 0:
            self.next_position = self.length

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])


def refill_layout(cache: BiLayerCache, selected: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where every cached token goes: ``(l2_index, l2_slots, l1_slots)``.

    ``selected``: span indices (L1 entries whose whole span is refilled) or a ``[N_closed]`` bool mask
    of the finished chunks' raw tokens to refill (token-granular refill). The refilled tokens of span
    ``j`` go immediately before L1 entry ``j``, in text order; pending raw tokens (their L1 token lies in
    the open chunk) go last, where they sit in the text. Slots are contiguous positions ``0..P-1``.
    """
    bounds = cache.span_bounds.numpy()
    m = cache.num_l1
    mask = selected if selected.dtype == torch.bool else span_tokens(cache.span_bounds, selected)
    index = np.flatnonzero(mask.numpy())
    owner = np.repeat(np.arange(m), np.diff(bounds))[index]  # the span of every refilled token
    # A refilled token follows the refilled tokens before it and the L1 entries of the spans before its own.
    l2_slots = np.arange(len(index)) + owner
    l1_slots = np.cumsum(np.bincount(owner, minlength=m)) + np.arange(m)
    end = int(l1_slots[-1]) + 1 if m else 0
    pending = np.arange(int(bounds[-1]), cache.num_l2)
    l2_index = np.concatenate([index, pending]).astype(np.int64)
    return l2_index, np.concatenate([l2_slots, end + np.arange(len(pending))]).astype(np.int64), l1_slots.astype(np.int64)


def text_positions(cache: BiLayerCache, l2_index: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(l2_positions, l1_positions, next)``: each token's index in the whole interleaved context.

    A raw token ``r`` of span ``s`` follows ``r`` raw tokens and the ``s`` L1 entries before it (pending
    tokens follow all ``m``); L1 entry ``j`` follows its span's last raw token. ``next``: where the raw
    tail begins.
    """
    bounds = cache.span_bounds.numpy()
    m = cache.num_l1
    owner = np.searchsorted(bounds[1:], l2_index, side="right")  # the span of each token, m when pending
    return l2_index + owner, bounds[1:] + np.arange(m), int(cache.num_l2) + m


def assemble(model: nn.Module, cache: BiLayerCache, selected: torch.Tensor, positions: str = "compact") -> Assembled:
    """Refill the selected spans (or tokens: see :func:`refill_layout`) next to their L1 entries and rotate
    everything at ``0..P-1`` (``positions="text"``: at their indices in the interleaved context, see
    :data:`POSITIONS`).

    Only the selected L2 tokens travel from CPU to the device.
    """
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    l2_index, l2_slots, l1_slots = refill_layout(cache, selected)
    device = cache.l1_keys.device
    layers, kv_heads, _, dim = cache.l1_keys.shape
    total = len(l2_index) + len(l1_slots)
    keys = cache.l1_keys.new_empty(layers, kv_heads, total, dim)
    values = cache.l1_values.new_empty(layers, kv_heads, total, dim)
    l1_slots_t = torch.as_tensor(l1_slots, device=device)
    keys[:, :, l1_slots_t] = cache.l1_keys
    values[:, :, l1_slots_t] = cache.l1_values
    if len(l2_index):
        index = torch.as_tensor(l2_index)
        slots = torch.as_tensor(l2_slots, device=device)
        keys[:, :, slots] = cache.l2_keys.index_select(2, index).to(device, keys.dtype)
        values[:, :, slots] = cache.l2_values.index_select(2, index).to(device, values.dtype)
    rotation, next_position = torch.arange(total), total
    if positions == "text":
        l2_pos, l1_pos, next_position = text_positions(cache, l2_index)
        rotation = torch.empty(total, dtype=torch.long)
        rotation[torch.as_tensor(l1_slots)] = torch.as_tensor(l1_pos, dtype=torch.long)
        rotation[torch.as_tensor(l2_slots)] = torch.as_tensor(l2_pos, dtype=torch.long)
    return Assembled(keys=Rope.of(model).rotate(keys, rotation), values=values, num_refilled=len(l2_index),
                     next_position=next_position)
