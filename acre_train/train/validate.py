"""``acre-train validate RECIPE k=v``: every recipe problem, without loading data or a model."""

from __future__ import annotations

import argparse
import sys

from .recipe import RecipeError, check_recipe, load_recipe, resolve_accumulation, world_size_from_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for 'train'")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks the run will use (default: $WORLD_SIZE or 1)")


def run(args: argparse.Namespace) -> int:
    world = args.world_size or world_size_from_env()
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = check_recipe(recipe, world)
    if problems:
        print(f"error: {RecipeError(problems, args.recipe)}", file=sys.stderr)
        return 2
    gas, global_batch, _ = resolve_accumulation(recipe, world)
    print(f"ok: {args.recipe} (run dir {recipe.run_dir}; {world} rank(s) x micro-batch "
          f"{recipe.train.micro_batch_size} x accumulation {gas} = global batch {global_batch})")
    return 0
