"""Stage 1: long plain-text spans with interleaved L1 tokens (``acre-train preprocess stage1``).

Pipeline: read records -> tokenize documents (cached per inputs + tokenizer; in this process for a fast
tokenizer, which uses every core itself, else in ``num_proc`` worker processes) ->
sample spans (sequential, cheap: token offsets only) -> build rows with the interleave plan
(``num_proc`` processes, ``parallel.ordered_map``) -> write atomically with a manifest.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import DataError, InputProblems
from .output import FORMAT_VERSION, fingerprint, no_usable_record
from .parallel import ordered_map
from .prepare import Built, Preparation, input_records, prepare
from .rows import column_values, features, flat_list_array, plan_row, rows_table
from .settings import Stage1Settings
from .spans import Segment, iter_spans
from .tokenizer import BatchEncoder, open_tokenizer
from ..files import atomic_dir, cache_root


def iter_documents(settings: Stage1Settings, problems: InputProblems) -> Iterator[dict[str, str]]:
    """``{"text", "source", "meta"}`` of every valid record; bad ones reported with file:line."""
    field = settings.text_field
    for record in input_records(settings, problems):
        if field not in record.data:
            problems.report(record.source, record.line, f"missing field {field!r}")
            continue
        text = record.data[field]
        if not isinstance(text, str):
            problems.report(record.source, record.line, f"field {field!r} is not a string", type(text).__name__)
            continue
        if not text.strip():
            problems.report(record.source, record.line, f"empty {field!r}")
            continue
        meta = record.data.get(settings.meta_field)
        yield {"text": text, "source": record.where, "meta": json.dumps(meta, sort_keys=True, default=str)}


def tokenized_documents(settings: Stage1Settings, tokenizer: Any, key: str, problems: InputProblems):
    """Tokenized documents, reused from the cache when inputs, fields and tokenizer match.

    The cache is one Arrow file, written in place by the tokenizing pass (no second copy)."""
    import datasets

    cache = Path(settings.cache_dir or cache_root()) / "prep" / f"tokens-{key[:24]}"
    report = cache / "problems.json"
    if report.exists():
        saved = json.loads(report.read_text(encoding="utf-8"))
        problems.counts.update(saved["by_reason"])
        problems.examples.extend(saved["examples"])
        return datasets.Dataset.from_file(str(cache / "tokens.arrow"))

    # Several preparations may fill this cache at once: leave their partial folders alone, and keep
    # whichever finished first.
    with atomic_dir(cache, f"the tokenized cache {cache}", clear_stale=False, keep_existing=True) as tmp:
        workers = settings.num_proc if settings.num_proc > 1 and not _encodes_on_every_core(tokenizer) else 1
        # (workers would only add copies to a tokenizer that already uses every core)
        _tokenize(settings, tokenizer, problems, tmp / "tokens.arrow", workers)
        (tmp / "problems.json").write_text(json.dumps(problems.as_dict()), encoding="utf-8")
    return datasets.Dataset.from_file(str(cache / "tokens.arrow"))


def _encodes_on_every_core(tokenizer: Any) -> bool:
    """A fast (Rust) tokenizer encodes a batch on every core unless ``TOKENIZERS_PARALLELISM`` turns that off."""
    flag = os.environ.get("TOKENIZERS_PARALLELISM", "true").strip().lower()
    return BatchEncoder(tokenizer).rust is not None and flag not in ("0", "false", "off", "no")


def _tokenize(settings: Stage1Settings, tokenizer: Any, problems: InputProblems, path: Path, workers: int,
              batch_docs: int = 256) -> None:
    """Read, tokenize and write Arrow in one pass, batch by batch, in input order: in this process
    (``workers == 1``: a fast tokenizer's batched encode already uses every core), or in ``workers``
    processes (``parallel.ordered_map``; the records are still read here)."""
    from datasets.arrow_writer import ArrowWriter
    from datasets.utils.tqdm import tqdm  # (silenced with datasets' own progress bars)

    docs = iter(tqdm(iter_documents(settings, problems), desc="tokenizing", unit=" docs"))
    batches = iter(lambda: list(itertools.islice(docs, batch_docs)), [])
    with ArrowWriter(path=str(path), features=_tokenized_features()) as writer:
        for batch, (flat, lengths) in ordered_map(_flat_ids, batches, BatchEncoder(tokenizer), workers):
            writer.write_table(_tokenized_table(flat, lengths, batch))
        written, _ = writer.finalize()
    if written == 0:
        raise DataError(no_usable_record(problems))


def _flat_ids(encoder: BatchEncoder, docs: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """All the documents' ids concatenated (int32) and each one's count: cheap to send between processes."""
    ids = encoder([d["text"] for d in docs])  # no special tokens: spans start mid-document, a BOS would be noise
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())), lengths


def _tokenized_features():
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int32")), "num_tokens": Value("int64"),
                     "source": Value("string"), "meta": Value("string")})


def _tokenized_table(flat: np.ndarray, lengths: np.ndarray, docs: list[dict[str, str]]):
    """One Arrow table of a batch of tokenized documents (no per-token Python)."""
    import pyarrow as pa

    return pa.table({"input_ids": flat_list_array(flat, lengths, pa.int32()), "num_tokens": pa.array(lengths),
                     "source": pa.array([d["source"] for d in docs], pa.string()),
                     "meta": pa.array([d["meta"] for d in docs], pa.string())})


def span_ids(segments: list[Segment], fetch, eos_id: int) -> np.ndarray:
    """Token ids of a span: its segments joined by one EOS."""
    parts: list[np.ndarray] = []
    for k, (doc, start, end) in enumerate(segments):
        if k:
            parts.append(np.asarray([eos_id], dtype=np.int64))
        parts.append(np.asarray(fetch(doc), dtype=np.int64)[start:end])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def stage1_row(sample_index: int, segments: list[Segment], fetch, sources, settings: Stage1Settings,
               eos_id: int, l1_id: int) -> dict[str, Any]:
    """One stage-1 output row (``meta``: JSON list of the span's source segments)."""
    raw = span_ids(segments, fetch, eos_id)
    row = plan_row(raw, None, settings, sample_index, l1_id)
    row["meta"] = json.dumps([
        {"source": sources(d)[0], "start": int(s), "end": int(e), "meta": json.loads(sources(d)[1])}
        for d, s, e in segments
    ])
    return row


def _span_rows(state: tuple, batch: tuple[int, list[list[Segment]]]):
    """A batch of spans (its first sample index, the spans) -> their stage-1 rows, as one Arrow table."""
    docs, settings, eos_id, l1_id = state
    # Straight from the memory-mapped Arrow table: ``docs[i]`` would format the whole row (a document's
    # token list into Python) for each segment, which cost more than the interleaving itself.
    table = docs.data
    ids, source, meta = table.column("input_ids"), table.column("source"), table.column("meta")

    def fetch(d):
        return ids[int(d)].values.to_numpy(zero_copy_only=False)

    def sources(d):
        return source[int(d)].as_py(), meta[int(d)].as_py()

    first, spans = batch
    rows = [stage1_row(first + k, span, fetch, sources, settings, eos_id, l1_id) for k, span in enumerate(spans)]
    return rows_table(rows, _stage1_schema())


@functools.lru_cache(maxsize=None)
def _stage1_schema():
    return features(1).arrow_schema


def _spans(settings: Stage1Settings, lengths) -> Iterator[list[Segment]]:
    return iter_spans(lengths, min_length=settings.min_length, max_length=settings.max_length,
                      token_budget=settings.token_budget, pack=settings.pack, seed=settings.seed)


def prepare_stage1(settings: Stage1Settings, log=print) -> Path:
    """Prepare the stage-1 dataset at ``settings.output``; reuse it if already made identically."""
    return prepare(settings, _stage1_rows, log)


def _stage1_rows(settings: Stage1Settings, prep: Preparation) -> Built:
    """Tokenize the documents (cached per inputs + tokenizer), sample spans, interleave each span."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    read_key = fingerprint(FORMAT_VERSION, prep.inputs, settings.text_field, settings.meta_field, settings.strict,
                           prep.tok_facts["fingerprint"])  # strict decides which records survive
    docs = tokenized_documents(settings, prep.tokenizer, read_key, prep.problems)
    lengths = column_values(docs, "num_tokens")
    spans = list(_spans(settings, enumerate(lengths)))
    if not spans:
        raise DataError(
            f"no span: {len(lengths)} documents, the longest has {max(lengths, default=0)} tokens "
            f"and {sum(lengths)} in all, below min_length={settings.min_length}"
            + ("" if settings.pack else " (packing is off: pass --pack to join short documents)")
        )
    # One file, written in order straight into the output (parallel.py: why not datasets.map).
    batches = ((start, spans[start : start + 64]) for start in range(0, len(spans), 64))
    path = prep.rows_file or prep.work / "rows.arrow"
    with ArrowWriter(path=str(path), features=features(1)) as writer:
        for _, table in ordered_map(_span_rows, batches, (docs, settings, prep.tokenizer.eos_token_id, prep.l1_id),
                                    settings.num_proc):
            writer.write_table(table)
        writer.finalize()
    rows = datasets.Dataset.from_file(str(path))
    return Built(rows, {"documents": len(lengths), "document_tokens": int(sum(lengths))})


def preview_stage1(settings: Stage1Settings, n: int) -> tuple[list[dict[str, Any]], Any]:
    """The first ``n`` stage-1 rows, built lazily without writing anything (for ``--debug``)."""
    tok, l1_id, _ = open_tokenizer(settings)
    problems = InputProblems(strict=settings.strict)
    store: dict[int, tuple[list[int], str, str]] = {}

    def lengths():
        for i, doc in enumerate(iter_documents(settings, problems)):
            ids = tok(doc["text"], add_special_tokens=False)["input_ids"]
            store[i] = (ids, doc["source"], doc["meta"])
            yield i, len(ids)

    rows = []
    for index, span in enumerate(_spans(settings, lengths())):
        rows.append(stage1_row(index, span, lambda d: store[d][0], lambda d: store[d][1:], settings,
                               tok.eos_token_id, l1_id))
        if len(rows) >= n:
            break
    if not rows:
        raise DataError(f"no span of at least min_length={settings.min_length} tokens in the input")
    return rows, tok
