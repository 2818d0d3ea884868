"""Query-guided refilling (DESIGN.md §5): score the L1 entries, pick the top ``k``, assemble the cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .cache import BiLayerCache
from ..modeling.scorers import select_spans, span_tokens
from ..modeling.rope import Rope


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


def select_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores, sorted by position (text order)."""
    return select_spans(scores, k)


@dataclass
class Assembled:
    """The refilled cache, ready to serve as a KV prefix (rotated at ``0..P-1``)."""

    keys: torch.Tensor  # [L, H_kv, P, D], rotated
    values: torch.Tensor  # [L, H_kv, P, D]
    num_refilled: int  # raw tokens inserted (selected spans + pending)

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


def assemble(model: nn.Module, cache: BiLayerCache, selected: torch.Tensor) -> Assembled:
    """Refill the selected spans (or tokens: see :func:`refill_layout`) next to their L1 entries and rotate
    everything at ``0..P-1``.

    Only the selected L2 tokens travel from CPU to the device.
    """
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
    return Assembled(keys=Rope.of(model).rotate(keys, torch.arange(total)), values=values, num_refilled=len(l2_index))
