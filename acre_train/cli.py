"""The one command-line entry point: ``acre-train <verb> ...``.

Every verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their verb runs, so ``acre-train --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .files import DiskFullError  # an OSError a user fixes by freeing space

# verb -> (module, one-line help). Order is the order a newcomer meets them.
VERBS: dict[str, tuple[str, str]] = {
    "env": ("acre_train.env_info", "print torch / transformers / deepspeed / CUDA facts for bug reports"),
    "base": ("acre_train.base.cli", "bring in a pretrained base: fetch a known one, convert a GGUF, list what is here"),
    "quickstart": ("acre_train.quickstart", "the whole path on built-in data in a minute: data, stage 1, stage 2, export, a refilled answer"),
    "preprocess": ("acre_train.data.cli", "prepare stage-1 text spans or stage-2 QA/chat SFT data with L1 tokens"),
    "recipes": ("acre_train.recipes_cli", "list the recipes that ship with acre-train, or copy one to edit"),
    "train": ("acre_train.train.cli", "train a recipe (stage 1, stage 2 or vanilla) on 1 process, torchrun or deepspeed"),
    "validate": ("acre_train.train.validate", "check a training recipe (keys, batch split, data, DeepSpeed) without training"),
    "eval": ("acre_train.eval.cli", "compare full, truncated, CacheFocus, InfoFlow, ... on long-context QA tasks"),
    "export": ("acre_train.export.cli", "turn a training run or checkpoint (ZeRO-1/2 too) into an inference-ready HF folder"),
    "chat": ("acre_train.infer.chat_cli", "answer questions typed at a prompt about a long context file (export + refilling)"),
    "generate": ("acre_train.infer.generate_cli", "answer a JSONL of (context, question) rows; writes answers with timing and memory"),
    "reproduce": ("acre_train.mini.cli", "re-run a study end to end: 'real' trains and evaluates ACRE on the real 0.5B base (docs/real-base.md)"),
}


def user_errors(run):
    """Report the errors a user can fix (bad file, wrong setting, missing extra) in one line, exit 2.

    Every verb's ``run`` goes through this: tracebacks are for bugs, not for typos.
    """
    import functools

    @functools.wraps(run)
    def wrapper(args, *rest, **kw) -> int:
        try:
            return run(args, *rest, **kw)
        except (ValueError, FileNotFoundError, FileExistsError, MissingExtra, DiskFullError) as exc:
            print(f"acre-train {getattr(args, 'verb', '')}: error: {exc}", file=sys.stderr)
            return 2

    return wrapper


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that fixes it."""


def require(module: str, extra: str) -> object:
    """Import ``module`` or raise :class:`MissingExtra` naming ``pip install 'acre-train[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        raise MissingExtra(f"this needs the '{package}' package: pip install 'acre-train[{extra}]'") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="acre-train",
        description="Train, export, run and evaluate ACRE bi-layer KV adapters for long-context LLMs.",
        epilog="New here? Run 'acre-train quickstart', then 'acre-train <verb> --help' for one verb's options.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="<verb>")
    for verb, (module_name, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
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
    return int(importlib.import_module(args._module).run(args) or 0)


def build_parser_for(argv: list[str]) -> argparse.ArgumentParser:
    saved = sys.argv
    sys.argv = ["acre-train", *argv]
    try:
        return build_parser()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())
