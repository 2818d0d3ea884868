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


def list_array(values: Sequence, value_type) -> "pyarrow.ListArray":  # noqa: F821
    """One Arrow list column from per-row sequences (numpy arrays or lists of ints): their lengths as the
    offsets and one concatenated array of ``value_type``, so no token goes through Python one by one."""
    import itertools

    dtype = value_type.to_pandas_dtype()
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    if values and isinstance(values[0], np.ndarray):
        flat = np.concatenate(values).astype(dtype, copy=False)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(values), dtype=dtype, count=int(lengths.sum()))
    return flat_list_array(flat, lengths, value_type)


def flat_list_array(flat: np.ndarray, lengths: np.ndarray, value_type) -> "pyarrow.ListArray":  # noqa: F821
    """An Arrow list column from all rows' values concatenated (``flat``) and each row's length."""
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, value_type), type=pa.list_(value_type))


def rows_table(rows: list[dict[str, Any]], schema) -> "pyarrow.Table":  # noqa: F821
    """Output rows as one Arrow table of ``schema`` (``features(...).arrow_schema``), list columns through
    :func:`list_array`: ``datasets`` would convert every row's token columns one by one (it cost more than
    interleaving the rows)."""
    import pyarrow as pa

    columns = []
    for field in schema:
        values = [row[field.name] for row in rows]
        columns.append(list_array(values, field.type.value_type) if pa.types.is_list(field.type)
                       else pa.array(values, field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def column_values(rows, name: str) -> list:
    """A ``datasets.Dataset`` column as a Python list, read from Arrow in one call (selections honoured).

    Iterating ``rows[name]`` formats each row apart, which costs as much as the rest of a small
    preparation's bookkeeping."""
    return rows.select_columns([name]).with_format("arrow")[:].column(name).to_pylist()
