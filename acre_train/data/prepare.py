"""The one preparation skeleton both stages share: reuse -> temporary -> atomic -> manifest.

A stage supplies only its row builder (``stage1.py``: spans of plain text; ``stage2.py``: chat
samples); :func:`prepare` does the rest the same way for both:

1. the key (settings, input bytes, tokenizer): a dataset already at the output with that key is reused;
2. rows are built in a temporary folder (``datasets`` caches, Arrow files);
3. the dataset is written to a hidden sibling of the output and renamed into place, manifest last, so
   a killed run never leaves something that looks complete (``output.atomic_output``);
4. the manifest: counts, token totals, histograms, the exact settings and the input hashes.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .builtin import BUILTIN_TEXT_SOURCE, builtin_text
from .errors import DataError, InputProblems
from .output import (
    FORMAT_VERSION, ROWS_FILE, atomic_output, fingerprint, interval_histogram, length_histogram, read_manifest,
    reusable, save_rows, write_manifest,
)
from .readers import Record, describe_inputs, expand_inputs, read_files, read_hub_dataset
from .rows import column_values
from .settings import Stage1Settings, Stage2Settings
from .tokenizer import open_tokenizer

Settings = Stage1Settings | Stage2Settings


def input_records(settings: Settings, problems: InputProblems) -> Iterator[Record]:
    """Records of the settings' input (files, a ``datasets`` name, or the built-in text)."""
    if settings.builtin:
        for i, data in enumerate(builtin_text(), start=1):
            yield Record(data, BUILTIN_TEXT_SOURCE, i)
    elif settings.dataset_name:
        yield from read_hub_dataset(settings.dataset_name, settings.dataset_config, settings.dataset_split)
    else:
        yield from read_files(expand_inputs(settings.inputs), problems)


def describe_source(settings: Settings) -> list[dict[str, Any]]:
    """What the input is, for the manifest and the cache key (file hashes for files)."""
    if settings.builtin:
        return [{"builtin": BUILTIN_TEXT_SOURCE if isinstance(settings, Stage1Settings) else "squad_v2_sample.json",
                 "python": sys.version.split()[0]}]
    if settings.dataset_name:
        # Hub datasets have no cheap content hash: name, config and split are the key.
        return [{"dataset": settings.dataset_name, "config": settings.dataset_config, "split": settings.dataset_split}]
    return describe_inputs(expand_inputs(settings.inputs))


def preparation_key(settings: Settings, tok_facts: dict[str, Any] | None = None) -> str:
    """The fingerprint a prepared dataset must carry to be reused: settings, input bytes, tokenizer."""
    if tok_facts is None:
        tok_facts = open_tokenizer(settings)[2]
    stage = "stage1" if isinstance(settings, Stage1Settings) else "stage2"
    return fingerprint(FORMAT_VERSION, stage, settings.output_dict(), describe_source(settings), tok_facts["fingerprint"])


def prepared_state(settings: Settings) -> str:
    """``"missing"`` (nothing prepared at the output), ``"current"`` (reusable) or ``"stale"``
    (made from other settings, inputs or tokenizer): what ``validate`` reports before training."""
    if read_manifest(settings.output) is None:
        return "missing"
    return "current" if reusable(settings.output, preparation_key(settings)) else "stale"


@dataclass(frozen=True)
class Preparation:
    """What a row builder gets: the opened tokenizer, the L1 token id, the key, a scratch folder, and where
    the rows may be written in place (``rows_file``: one Arrow file in the output being built)."""

    tokenizer: Any
    l1_id: int
    tok_facts: dict[str, Any]
    inputs: list[dict[str, Any]]  # describe_source: what the input is (file hashes)
    key: str
    work: Path
    problems: InputProblems
    rows_file: Path | None = None


@dataclass
class Built:
    """What a row builder returns: the rows to write and what the manifest and the log add for its stage."""

    rows: Any  # datasets.Dataset
    counts: dict[str, int]  # stage-specific counts beside the shared ones
    manifest: dict[str, Any] = field(default_factory=dict)  # extra top-level manifest fields
    summary: str = ""  # appended to "wrote N samples to OUT"
    warnings: list[str] = field(default_factory=list)


RowBuilder = Callable[[Settings, Preparation], Built]


def prepare(settings: Settings, build_rows: RowBuilder, log: Callable[[str], Any] = print) -> Path:
    """Prepare ``settings.output`` with ``build_rows``, or reuse what is there when made identically."""
    stage = 1 if isinstance(settings, Stage1Settings) else 2
    if settings.output is None:
        raise DataError(f"stage {stage} needs an output directory")
    tok, l1_id, tok_facts = open_tokenizer(settings)
    inputs = describe_source(settings)
    key = preparation_key(settings, tok_facts)
    if not settings.overwrite and (manifest := reusable(settings.output, key)):
        log(f"reusing {settings.output} (same settings, inputs and tokenizer; {manifest['counts']['samples']} samples)")
        return settings.output

    problems = InputProblems(strict=settings.strict)
    with tempfile.TemporaryDirectory(prefix="acre-prep-") as work, \
            atomic_output(settings.output, overwrite=settings.overwrite) as out:
        built = build_rows(settings, Preparation(tok, l1_id, tok_facts, inputs, key, Path(work), problems,
                                                 rows_file=out / ROWS_FILE))
        save_rows(built.rows, out, key)
        manifest = build_manifest(stage, settings, built.rows, inputs, tok_facts, l1_id, problems, key, built.counts)
        write_manifest(out, {**manifest, **built.manifest})
    log(f"wrote {len(built.rows)} samples to {settings.output}{built.summary}")
    for warning in built.warnings:
        log(warning)
    return settings.output


def build_manifest(stage: int, settings: Settings, rows, inputs, tok_facts, l1_id: int, problems: InputProblems,
                   key: str, extra_counts: dict[str, int]) -> dict[str, Any]:
    """Counts, token totals, histograms, the exact settings and the input hashes."""
    import pyarrow.compute as pc

    raw = column_values(rows, "num_raw_tokens")
    intervals = column_values(rows, "intervals")
    # Interleaved lengths straight from Arrow's list offsets: no token values are read.
    total = int(pc.sum(pc.list_value_length(rows.data.column("input_ids"))).as_py() or 0)
    counts = {
        "samples": len(rows),
        "raw_tokens": sum(raw),
        "l1_tokens": total - sum(raw),
        "total_tokens": total,
        **extra_counts,
    }
    if stage == 1:
        counts["label_tokens"] = sum(max(n - 1, 0) for n in raw)
    return {
        "format_version": FORMAT_VERSION,
        "stage": stage,
        "fingerprint": key,
        "plan": {"first_chunk": settings.first_chunk, "stride": settings.stride,
                 "intervals": list(settings.intervals), "seed": settings.seed, "l1_token_id": l1_id,
                 "min_length": settings.min_length, "max_length": settings.max_length,
                 "interval_seed": "sample_intervals(n_chunks, intervals, seed=(seed, sample_index))"},
        "columns": list(rows.column_names),
        "dtypes": {"token columns": "int32", "is_l1": "bool"},
        "counts": counts,
        "skipped": problems.as_dict(),
        "histograms": {"raw_length": length_histogram(raw), "interval_chunks": interval_histogram(intervals)},
        "settings": settings.to_dict(),
        "inputs": inputs,
        "tokenizer": tok_facts,
    }
