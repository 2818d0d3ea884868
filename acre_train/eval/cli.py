"""``acre-train eval``: methods side by side on long-context QA tasks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..infer.placement import add_placement_arguments, describe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local HF model folder (or hub id if cached)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    parser.add_argument("--tasks", required=True,
                        help="a task JSONL file, or comma-separated built-ins: squad, niah_single, niah_multikey, "
                             "niah_multivalue, vt, ruler")
    parser.add_argument("--methods", default="full,cachefocus,infoflow",
                        help="comma-separated method specs name[:key=value...], e.g. "
                             "'full,truncated:budget=2048,cachefocus:allocation=sort,infoflow:ratio=0.15'")
    parser.add_argument("--out", default="eval_out", help="output folder (default: eval_out)")
    parser.add_argument("--context-tokens", type=int, default=4096, help="built-in tasks: context length in tokens")
    parser.add_argument("--num-examples", type=int, default=10, help="built-in tasks: examples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--squad", default=None,
                        help="SQuAD JSON file for the squad task (default: the packaged 48-paragraph sample)")
    parser.add_argument("--questions-per-context", type=int, default=1,
                        help="built-in squad / niah_multikey: questions sharing one context, which every method "
                             "encodes once (default: 1)")
    g = parser.add_argument_group("the long suite (long_needles, long_chain, long_qa): dev to choose, test once")
    g.add_argument("--split", choices=("dev", "test"), default=None,
                   help="long tasks: which split (default: dev). A test run is recorded in the ledger and refused "
                        "a second time")
    g.add_argument("--rerun", action="store_true", help="run a test cell again; the report names the earlier runs")
    g.add_argument("--ledger", default=None, help="the test-run ledger (default: $ACRE_TRAIN_CACHE/test-ledger.jsonl)")
    g.add_argument("--haystack", default=None,
                   help="the Jargon File text (default: where 'apt-get install jargon-text' puts it, or "
                        "$ACRE_TRAIN_HAYSTACK)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="chunk size for 'context' examples")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--recall-k", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    add_placement_arguments(parser)
    parser.add_argument("--save-tasks", default=None, help="also write the examples used to this JSONL file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import require

    for module in ("rouge_score.rouge_scorer", "matplotlib"):  # before any model loads
        require(module, "eval")

    from .harness import EvalConfig, evaluate
    from ..infer.placement import requested_device
    from .methods import parse_methods
    from .examples import save_jsonl
    from .tasks import resolve_tasks

    methods = parse_methods(args.methods)  # a bad spec is a one-line error (errors.py), before any model loads
    device = requested_device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    from ..base.fetch import resolve_source

    args.model = resolve_source(args.model)
    if not Path(args.model).exists():
        print(f"acre-train eval: note: {args.model!r} is not a local folder; trying it as a hub id", file=sys.stderr)
    acre_rows = [m.label() for m in methods if m.needs_acre]
    if acre_rows:
        from ..modeling.export_format import NotAnAcreExport, check_export_dir

        try:
            check_export_dir(args.model)
        except NotAnAcreExport as exc:
            raise ValueError(f"rows {acre_rows} need an ACRE model: {exc}") from None
    ledger, key, before, settings = _check_test_split(args, methods)
    model, tokenizer = _load_model(args, dtype, device)
    if getattr(model, "hf_device_map", None):
        print(f"placed by the device map: {describe(model.hf_device_map)}")
    examples = resolve_tasks(args.tasks, tokenizer, args.context_tokens, args.num_examples, args.seed,
                             squad_path=args.squad, questions_per_context=args.questions_per_context,
                             split=args.split, haystack=args.haystack)
    if args.save_tasks:
        save_jsonl(examples, args.save_tasks)
    config = EvalConfig(args.max_new_tokens, args.chunk_tokens, args.recall_k, progress=not args.no_progress)
    report = evaluate(model, tokenizer, examples, methods, config=config, out_dir=args.out)
    print(Path(report.files["table"]).read_text(encoding="utf-8"))
    for kind, path in report.files.items():
        print(f"{kind}: {path}")
    if ledger is not None:
        _record_test_run(args, ledger, key, before, settings, report)
    return 0


def _test_settings(args, methods) -> dict:
    """What decides a test figure (eval/ledger.py): the model, rows, tasks, lengths, counts and decoding."""
    from .ledger import model_hash

    return {"model": model_hash(args.model), "methods": [m.label() for m in methods], "tasks": args.tasks,
            "split": args.split, "context_tokens": args.context_tokens, "num_examples": args.num_examples,
            "seed": args.seed, "chunk_tokens": args.chunk_tokens, "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype}


def _check_test_split(args, methods):
    """``(ledger, fingerprint, earlier runs, settings)`` for a test run (refused if it ran before, unless --rerun)."""
    if args.split != "test":
        return None, None, [], None
    from .ledger import Ledger, fingerprint

    ledger = Ledger(args.ledger)
    settings = _test_settings(args, methods)
    key = fingerprint(settings)
    return ledger, key, ledger.check(key, rerun=args.rerun), settings


def _record_test_run(args, ledger, key, before, settings, report) -> None:
    import json

    from ..files import write_text_atomic

    scores = {m: round(float(v["score"]), 2) for m, v in report.summary.get("overall", {}).items()}
    ledger.record(key, {"out": str(args.out), "scores": scores, "settings": settings, "rerun": bool(before)})
    write_text_atomic(Path(args.out) / "test_runs.json",
                      json.dumps({"fingerprint": key, "this_run": scores, "earlier_runs": before}, indent=2) + "\n")
    print(f"test run recorded in {ledger.path} (fingerprint {key})")
    for run in before:
        print(f"  rerun: an earlier run of this cell ({run.get('when')}, {run.get('out')}) scored {run.get('scores')}")


def _load_model(args, dtype, device):
    """An ACRE export (for the acre rows; plain calls run its base) or any supported causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..data.tokenizer import auto_tokenizer
    from ..infer.load import load_export
    from ..infer.placement import Placement
    from ..modeling.export_format import NotAnAcreExport, check_export_dir

    placement = Placement.from_args(args)
    try:
        check_export_dir(args.model)
    except NotAnAcreExport:
        tokenizer = auto_tokenizer(args.tokenizer or args.model)
        placed = placement.kwargs(lambda: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model, trust_remote_code=False)),
                                  dtype) if placement else {}
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn_implementation,
                                                     trust_remote_code=False,
                                                     **placed)
        return (model if placed else model.to(device)), tokenizer
    model, tokenizer, _ = load_export(args.model, device=device, dtype=dtype, placement=placement)
    if args.tokenizer or tokenizer is None:
        tokenizer = auto_tokenizer(args.tokenizer or args.model)
    return model, tokenizer
