"""A transformers ``Cache`` that grows in place: the baselines' decoding at its floor.

transformers' ``DynamicCache`` appends by concatenation, so every decoding step copies the whole
cache (0.75 GB per step for the 0.5B base at 32K tokens): the full-attention baseline then spends
more time copying than attending. ``StaticCache`` avoids the copy but attends over its whole
preallocated length, whatever is filled, and needs the length up front. ``GrowingCache`` keeps a
buffer with spare capacity per layer, writes new keys and values into it in place (doubling when it
runs out, so a copy happens O(log n) times, not once per token) and hands the attention views of the
filled part: the same keys and values as ``DynamicCache``, with no per-step copy.

    >>> cache = GrowingCache(capacity=8192)  # doctest: +SKIP
    >>> model(input_ids=ids, cache=cache, use_cache=True)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """One layer's keys and values in a buffer of spare capacity; ``keys``/``values`` are views of the
    filled part (so everything that reads a ``DynamicLayer`` reads this one the same way)."""

    def __init__(self, capacity: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        room = max(self.capacity, key_states.shape[-2])
        self._keys = key_states.new_empty(*key_states.shape[:-2], room, key_states.shape[-1])
        self._values = value_states.new_empty(*value_states.shape[:-2], room, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._keys[..., : self.length, :], self._values[..., : self.length, :]

    def _grow(self, needed: int) -> None:
        room = max(needed, 2 * self._keys.shape[-2])
        keys = self._keys.new_empty(*self._keys.shape[:-2], room, self._keys.shape[-1])
        values = self._values.new_empty(*self._values.shape[:-2], room, self._values.shape[-1])
        keys[..., : self.length, :] = self._keys[..., : self.length, :]
        values[..., : self.length, :] = self._values[..., : self.length, :]
        self._keys, self._values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self.length + new > self._keys.shape[-2]:
            self._grow(self.length + new)
        self._keys[..., self.length : self.length + new, :] = key_states
        self._values[..., self.length : self.length + new, :] = value_states
        self.length += new
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' negative count); the buffer stays."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length - abs(int(tokens_to_remove)))
        self._views()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:  # pragma: no cover - batch size 1 here
        raise NotImplementedError("GrowingCache holds one sequence (batch size 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError("GrowingCache holds one sequence (batch size 1)")


class GrowingCache(Cache):
    """A ``Cache`` of :class:`GrowingLayer` (one per decoder layer, made as the model first calls it);
    ``capacity``: the tokens each layer has room for before its first doubling (the context plus what a
    question and its answer add, when known)."""

    def __init__(self, capacity: int = 0):
        super().__init__(layer_class_to_replicate=lambda: GrowingLayer(capacity))
