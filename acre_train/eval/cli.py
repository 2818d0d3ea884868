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
    from .methods import parse_methods
    from .tasks import resolve_tasks, save_jsonl

    methods = parse_methods(args.methods)  # a bad spec is a one-line error (errors.py), before any model loads
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
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
    model, tokenizer = _load_model(args, dtype, device)
    if getattr(model, "hf_device_map", None):
        print(f"placed by the device map: {describe(model.hf_device_map)}")
    examples = resolve_tasks(args.tasks, tokenizer, args.context_tokens, args.num_examples, args.seed,
                             squad_path=args.squad, questions_per_context=args.questions_per_context)
    if args.save_tasks:
        save_jsonl(examples, args.save_tasks)
    config = EvalConfig(args.max_new_tokens, args.chunk_tokens, args.recall_k, progress=not args.no_progress)
    report = evaluate(model, tokenizer, examples, methods, config=config, out_dir=args.out)
    print(Path(report.files["table"]).read_text(encoding="utf-8"))
    for kind, path in report.files.items():
        print(f"{kind}: {path}")
    return 0


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
