"""Which samples each rank runs at each step, and how they become tensors.

The order of global batches depends only on the recipe's seed, the epoch and the global batch size,
never on how it is split into ranks, micro-batches and accumulation steps: so DDP, ZeRO-1/2 and any
``micro x accumulation`` split see the same samples per step (and their losses agree), and a resumed
run finds its place from the step number alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..modeling.batch import pad_batch
from ..modeling.interleave import IGNORE_INDEX

PLAN_COLUMNS = ("input_ids", "is_l1", "chunk_ids", "positions", "memory_positions", "labels")
REFILL_INPUTS = ("raw_index", "evidence", "question")  # what the refill-loss masks are built from


def list_lengths(dataset, column: str) -> np.ndarray:
    """Per-row length of a list column, read from Arrow offsets (no token values are read)."""
    import pyarrow.compute as pc

    table = dataset.data.column(column)
    lengths = pc.list_value_length(table).to_numpy(zero_copy_only=False)
    if getattr(dataset, "_indices", None) is not None:  # a .select()ed dataset maps rows through indices
        lengths = lengths[np.asarray(dataset._indices.column(0).to_numpy())]
    return lengths.astype(np.int64)


def split_held_out(dataset, share: float, seed: int):
    """``(training rows, held-out rows or None)``: a seeded ``share`` of the samples (at least one)
    never trained on, for the held-out loss."""
    if not share:
        return dataset, None
    order = np.random.default_rng(np.random.SeedSequence((seed, 0xE5A1))).permutation(len(dataset))
    n_eval = max(1, int(round(share * len(dataset))))
    if n_eval >= len(dataset):
        raise ValueError(f"data.eval_split={share} leaves no training sample of {len(dataset)}")
    return dataset.select(np.sort(order[n_eval:])), dataset.select(np.sort(order[:n_eval]))


def epoch_batches(
    chunks: np.ndarray, global_batch: int, *, epoch: int, seed: int, shuffle: bool = True, group_by_chunks: bool = True
) -> list[np.ndarray]:
    """Global batches (row-index arrays, most chunks first) of one epoch; a last partial one is dropped.

    With ``group_by_chunks`` samples are bucketed by chunk count and batches are cut from one
    bucket, so in that batch every micro-batch slot (on every rank) runs the same number of chunks;
    the leftovers of all buckets form the last few (mixed) batches, sorted to keep neighbours alike.
    Dropping the partial batch keeps every rank at the same number of steps (no collective hangs).
    """
    rng = np.random.default_rng(np.random.SeedSequence((seed, epoch)))
    order = rng.permutation(len(chunks)) if shuffle else np.arange(len(chunks))
    if not group_by_chunks:
        return [order[i : i + global_batch] for i in range(0, len(order) - global_batch + 1, global_batch)]
    batches: list[np.ndarray] = []
    leftovers: list[np.ndarray] = []
    for count in np.unique(chunks):
        bucket = order[chunks[order] == count]  # keeps the shuffled order inside the bucket
        full = len(bucket) - len(bucket) % global_batch
        batches += [bucket[i : i + global_batch] for i in range(0, full, global_batch)]
        leftovers.append(bucket[full:])
    rest = np.concatenate(leftovers) if leftovers else np.zeros(0, dtype=np.int64)
    rest = rest[np.argsort(-chunks[rest], kind="stable")]
    mixed = [rest[i : i + global_batch] for i in range(0, len(rest) - global_batch + 1, global_batch)]
    # Shuffle whole batches so buckets do not arrive in chunk-count order (lr schedule vs. length).
    batches = [batches[i] for i in (rng.permutation(len(batches)) if shuffle else range(len(batches)))]
    batches += mixed
    return [b[np.argsort(-chunks[b], kind="stable")] for b in batches]


def rank_micro_batches(batch: np.ndarray, *, rank: int, world_size: int, micro: int, accumulation: int) -> list[np.ndarray]:
    """This rank's micro-batches of one global batch: slot ``j`` of every rank holds neighbours in
    the sorted batch, so ranks run the same chunk counts at the same micro-step."""
    assert len(batch) == micro * world_size * accumulation, (len(batch), micro, world_size, accumulation)
    return [batch[(j * world_size + rank) * micro : (j * world_size + rank + 1) * micro] for j in range(accumulation)]


@dataclass
class Collator:
    """Rows -> padded tensors. ``vanilla`` drops the L1 slots (plain causal LM on the same data)."""

    vanilla: bool = False
    pad_token_id: int = 0
    refill: bool = False  # add the refill-loss masks (rows need raw_index, evidence, question)
    sim: Any = None  # refill_sim.SimSettings: samples in the refilled layout (rows need question, evidence)
    seed: int = 0

    def __call__(self, rows: Sequence[dict[str, Any]], step: int = 0) -> dict[str, torch.Tensor]:
        if self.sim is not None:
            from .refill_sim import collate_sim, force_draw, sim_sample

            batch = collate_sim([sim_sample(r, self.sim, force=[force_draw(
                self.seed, int(r.get("sample_index", 0)) * 1024 + j, step, self.sim.force_evidence)
                for j in range(max(1, len(r["question"]) // 2))]) for r in rows])
            batch["labels"] = batch["sim_open_labels"]  # what label_count and the loss scale read
            return batch
        if not self.vanilla:
            batch = pad_batch([{k: np.asarray(r[k]) for k in PLAN_COLUMNS} for r in rows], pad_token_id=self.pad_token_id)
            if self.refill:
                from .refill_loss import pad_masks

                batch.update(pad_masks(rows, batch["input_ids"].shape[1]))
            return batch
        samples = []
        for r in rows:
            raw = ~np.asarray(r["is_l1"], dtype=bool)
            # Labels were shifted over the raw sequence, so raw token p still predicts raw token p+1.
            samples.append({"input_ids": np.asarray(r["input_ids"])[raw], "labels": np.asarray(r["labels"])[raw],
                             "attention_mask": np.ones(int(raw.sum()), dtype=np.int64)})
        length = max(len(s["input_ids"]) for s in samples)
        out = {}
        for key, pad in (("input_ids", self.pad_token_id), ("labels", IGNORE_INDEX), ("attention_mask", 0)):
            tensor = np.full((len(samples), length), pad, dtype=np.int64)
            for i, s in enumerate(samples):
                tensor[i, : len(s[key])] = s[key]
            out[key] = torch.from_numpy(tensor)
        return out


def label_count(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())
