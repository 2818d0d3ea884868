"""Padding interleaved samples into a batch (the collator's core; inference uses it too)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from .interleave import IGNORE_INDEX

# Per-token columns and the value padding takes. chunk_ids = -1 marks padding for every kernel.
PAD_VALUES: dict[str, int] = {
    "input_ids": 0,
    "is_l1": 0,
    "chunk_ids": -1,
    "positions": 0,
    "memory_positions": -1,
    "labels": IGNORE_INDEX,
    "raw_index": -1,
}
MODEL_INPUTS = ("input_ids", "is_l1", "chunk_ids", "positions", "memory_positions", "labels")


def pad_batch(
    samples: Sequence[Mapping[str, Sequence[int] | np.ndarray]],
    *,
    pad_token_id: int = 0,
    columns: Sequence[str] = MODEL_INPUTS,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad per-token columns of interleaved samples to one ``[B, n]`` tensor each.

    >>> from acre_train.modeling import interleave
    >>> batch = pad_batch([interleave([5, 6, 7], first_chunk=4, stride=4, intervals=2).as_dict()])
    >>> batch["is_l1"].tolist(), batch["chunk_ids"].tolist()
    ([[False, False, True, False]], [[0, 0, 0, 0]])
    """
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    length = max(len(s["input_ids"]) for s in samples)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    batch: dict[str, torch.Tensor] = {}
    for column in columns:
        pad = pad_token_id if column == "input_ids" else PAD_VALUES[column]
        out = np.full((len(samples), length), pad, dtype=np.int64)
        for row, sample in enumerate(samples):
            values = np.asarray(sample[column], dtype=np.int64)
            out[row, : values.shape[0]] = values
        batch[column] = torch.from_numpy(out)
    if "is_l1" in batch:
        batch["is_l1"] = batch["is_l1"].bool()
    return batch
