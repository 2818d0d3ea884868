"""Stage 2: chat-formatted long-context SFT samples with interleaved L1 tokens.

Pipeline: read records (messages / ShareGPT / alpaca) or build long-context QA from SQuAD-style
data -> render with the tokenizer's chat template, label the assistant answers (end-of-turn token
included) -> drop or middle-truncate over-long samples -> interleave -> write atomically.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .builtin import BUILTIN_QA_SOURCE, builtin_qa
from .chat import render_conversation, truncate_middle
from .errors import DataError, InputProblems
from .formats import to_messages
from .output import dataset_from_generator
from .prepare import Built, Preparation, input_records, prepare
from .readers import expand_inputs, read_files, read_hub_dataset
from .rows import column_values, features, plan_row
from ..modeling.interleave import IGNORE_INDEX
from .settings import Stage2Settings
from .squad import build_long_qa, load_squad_files, paragraphs_from_records, paragraphs_from_squad_json
from .tokenizer import open_tokenizer


def _squad_paragraphs(settings: Stage2Settings, problems: InputProblems):
    if settings.builtin:
        return paragraphs_from_squad_json(builtin_qa(), BUILTIN_QA_SOURCE, problems)
    if settings.dataset_name:
        return paragraphs_from_records(
            read_hub_dataset(settings.dataset_name, settings.dataset_config, settings.dataset_split), problems)
    files = expand_inputs(settings.inputs)
    whole_json = [p for p in files if p.name.lower().endswith(".json")]
    rows = [p for p in files if p not in whole_json]
    return load_squad_files(whole_json, problems) + paragraphs_from_records(read_files(rows, problems), problems)


def iter_examples(settings: Stage2Settings, tokenizer: Any, problems: InputProblems) -> Iterator[dict[str, str]]:
    """Conversations as ``{"messages", "context", "source", "meta"}`` (JSON strings), in input order."""
    if settings.format == "squad":
        paragraphs = _squad_paragraphs(settings, problems)
        if not paragraphs:
            raise DataError("the SQuAD input holds no paragraph")
        lengths = [len(x) for x in tokenizer([p.context for p in paragraphs], add_special_tokens=False)["input_ids"]]
        for ex in build_long_qa(paragraphs, lengths, context_tokens=settings.context_tokens,
                                questions_per_paragraph=settings.questions_per_paragraph, seed=settings.seed,
                                share_context=settings.pack_questions > 1):
            messages, context, evidence = ex.messages, ex.context, [list(e) for e in ex.evidence]
            if settings.system_prompt:
                messages = [{"role": "system", "content": settings.system_prompt}, *messages]
                context = (ex.context[0] + 1, *ex.context[1:])
                evidence = [[m + 1, a, b] for m, a, b in evidence]
            yield {"messages": json.dumps(messages), "context": json.dumps(context),
                   "source": f"squad:{ex.meta['id']}", "meta": json.dumps(ex.meta), "evidence": json.dumps(evidence)}
        return
    for record in input_records(settings, problems):
        try:
            messages = to_messages(record.data, settings.format, settings.system_prompt)
            evidence = evidence_spans(record.data.get("evidence"), messages, shift=len(messages) - _turns(record.data))
        except DataError as exc:
            problems.report(record.source, record.line, str(exc))
            continue
        meta = {k: v for k, v in record.data.items()
                if k not in ("messages", "conversations", "instruction", "input", "output", "evidence")}
        yield {"messages": json.dumps(messages), "context": "null", "source": record.where,
               "meta": json.dumps(meta, default=str), "evidence": json.dumps(evidence)}


def _turns(data: dict) -> int:
    """Messages of a record before a system prompt is added (evidence indices count these). An Alpaca
    record is two: 0 the user turn (instruction, a blank line, input), 1 the output."""
    turns = data.get("messages") or data.get("conversations")
    if isinstance(turns, list):
        return len(turns)
    return 2 if "instruction" in data and "output" in data else 0


def evidence_spans(value: Any, messages: list[dict[str, str]], shift: int = 0) -> list[list[int]]:
    """Validate a record's optional ``evidence``: ``[[message_index, char_start, char_end], ...]``,
    character ranges inside that message's content (where the answer's support lies). ``shift``:
    messages added in front (a system prompt)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise DataError(f"'evidence' must be a list of [message_index, char_start, char_end], got {type(value).__name__}")
    out = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)):
            raise DataError(f"'evidence' entry {item!r} is not [message_index, char_start, char_end] (integers)")
        index, start, end = item[0] + shift, item[1], item[2]
        if not 0 <= index < len(messages):
            raise DataError(f"'evidence' entry {item!r}: message {item[0]} does not exist")
        if messages[index]["role"] == "assistant":  # a refill brings back context, never the answer
            raise DataError(f"'evidence' entry {item!r} lies in message {item[0]}, an assistant turn; evidence "
                            "marks where the answer's support is in the context (a user or system turn)")
        if not 0 <= start < end <= len(messages[index]["content"]):
            raise DataError(f"'evidence' entry {item!r}: characters {start}..{end} are outside message {item[0]}'s "
                            f"content ({len(messages[index]['content'])} characters)")
        out.append([index, start, end])
    return out


def stage2_row(example: dict[str, str], sample_index: int, tokenizer: Any, settings: Stage2Settings,
               l1_id: int) -> dict[str, Any]:
    """One stage-2 row; ``status`` says ok / truncated / dropped:<reason> (dropped rows are empty)."""
    context = json.loads(example["context"])
    try:
        rendered = render_conversation(tokenizer, json.loads(example["messages"]),
                                       tuple(context) if context else None,
                                       evidence=[tuple(e) for e in json.loads(example.get("evidence") or "[]")])
    except DataError as exc:
        if settings.strict:
            raise DataError(f"{example['source']}: {exc}") from exc
        return _dropped(sample_index, f"dropped:{exc}")
    status = "ok"
    if len(rendered.input_ids) > settings.max_length:
        if settings.overlong == "drop":
            return _dropped(sample_index, "dropped:overlong")
        truncated = truncate_middle(rendered, settings.max_length)
        if truncated is None:
            return _dropped(sample_index, "dropped:overlong (context too short to cut)")
        rendered, status = truncated, "truncated"
    if len(rendered.input_ids) < settings.min_length:
        return _dropped(sample_index, "dropped:shorter than min_length")
    if rendered.num_answer_tokens == 0:
        return _dropped(sample_index, "dropped:no answer token")
    row = plan_row(rendered.input_ids, rendered.labels, settings, sample_index, l1_id)
    meta = json.loads(example["meta"])
    meta["source"] = example["source"]
    row.update(meta=json.dumps(meta), num_answer_tokens=rendered.num_answer_tokens, status=status,
               evidence=np.asarray([i for span in rendered.evidence_tokens for i in span], dtype=np.int32),
               question=np.asarray(rendered.question_tokens, dtype=np.int32))
    return row


def _dropped(sample_index: int, status: str) -> dict[str, Any]:
    # Typed empties: untyped [] makes Arrow infer float for a batch of only dropped rows.
    empty = np.zeros(0, dtype=np.int32)
    return {"input_ids": empty, "is_l1": np.zeros(0, dtype=bool), "chunk_ids": empty, "positions": empty, "memory_positions": empty,
            "labels": empty, "raw_index": empty, "num_raw_tokens": 0, "intervals": empty,
            "sample_index": sample_index, "meta": "{}", "num_answer_tokens": 0, "status": status,
            "evidence": empty, "question": empty}


def _map_example(example: dict, index: int, tokenizer: Any, settings: Stage2Settings, l1_id: int) -> dict:
    return stage2_row(example, index, tokenizer, settings, l1_id)


def prepare_stage2(settings: Stage2Settings, log=print) -> Path:
    """Prepare the stage-2 dataset at ``settings.output``; reuse it if already made identically."""
    return prepare(settings, _stage2_rows, log)


def _stage2_rows(settings: Stage2Settings, prep: Preparation) -> Built:
    """Read the conversations, render and interleave each, drop the over-long, pack questions if asked."""
    import datasets

    nproc = settings.num_proc if settings.num_proc > 1 else None

    def generate():
        yield from islice(iter_examples(settings, prep.tokenizer, prep.problems), settings.max_samples)

    examples = dataset_from_generator(generate, prep.work / "gen", features=datasets.Features(
        {k: datasets.Value("string") for k in ("messages", "context", "source", "meta", "evidence")}), problems=prep.problems)
    rows = examples.map(
        _map_example, with_indices=True, fn_kwargs={"tokenizer": prep.tokenizer, "settings": settings, "l1_id": prep.l1_id},
        remove_columns=examples.column_names, features=features(2), num_proc=nproc,
        cache_file_name=str(prep.work / "rows.arrow"), new_fingerprint=prep.key[:32], desc="rendering",
    )
    statuses = Counter(column_values(rows, "status"))
    kept = rows.filter(lambda s: not s.startswith("dropped"), input_columns="status",
                       cache_file_name=str(prep.work / "kept.arrow"), new_fingerprint=prep.key[32:64])
    dropped = {s: c for s, c in sorted(statuses.items()) if s.startswith("dropped")}
    if len(kept) == 0:
        raise DataError(f"every one of {len(examples)} conversations was dropped: {dropped}")
    kept = kept.remove_columns("status")
    if settings.pack_questions > 1:
        kept = pack_dataset(kept, settings, prep.l1_id)
    counts = {"examples": len(examples), "truncated": statuses.get("truncated", 0),
              "dropped": sum(dropped.values()), "answer_tokens": int(sum(column_values(kept, "num_answer_tokens"))),
              "with_evidence": int(sum(1 for e in column_values(kept, "evidence") if len(e))),
              "pack_questions": settings.pack_questions, "questions": int(sum(len(q) // 2 for q in column_values(kept, "question")))}
    marked = sum(1 for e in column_values(examples, "evidence") if e not in ("[]", "", None))  # conversations marking evidence
    with_evidence = f", {counts['with_evidence']} with evidence of {marked} marked" if marked else ""
    warnings = []
    if marked and not counts["with_evidence"]:
        warnings.append(f"warning: {marked} conversations mark evidence, but none of it survived into a sample (cut by "
                        "truncation?): refill training (train.refill_loss / refill_sim) will have nothing to refill")
    return Built(kept, counts, manifest={"dropped_by_reason": dropped},
                 summary=f" ({counts['truncated']} truncated, {counts['dropped']} dropped{with_evidence})", warnings=warnings)


def pack_rows(rows: list[dict[str, Any]], pack: int, settings: Stage2Settings, l1_id: int) -> list[dict[str, Any]]:
    """Rows -> packed rows: consecutive rows whose raw tokens before the question are identical (the same
    context) become one row of that context followed by up to ``pack`` question+answer segments.

    Each segment keeps its own labels; ``question`` lists every segment's ``[start, end)`` and
    ``evidence_question`` the segment each evidence range belongs to. Only ``train.refill_sim``
    trains such rows correctly (it answers each segment over the context alone).
    """
    out: list[dict[str, Any]] = []
    group: list[tuple[dict[str, Any], np.ndarray, np.ndarray]] = []

    def flush() -> None:
        if not group:
            return
        first, raw0, _ = group[0]
        start = int(first["question"][0])
        raw, labels = [raw0[:start]], [np.full(start, IGNORE_INDEX, dtype=np.int64)]
        question, evidence, owner, metas, offset = [], [], [], [], start
        for j, (row, raw_j, unshifted_j) in enumerate(group):
            q0, q1 = int(row["question"][0]), int(row["question"][1])
            raw.append(raw_j[q0:])
            labels.append(unshifted_j[q0:])
            question += [offset, offset + q1 - q0]
            offset += len(raw_j) - q0
            pairs = np.asarray(row["evidence"], dtype=np.int64).reshape(-1, 2)
            evidence += pairs.reshape(-1).tolist()
            owner += [j] * len(pairs)
            metas.append(json.loads(row["meta"]))
        packed = plan_row(np.concatenate(raw), np.concatenate(labels), settings, int(first["sample_index"]), l1_id)
        packed.update(meta=json.dumps({"packed": metas}), num_answer_tokens=int(sum(r["num_answer_tokens"] for r, _, _ in group)),
                      evidence=np.asarray(evidence, dtype=np.int32), question=np.asarray(question, dtype=np.int32),
                      evidence_question=np.asarray(owner, dtype=np.int32))
        out.append(packed)
        group.clear()

    for row in rows:
        is_l1 = np.asarray(row["is_l1"], dtype=bool)
        raw = np.asarray(row["input_ids"], dtype=np.int64)[~is_l1]
        shifted = np.asarray(row["labels"], dtype=np.int64)[~is_l1]
        unshifted = np.concatenate([[IGNORE_INDEX], shifted[:-1]])  # the HF convention plan_row takes
        start = int(row["question"][0]) if len(row["question"]) == 2 else -1
        same = bool(group) and start == int(group[0][0]["question"][0]) and np.array_equal(raw[:start], group[0][1][:start])
        if group and (len(group) == pack or not same):
            flush()
        if start < 0:  # no question recorded: nothing to pack it with
            group.append((row, raw, unshifted))
            flush()
            continue
        group.append((row, raw, unshifted))
    flush()
    return out


def pack_dataset(kept, settings: Stage2Settings, l1_id: int):
    """The kept rows, packed (:func:`pack_rows`), as a dataset with the packed schema."""
    import datasets

    rows = pack_rows(list(kept.with_format("numpy")), settings.pack_questions, settings, l1_id)
    schema = features(2, packed=True)
    del schema["status"]
    return datasets.Dataset.from_list(rows, features=schema)


def preview_stage2(settings: Stage2Settings, n: int) -> tuple[list[dict[str, Any]], Any]:
    """The first ``n`` kept stage-2 rows, built without writing anything (for ``--debug``)."""
    tok, l1_id, _ = open_tokenizer(settings)
    problems = InputProblems(strict=settings.strict)
    rows, seen = [], 0
    for index, example in enumerate(iter_examples(settings, tok, problems)):
        seen += 1
        row = stage2_row(example, index, tok, settings, l1_id)
        if not row["status"].startswith("dropped"):
            rows.append(row)
        if len(rows) >= n:
            break
    if not rows:
        raise DataError(f"no usable conversation among the first {seen} of the input")
    return rows, tok
