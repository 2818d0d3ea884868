"""``acre-train preprocess stage1|stage2``: prepare training data (or ``--debug N`` to inspect it)."""

from __future__ import annotations

import argparse
from typing import Any

from .errors import DataError
from ..modeling.geometry import add_geometry_flags
from .settings import Stage1Settings, Stage2Settings, WindowGeometry


def _common(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("input (exactly one)")
    src.add_argument("--input", "-i", nargs="+", default=[], metavar="PATH",
                     help="files, directories or globs (.jsonl, .jsonl.gz, .jsonl.zst, .parquet, .json)")
    src.add_argument("--dataset", metavar="NAME", help="a `datasets` name or local dataset directory instead of files")
    src.add_argument("--dataset-config", metavar="NAME")
    src.add_argument("--dataset-split", default="train", metavar="SPLIT")
    src.add_argument("--builtin", action="store_true", help="the built-in sample (no download needed)")
    p.add_argument("--output", "-o", metavar="DIR", help="output directory (Arrow data + manifest.json)")
    p.add_argument("--tokenizer", default="tiny",
                   help="tokenizer path or hub name, or 'tiny' (built-in test tokenizer) (default: %(default)s)")
    plan = p.add_argument_group("interleave plan (recorded in the manifest)")
    paper = WindowGeometry()
    add_geometry_flags(plan, ("first_chunk", "stride", "intervals"),
                       {"first_chunk": paper.first_chunk, "stride": paper.stride, "intervals": paper.intervals})
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--l1-token-id", type=int, default=None, help="id at L1 slots (default: the tokenizer's EOS)")
    run = p.add_argument_group("run")
    run.add_argument("--num-proc", type=int, default=1,
                     help="worker processes (default: %(default)s). A fast tokenizer already uses every core from one "
                          "process; stage 1 then uses workers only to interleave")
    run.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    run.add_argument("--overwrite", action="store_true", help="replace an existing output made differently")
    run.add_argument("--cache-dir", metavar="DIR", help="tokenization cache (default: ~/.cache/acre-train)")
    dbg = p.add_argument_group("inspection")
    dbg.add_argument("--debug", type=int, default=0, metavar="N",
                     help="print the first N samples with label mask and L1 slots; writes nothing")
    dbg.add_argument("--debug-tokens", type=int, default=400, metavar="T",
                     help="tokens shown per sample (head and tail; 0: all) (default: %(default)s)")
    dbg.add_argument("--color", choices=("auto", "always", "never"), default="auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``stage1`` and ``stage2`` subcommands."""
    sub = parser.add_subparsers(dest="stage", metavar="<stage>", required=True)
    s1 = sub.add_parser("stage1", help="long plain-text spans with L1 tokens (bi-layer cache construction)",
                        description="Sample 4K-64K-token spans from plain text (RedPajama layout), pack short "
                                    "documents, interleave L1 tokens; stop at a token budget.")
    _common(s1)
    g = s1.add_argument_group("spans")
    g.add_argument("--text-field", default="text")
    g.add_argument("--meta-field", default="meta")
    g.add_argument("--min-length", type=int, default=4096, help="min raw tokens per span (default: %(default)s)")
    g.add_argument("--max-length", type=int, default=65536, help="max raw tokens per span (default: %(default)s)")
    g.add_argument("--budget", type=int, default=2_000_000_000,
                   help="stop after this many raw tokens; 0: no limit (default: %(default)s)")
    g.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="join short documents, EOS-separated, into spans (default: on)")

    s2 = sub.add_parser("stage2", help="long-context QA / chat SFT samples with L1 tokens (query-guided refilling)",
                        description="Render conversations with the chat template, label only assistant answers "
                                    "(end-of-turn included), truncate or drop over-long samples, interleave L1 tokens.")
    _common(s2)
    g = s2.add_argument_group("samples")
    g.add_argument("--format", choices=("auto", "messages", "sharegpt", "alpaca", "squad"), default="auto",
                   help="input format; 'squad' builds long-context QA from SQuAD-style data (default: %(default)s; "
                        "squad with --builtin)")
    g.add_argument("--max-length", type=int, default=32768, help="max raw tokens per sample (default: %(default)s)")
    g.add_argument("--min-length", type=int, default=1)
    g.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                   help="over-long samples: cut from the middle of the context, or drop (default: %(default)s)")
    g.add_argument("--system-prompt", default=None)
    g.add_argument("--context-tokens", type=int, default=4096,
                   help="squad: target context length in tokens (default: %(default)s)")
    g.add_argument("--questions-per-paragraph", type=int, default=1)
    g.add_argument("--max-samples", type=int, default=None, help="stop after this many conversations")


def settings_from_args(args: argparse.Namespace) -> Stage1Settings | Stage2Settings:
    """The settings object an ``argparse`` namespace describes."""
    common: dict[str, Any] = dict(
        inputs=tuple(args.input), dataset_name=args.dataset, dataset_config=args.dataset_config,
        dataset_split=args.dataset_split, builtin=args.builtin, output=args.output, tokenizer=args.tokenizer,
        first_chunk=args.first_chunk, stride=args.stride, intervals=args.intervals, seed=args.seed,
        l1_token_id=args.l1_token_id, num_proc=args.num_proc, strict=args.strict, overwrite=args.overwrite,
        cache_dir=args.cache_dir, min_length=args.min_length, max_length=args.max_length,
    )
    if args.stage == "stage1":
        return Stage1Settings(text_field=args.text_field, meta_field=args.meta_field,
                              token_budget=args.budget or None, pack=args.pack, **common)
    return Stage2Settings(format=args.format, overlong=args.overlong, system_prompt=args.system_prompt,
                          context_tokens=args.context_tokens, questions_per_paragraph=args.questions_per_paragraph,
                          max_samples=args.max_samples, **common)


def run(args: argparse.Namespace) -> int:
    """Run one preparation stage (errors in the input are one-line errors: errors.py)."""
    from . import prepare_stage1, prepare_stage2, preview_stage1, preview_stage2
    from .inspector import print_samples

    settings = settings_from_args(args)
    if args.debug > 0:
        preview = preview_stage1 if args.stage == "stage1" else preview_stage2
        rows, tok = preview(settings, args.debug)
        print_samples(rows, tok, color=args.color, max_tokens=args.debug_tokens)
        print(f"(--debug: {len(rows)} samples shown, nothing written)")
        return 0
    if not args.output:
        raise DataError("--output is required (or use --debug N to only inspect samples)")
    (prepare_stage1 if args.stage == "stage1" else prepare_stage2)(settings)
    return 0

