"""A transformers ``Cache`` that grows in place: the baselines' decoding at its floor.

transformers' ``DynamicCache`` appends by concatenation, so every decoding step copies the whole
cache (0.75 GB per step for the 0.5B base at 32K tokens): the full-attention baseline then spends
more time copying than attending. ``StaticCache`` avoids the copy but attends over its whole
preallocated length, whatever is filled, and needs the length up front. ``GrowingCache`` keeps a
``KVBuffer`` (``modeling/kv_buffer.py``) per layer and hands the attention views of its filled part: the
same keys and values as ``DynamicCache``, with no per-step copy.

    >>> cache = GrowingCache(capacity=8192)  # doctest: +SKIP
    >>> model(input_ids=ids, cache=cache, use_cache=True)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..modeling.kv_buffer import KVBuffer


class GrowingLayer(DynamicLayer):
    """One layer's keys and values in a :class:`~acre_train.modeling.kv_buffer.KVBuffer`; ``keys``/``values``
    are views of the filled part (so everything that reads a ``DynamicLayer`` reads this one the same way)."""

    def __init__(self, capacity: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        self.buffer: KVBuffer | None = None

    @property
    def length(self) -> int:
        return self.buffer.length if self.buffer is not None else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.buffer = KVBuffer.empty(key_states, max(self.capacity, key_states.shape[-2]), values_like=value_states)
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self.buffer.filled()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.buffer.append(key_states, value_states)
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
        self.buffer.length = max(0, self.buffer.length - abs(int(tokens_to_remove)))
        self._views()

    def reset(self) -> None:
        if self.is_initialized:
            self.buffer.length = 0
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
