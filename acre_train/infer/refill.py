"""Query-guided refilling (DESIGN.md §5): the refilled cache assembled from the chosen L2 tokens and the L1
entries (where each goes: ``modeling/bilayer.py:refill_layout``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..modeling.bilayer import BiLayerCache, refill_layout, text_positions
from ..modeling.rope import Rope
from ..modeling.selection_words import POSITIONS  # compact: slots 0..P-1, the layout stage 2 trains in (DESIGN.md
# §5); text: each token at its index in the interleaved context (full attention's distances; the context
# must then fit the base's native window)


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
