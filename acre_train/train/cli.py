"""``acre-train train RECIPE k=v ...`` and ``acre-train validate RECIPE k=v ...``."""

from __future__ import annotations

import argparse
import sys

from ..errors import user_errors
from .recipe import load_recipe
from .recipe_checks import validate_recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. train.learning_rate=1e-4 checkpoint.resume_from_checkpoint=latest")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run in the run dir (= checkpoint.overwrite=true)")


def run(args: argparse.Namespace) -> int:
    """Validate, then train (every rank runs this under torchrun / the deepspeed launcher)."""
    from .trainer import train

    overrides = list(args.overrides) + (["checkpoint.overwrite=true"] if getattr(args, "overwrite", False) else [])
    recipe = validate_recipe(load_recipe(args.recipe, overrides), source=args.recipe)
    result = train(recipe)  # Ctrl-C: the trainer says what was saved; the CLI's policy (errors.py) exits 130
    print(f"done: step {result.steps}, last checkpoint {result.last_checkpoint}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m acre_train.train`` (also what the launchers run); tolerates ``--local_rank=N``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m acre_train.train", description="Train ACRE L1 adapters.")
    add_arguments(parser)
    # The deepspeed launcher appends --local_rank=N; parse_overrides skips it (LOCAL_RANK is in the env).
    args, unknown = parser.parse_known_args(argv)
    args.overrides = list(args.overrides) + unknown
    return user_errors(run, verb="train")(args)  # the launchers' entry: the same policy as acre-train's
