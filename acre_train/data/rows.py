"""One output row: the interleave plan of a raw sequence plus per-sample facts (shared by both stages)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..modeling.interleave import interleave, num_chunks, sample_intervals
from .settings import PlanSettings


def features(stage: int, packed: bool = False):
    """The Arrow schema of output rows. Token columns are int32 (half the disk of int64; every
    vocabulary and position fits); ``is_l1`` is bool. Collators cast to int64 as torch needs."""
    from datasets import Features, List, Value

    ints = List(Value("int32"))
    spec = {
        "input_ids": ints, "is_l1": List(Value("bool")), "chunk_ids": ints, "positions": ints,
        "memory_positions": ints, "labels": ints, "raw_index": ints,
        "num_raw_tokens": Value("int64"), "intervals": ints, "sample_index": Value("int64"),
        "meta": Value("string"),
    }
    if stage == 2:
        spec["num_answer_tokens"] = Value("int64")
        spec["status"] = Value("string")  # ok | truncated | dropped:<reason>; removed before saving
        # Raw-token coordinates: evidence token ranges flattened [a0, b0, a1, b1, ...] (empty: none
        # recorded) and the question's [start, end) (the tokens after the context, before the answer).
        spec["evidence"] = ints
        spec["question"] = ints
        if packed:  # several [start, end) pairs in "question"; the question of each evidence range
            spec["evidence_question"] = ints
    return Features(spec)


def plan_row(
    raw_ids: Sequence[int] | np.ndarray,
    raw_labels: Sequence[int] | np.ndarray | None,
    plan: PlanSettings,
    sample_index: int,
    l1_token_id: int,
) -> dict[str, Any]:
    """Interleave ``raw_ids`` with intervals drawn from ``(plan.seed, sample_index)``.

    The per-sample seed makes the intervals independent of processing order and ``num_proc``.
    """
    raw = np.asarray(raw_ids, dtype=np.int64)
    count = num_chunks(len(raw), plan.first_chunk, plan.stride)
    intervals = sample_intervals(count, plan.intervals, seed=(plan.seed, int(sample_index)))
    result = interleave(
        raw, first_chunk=plan.first_chunk, stride=plan.stride, intervals=intervals,
        raw_labels=raw_labels, l1_token_id=l1_token_id,
    )
    row: dict[str, Any] = {
        k: (v if k == "is_l1" else v.astype(np.int32)) for k, v in result.as_dict().items()
    }
    row.update(num_raw_tokens=len(raw), intervals=list(result.intervals), sample_index=int(sample_index))
    return row
