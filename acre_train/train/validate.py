"""``acre-train validate RECIPE k=v``: every recipe problem, without loading data or a model."""

from __future__ import annotations

import argparse
from pathlib import Path
import sys

from .recipe import RecipeError, check_recipe, load_recipe, resolve_accumulation, world_size_from_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for 'train'")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks the run will use (default: $WORLD_SIZE or 1)")


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        print(f"error: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
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
    print(f"needs: {needs(recipe)}")
    return 0


def needs(recipe) -> str:
    """The device and downloads a recipe needs, in one line (what validate cannot check from here)."""
    import torch

    from ..base.fetch import BASE_PREFIX

    source = recipe.model.source
    device = ("CUDA (bf16/DeepSpeed recipes are sized for GPUs)" if recipe.model.dtype != "float32" or recipe.train.bf16
              else "any device (fp32)")
    if source.startswith("tiny:"):
        model = "nothing (tiny model built in-process)"
    elif source.startswith(BASE_PREFIX):
        model = f"the fetched base {source} (offline)"
    elif Path(source).expanduser().exists():
        model = f"the local folder {source}"
    else:
        model = f"hub access for {source} (or HF_HUB_OFFLINE=1 with it cached)"
    here = "CUDA available" if torch.cuda.is_available() else "no CUDA here"
    return f"{device}; model: {model}; {here}"
