"""The interleave plan: where L1 tokens go, which chunk every token is in, and what it predicts.

This is the one function (``interleave``) that data preparation, the training collator and
inference all call (DESIGN.md §2). It is pure: plain Python/numpy in, plain numpy out.

Vocabulary used throughout acre-train:

* **raw** (L2) token: a token of the original text.
* **L1** token: inserted after every ``l_t`` raw tokens of chunk ``t``; it has no label and is
  embedded with the L1 embedding row.
* **chunk** ``t``: chunk 0 holds raw tokens ``[0, W0)``, every later chunk the next ``S`` raw tokens,
  the last one what remains. L1 tokens belong to the chunk of the raw token they follow.
* **position** of a token: ``M_t + i`` where ``M_t`` is the number of L1 tokens in chunks ``< t`` and
  ``i`` its index inside its chunk (raw and L1 tokens both count).
* **memory position** of an L1 token: its global L1 index ``j``; later chunks see it there.

This module must stay self-contained (numpy only, relative imports) because exports copy it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

IGNORE_INDEX = -100


@dataclass(frozen=True)
class InterleavePlan:
    """A raw sequence with L1 tokens interleaved. All arrays have the interleaved length.

    Attributes:
        input_ids: raw token ids; L1 slots hold ``l1_token_id`` (a placeholder: the model embeds
            them with the L1 embedding row, whatever id they carry).
        is_l1: True at L1 slots.
        chunk_ids: chunk index of every token.
        positions: ``M_t + i`` (compressed RoPE position).
        memory_positions: global L1 index ``j`` at L1 slots, -1 elsewhere.
        labels: target of every token: the next raw token's (shifted) label for raw tokens,
            ``IGNORE_INDEX`` for L1 tokens and for the last raw token.
        raw_index: index into the raw sequence for raw tokens, -1 for L1 tokens.
        intervals: the interval ``l_t`` used in every chunk.
        carry_out: raw tokens after the last L1 token (the next chunk's count starts here).
    """

    input_ids: np.ndarray
    is_l1: np.ndarray
    chunk_ids: np.ndarray
    positions: np.ndarray
    memory_positions: np.ndarray
    labels: np.ndarray
    raw_index: np.ndarray
    intervals: tuple[int, ...]
    carry_out: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_l1(self) -> int:
        return int(self.is_l1.sum())

    @property
    def num_chunks(self) -> int:
        return len(self.intervals)

    @property
    def max_position(self) -> int:
        """Largest RoPE position any token or L1 memory key takes (-1 for an empty plan)."""
        if len(self) == 0:
            return -1
        return int(max(self.positions.max(), self.memory_positions.max()))

    def as_dict(self) -> dict[str, np.ndarray]:
        """The per-token arrays, e.g. for a ``datasets`` row or a collator."""
        return {
            "input_ids": self.input_ids,
            "is_l1": self.is_l1,
            "chunk_ids": self.chunk_ids,
            "positions": self.positions,
            "memory_positions": self.memory_positions,
            "labels": self.labels,
            "raw_index": self.raw_index,
        }


def chunk_bounds(num_raw: int, first_chunk: int, stride: int) -> list[tuple[int, int]]:
    """Raw-token ``[start, end)`` of every chunk: ``[0, W0)``, then ``S`` at a time.

    >>> chunk_bounds(10, first_chunk=4, stride=3)
    [(0, 4), (4, 7), (7, 10)]
    """
    _check_positive(first_chunk=first_chunk, stride=stride)
    if num_raw < 0:
        raise ValueError(f"num_raw must be >= 0, got {num_raw}")
    bounds = [(0, min(first_chunk, num_raw))]
    start = bounds[0][1]
    while start < num_raw:
        bounds.append((start, min(start + stride, num_raw)))
        start = bounds[-1][1]
    return bounds


def num_chunks(num_raw: int, first_chunk: int, stride: int) -> int:
    """How many chunks ``num_raw`` raw tokens fill (at least one, even when empty)."""
    return len(chunk_bounds(num_raw, first_chunk, stride))


def sample_intervals(
    count: int, choices: Sequence[int], seed: int | Sequence[int]
) -> list[int]:
    """Draw one L1 interval per chunk, uniformly from ``choices``, reproducibly.

    ``seed`` may be a tuple such as ``(recipe_seed, sample_index)`` so that every sample gets its own
    deterministic stream, independent of processing order or worker count.

    >>> sample_intervals(3, [8, 16], seed=(0, 1)) == sample_intervals(3, [8, 16], seed=(0, 1))
    True
    """
    if not choices:
        raise ValueError("interval choices must not be empty")
    _check_positive(**{f"interval[{k}]": c for k, c in enumerate(choices)})
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    picks = rng.integers(0, len(choices), size=count)
    return [int(choices[p]) for p in picks]


def interleave(
    raw_ids: Sequence[int] | np.ndarray,
    *,
    first_chunk: int,
    stride: int,
    intervals: int | Sequence[int],
    raw_labels: Sequence[int] | np.ndarray | None = None,
    l1_token_id: int = 0,
    carry_in: int = 0,
    memory_offset: int = 0,
) -> InterleavePlan:
    """Interleave L1 tokens into ``raw_ids`` and lay out chunks, positions and labels.

    Args:
        raw_ids: the raw token ids ``x[0..n)``.
        first_chunk: ``W0``, raw tokens in chunk 0 (official recipe: 4096).
        stride: ``S``, raw tokens in every later chunk (official recipe: 2048).
        intervals: ``l_t`` for every chunk (a list with one entry per chunk), or one int for all.
        raw_labels: per raw token, the label in Hugging Face's unshifted convention (the token
            itself, or ``IGNORE_INDEX``); defaults to ``raw_ids``. Raw token ``p`` is trained to
            predict ``raw_labels[p + 1]``: the shift happens over the raw sequence, so no chunk
            boundary and no L1 slot loses a target.
        l1_token_id: id written at L1 slots (a placeholder).
        carry_in: raw tokens already counted towards the first L1 group (streaming).
        memory_offset: L1 tokens before this sequence (streaming: ``M`` of the first chunk).

    A remainder that does not fill a group carries over into the next chunk's count: the first L1
    token of chunk ``t`` follows raw token ``max(l_t - carry, 1)`` of that chunk (never the chunk's
    first slot, where it could not see what it summarises).

    >>> p = interleave([5, 6, 7, 8, 9], first_chunk=3, stride=2, intervals=[2, 2])
    >>> p.input_ids.tolist(), p.is_l1.astype(int).tolist()
    ([5, 6, 0, 7, 8, 0, 9], [0, 0, 1, 0, 0, 1, 0])
    >>> p.chunk_ids.tolist(), p.positions.tolist()
    ([0, 0, 0, 0, 1, 1, 1], [0, 1, 2, 3, 1, 2, 3])
    """
    raw = np.asarray(raw_ids, dtype=np.int64).reshape(-1)
    bounds = chunk_bounds(int(raw.shape[0]), first_chunk, stride)
    intervals = _per_chunk(intervals, bounds, first_chunk, stride)
    if carry_in < 0 or memory_offset < 0:
        raise ValueError("carry_in and memory_offset must be >= 0")
    targets = _shifted_targets(raw, raw_labels)
    l1_after, carry = _l1_offsets(bounds, intervals, carry_in)

    pieces: dict[str, list[np.ndarray]] = {k: [] for k in _PLAN_ARRAYS}
    num_l1_before = memory_offset
    for t, ((start, end), after) in enumerate(zip(bounds, l1_after)):
        chunk = _lay_out_chunk(raw[start:end], targets[start:end], start, after, l1_token_id, num_l1_before)
        chunk["chunk_ids"] = np.full(len(chunk["input_ids"]), t, dtype=np.int64)
        for key, array in chunk.items():
            pieces[key].append(array)
        num_l1_before += after.size

    arrays = {k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for k, v in pieces.items()}
    arrays["is_l1"] = arrays["is_l1"].astype(bool)
    return InterleavePlan(**arrays, intervals=intervals, carry_out=carry)


_PLAN_ARRAYS = ("input_ids", "is_l1", "chunk_ids", "positions", "memory_positions", "labels", "raw_index")


def _per_chunk(intervals: int | Sequence[int], bounds: list[tuple[int, int]], first_chunk: int,
               stride: int) -> tuple[int, ...]:
    """``l_t`` for every chunk (one int means the same for all), checked against the chunk count."""
    if isinstance(intervals, (int, np.integer)):
        intervals = [int(intervals)] * len(bounds)
    intervals = tuple(int(v) for v in intervals)
    if len(intervals) != len(bounds):
        n = bounds[-1][1] if bounds else 0
        raise ValueError(
            f"got {len(intervals)} intervals for {len(bounds)} chunks "
            f"({n} raw tokens, first_chunk={first_chunk}, stride={stride})"
        )
    _check_positive(**{f"interval of chunk {t}": v for t, v in enumerate(intervals)})
    return intervals


def _l1_offsets(bounds: list[tuple[int, int]], intervals: tuple[int, ...],
                carry_in: int) -> tuple[list[np.ndarray], int]:
    """For every chunk, the raw offsets (1-based inside the chunk) after which an L1 token goes, and
    the raw tokens left over after the last L1 token (they count towards the next chunk's first group)."""
    l1_after: list[np.ndarray] = []
    carry = carry_in
    for (start, end), interval in zip(bounds, intervals):
        size = end - start
        after = np.arange(max(interval - carry, 1), size + 1, interval, dtype=np.int64)
        l1_after.append(after)
        carry = size - int(after[-1]) if after.size else carry + size
    return l1_after, carry


def _lay_out_chunk(raw: np.ndarray, targets: np.ndarray, start: int, after: np.ndarray, l1_token_id: int,
                   num_l1_before: int) -> dict[str, np.ndarray]:
    """One chunk's slots: raw tokens with an L1 slot after each offset in ``after``, their ids, labels,
    positions (continuing after the ``num_l1_before`` earlier L1 tokens) and memory positions."""
    size = len(raw)
    length = size + after.size
    # Slot of raw token r (0-based in chunk) = r + number of L1 tokens inserted before it.
    raw_slot = np.arange(size) + np.searchsorted(after, np.arange(size), side="right")
    l1_slot = after + np.arange(after.size)  # the k-th L1 follows raw offset after[k]
    is_l1 = np.zeros(length, dtype=bool)
    is_l1[l1_slot] = True
    ids = np.full(length, l1_token_id, dtype=np.int64)
    ids[raw_slot] = raw
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    labels[raw_slot] = targets
    raw_index = np.full(length, -1, dtype=np.int64)
    raw_index[raw_slot] = np.arange(start, start + size)
    memory_positions = np.full(length, -1, dtype=np.int64)
    memory_positions[l1_slot] = num_l1_before + np.arange(after.size)
    return {"input_ids": ids, "is_l1": is_l1, "positions": num_l1_before + np.arange(length, dtype=np.int64),
            "memory_positions": memory_positions, "labels": labels, "raw_index": raw_index}


def _shifted_targets(raw: np.ndarray, raw_labels) -> np.ndarray:
    labels = raw if raw_labels is None else np.asarray(raw_labels, dtype=np.int64).reshape(-1)
    if labels.shape != raw.shape:
        raise ValueError(f"raw_labels has {labels.shape[0]} entries for {raw.shape[0]} raw tokens")
    targets = np.full_like(raw, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    return targets


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
