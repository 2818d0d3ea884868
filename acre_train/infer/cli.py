"""``acre-train chat`` and ``acre-train generate``: answering questions about long contexts from an export."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

from ..measure import PeakMemory
from ..modeling.geometry import add_geometry_flags
from ..modeling.selection_words import add_selection_flags, selection_overrides
from .placement import Placement, add_placement_arguments, describe, requested_device


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", help="a folder written by 'acre-train export' (a plain base folder or base:NAME "
                                       "answers with untrained L1 projections)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="model dtype (default: the export's; use float32 on CPU)")
    add_placement_arguments(parser)
    add_geometry_flags(parser.add_argument_group("chunking (fixed per cache; defaults stored in the export)"),
                       ("first_chunk", "stride", "interval"))
    g = parser.add_argument_group("refilling and decoding (per question)")
    add_geometry_flags(g, ("working_window", "max_refill"))
    add_selection_flags(g)  # --selection, --scorer, --grow ...: modeling/selection_words.py
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar while building a cache (default: for contexts of more than 4 chunks)")


def make_engine(args: argparse.Namespace):
    """Load the export and build an ``AcreEngine`` with its settings and the command-line overrides."""
    import torch

    from ..infer.settings import inference_settings
    from .load import load_for_inference
    from .engine import AcreEngine

    device = str(requested_device(args.device))
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer, data = load_for_inference(args.export, device=device, dtype=dtype,
                                                placement=Placement.from_args(args))
    if tokenizer is None:
        raise ValueError(f"{args.export} holds no tokenizer files; re-export with --tokenizer (or save one beside the base)")
    if getattr(model, "hf_device_map", None):
        print(f"placed by the device map: {describe(model.hf_device_map)}")
    overrides = {k: getattr(args, k) for k in ("first_chunk", "stride", "interval", "working_window", "max_refill",
                                                "max_new_tokens", "temperature", "top_p", "seed")}
    cache_settings, refill = inference_settings(data, overrides | selection_overrides(args))
    return AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)


# --------------------------------------------------------------------------------------------- chat

def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--context", required=True,
                        help="text file with the long context (with --load-cache: checked against the cache)")
    parser.add_argument("--save-cache", default=None, help="write the built cache here (.safetensors)")
    parser.add_argument("--load-cache", default=None, help="reuse a cache saved with --save-cache (same export/settings)")


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin) -> int:
    if Path(args.context).stat().st_size == 0:  # a missing or empty context fails before the model loads
        raise ValueError(f"--context {args.context} is empty")
    engine = make_engine(args)
    text = engine.read_context(args.context)  # refused in pieces if longer than the export can serve
    if not text.strip():
        raise ValueError(f"--context {args.context} is empty")
    tic = time.perf_counter()
    if args.load_cache:
        cache = engine.load_cache(args.load_cache)
        from .cache import CacheMismatchError, context_digest

        if cache.context_digest != context_digest(engine.prompt.context_ids(text)):
            raise CacheMismatchError(f"{args.load_cache} holds another context than {args.context} "
                                     "(or one rendered with another prompt); rebuild it with --save-cache")
        print(f"loaded cache {args.load_cache} in {time.perf_counter() - tic:.2f}s")
    else:
        cache = engine.build(text, progress=args.progress)
        print(f"built cache in {time.perf_counter() - tic:.2f}s")
        if args.save_cache:
            from .cache import save_cache

            print(f"saved cache to {save_cache(cache, args.save_cache)}")
    print(cache.summary())
    print(f"settings: {engine.cache_settings}, W={engine.refill.working_window}, eta={engine.refill.max_refill}, "
          f"scorer {engine.refill.describe_selection()}")
    print("Ask questions about the context (empty line or Ctrl-D to quit).")
    while True:
        print("> ", end="", flush=True)
        line = stdin.readline()
        if not line or not line.strip():
            return 0
        answer = engine.answer(cache, line.strip())
        print(answer.text)
        print(f"  [{answer.describe()}]")


# ----------------------------------------------------------------------------------------- generate

def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--input", required=True,
                        help="JSONL rows with 'question' and 'context' (text) or 'context_file' (path); 'id' optional")
    parser.add_argument("--output", required=True, help="JSONL of answers with timing and memory figures")


def read_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of the input JSONL; a malformed row is an error naming its line."""
    from ..data.readers import read_jsonl_strict

    for record in read_jsonl_strict(path):
        row = record.data
        if "question" not in row or not ("context" in row or "context_file" in row):
            raise ValueError(f"{record.where}: a row needs 'question' and 'context' or 'context_file'")
        for key in ("question", "context", "context_file"):
            if key in row and (not isinstance(row[key], str) or not row[key].strip()):
                raise ValueError(f"{record.where}: '{key}' must be a non-empty string, got {row[key]!r}")
        if "context_file" in row and not Path(row["context_file"]).is_file():
            raise ValueError(f"{record.where}: context_file {row['context_file']!r} does not exist")
        yield record.line, row


def run_generate(args: argparse.Namespace) -> int:
    rows = list(read_rows(args.input))  # a bad row fails before the model loads or any output is written
    engine = make_engine(args)
    caches: dict[str, Any] = {}  # context hash -> cache; rows sharing a context reuse its cache
    count = 0
    from ..files import atomic_path

    with atomic_path(args.output) as tmp:  # an earlier output is replaced only by a complete new one
        count = _answer_rows(args, engine, rows, caches, tmp)
    print(f"wrote {count} answers to {args.output}")
    return 0


def _answer_rows(args: argparse.Namespace, engine: Any, rows: list, caches: dict[str, Any], path: Path) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for line_no, row in rows:
            context = row["context"] if "context" in row else engine.read_context(row["context_file"])
            key = hashlib.sha256(context.encode("utf-8")).hexdigest()
            reused = key in caches
            build_s = 0.0
            with PeakMemory(engine.device) as memory:  # this row's own peak: build (if any) + answer
                if not reused:
                    caches.clear()  # keep one context's cache at a time: L2 of long contexts is large
                    tic = time.perf_counter()
                    caches[key] = engine.build(context, progress=args.progress)
                    build_s = time.perf_counter() - tic
                cache = caches[key]
                answer = engine.answer(cache, row["question"])
            decode = answer.timings["decode_s"]
            record = {
                "id": row.get("id", line_no), "question": row["question"], "answer": answer.text,
                "context_tokens": cache.num_context_tokens, "num_l1": answer.num_l1, "k": answer.k,
                "refilled_spans": len(answer.selected), "cache_length": answer.cache_length,
                "scorer": engine.refill.describe_selection(),
                "cache_reused": reused, "build_s": round(build_s, 4),
                **{k: round(v, 4) for k, v in answer.timings.items()},
                "new_tokens": len(answer.token_ids),
                "tokens_per_s": round(len(answer.token_ids) / decode, 2) if decode > 0 else None,
                "l1_cache_mib": round(cache.nbytes()["l1"] / 2**20, 3),
                "l2_cache_mib": round(cache.nbytes()["l2"] / 2**20, 3),
                "peak_memory_mib": round(memory.peak_mib, 1),
            }
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            count += 1
            print(f"[{record['id']}] {answer.text!r}  ({answer.describe()})")
    return count
