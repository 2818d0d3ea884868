"""Keys and values that grow along their token axis in place: the one buffer behind a cache build's L1
memory, the engine's refilled cache as a question and its answer extend it, and the full-attention
baselines' ``GrowingCache``.

Concatenating per new token copies the whole cache every step (0.75 GB per decoding step for the 0.5B
base at 32K tokens). A buffer with spare room writes new entries in place and hands out views of the
filled part; when it runs out it doubles, so a copy happens O(log n) times, not once per token.

    >>> buf = KVBuffer.empty(torch.zeros(2, 1, 0, 4), capacity=3)
    >>> buf.append(torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4)); buf.length, buf.capacity
    (2, 3)
    >>> buf.append(torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4)); buf.length, buf.capacity
    (4, 6)
"""

from __future__ import annotations

import torch


class KVBuffer:
    """``keys``/``values`` ``[..., capacity, D]`` of which the first ``length`` tokens are filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int = 0):
        self.keys, self.values, self.length = keys, values, length

    @classmethod
    def empty(cls, like: torch.Tensor, capacity: int, *, values_like: torch.Tensor | None = None,
              pin_memory: bool = False) -> "KVBuffer":
        """An empty buffer of ``capacity`` tokens with ``like``'s leading dims, head dim, dtype and device."""
        def make(t: torch.Tensor) -> torch.Tensor:
            shape = (*t.shape[:-2], capacity, t.shape[-1])
            return torch.empty(shape, dtype=t.dtype, device=t.device, pin_memory=pin_memory)

        return cls(make(like), make(like if values_like is None else values_like))

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[-2])

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` tokens: the buffer at least doubles when it grows, keeping everything written
        (tokens written but not yet committed too)."""
        if needed <= self.capacity:
            return
        old, old_values = self.capacity, self.values
        grown = KVBuffer.empty(self.keys, max(needed, 2 * old), values_like=old_values)
        grown.keys[..., :old, :], grown.values[..., :old, :] = self.keys, old_values
        self.keys, self.values = grown.keys, grown.values

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, index: int | None = None) -> None:
        """Write tokens at ``start`` (of leading row ``index``, or of every row) without counting them as
        filled: a build writes a chunk layer by layer and :meth:`commit`s it once every layer has run."""
        end = start + keys.shape[-2]
        self.reserve(end)
        if index is None:
            self.keys[..., start:end, :], self.values[..., start:end, :] = keys, values
        else:
            self.keys[index, ..., start:end, :], self.values[index, ..., start:end, :] = keys, values

    def commit(self, count: int) -> None:
        """Count ``count`` more tokens as filled (written by :meth:`write`)."""
        if self.length + count > self.capacity:
            raise ValueError(f"commit of {count} tokens past a buffer of {self.capacity} holding {self.length}")
        self.length += count

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens after the filled part and count them."""
        self.write(self.length, keys, values)
        self.length += keys.shape[-2]

    def filled(self, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the filled keys and values (of leading row ``index``, or all)."""
        keys = self.keys if index is None else self.keys[index]
        values = self.values if index is None else self.values[index]
        return keys[..., : self.length, :], values[..., : self.length, :]
