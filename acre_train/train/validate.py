"""``acre-train validate RECIPE k=v``: every recipe problem, without loading data or a model."""

from __future__ import annotations

import argparse
from pathlib import Path

from .recipe import load_recipe
from .recipe_checks import check_recipe, resolve_accumulation, world_size_from_env
from .recipe_schema import RecipeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for 'train'")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks the run will use (default: $WORLD_SIZE or 1)")


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    world = args.world_size or world_size_from_env()
    recipe = load_recipe(args.recipe, args.overrides)
    problems = check_recipe(recipe, world)
    layers = model_layers(recipe)
    if layers:
        problems += layer_problems(recipe, layers)
    if not problems:  # the data's tokenizer against the model (reads the base's config and tokenizer)
        from .vocabulary import check_vocabulary

        problems = check_vocabulary(recipe)
    if problems:
        raise RecipeError(problems, args.recipe)
    try:
        params = parameter_line(recipe)
    except ValueError as exc:  # the L1 settings do not fit this model (e.g. a LoRA rank above its width)
        raise RecipeError([str(exc)], args.recipe) from None
    gas, global_batch, _ = resolve_accumulation(recipe, world)
    print(f"ok: {args.recipe} (run dir {recipe.run_dir}; {world} rank(s) x micro-batch "
          f"{recipe.train.micro_batch_size} x accumulation {gas} = global batch {global_batch})")
    print(f"needs: {needs(recipe)}")
    print(f"parameters: {params}")
    return 0


def parameter_line(recipe) -> str:
    """Trainable vs total parameters, counted on empty weights (accelerate's ``init_empty_weights``):
    the config is read, no weight is. Raises ``ValueError`` when the recipe's L1 settings do not fit."""
    from ..modeling import attach_acre, count_parameters

    source = recipe.model.source
    from accelerate import init_empty_weights

    try:
        with init_empty_weights():  # parameters without storage: a 7B model costs nothing here
            if source.startswith("tiny:"):
                from ..tiny import tiny_model

                model = tiny_model(source.partition(":")[2], **recipe.model.tiny_config)
            else:
                from transformers import AutoConfig, AutoModelForCausalLM

                from ..base.fetch import resolve_source

                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_source(source), trust_remote_code=False))
    except (OSError, ValueError) as exc:  # a hub id without network or cache
        return f"not counted ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    with init_empty_weights():
        if recipe.mode == "acre":  # its ValueError (settings that do not fit this model) is the caller's
            m = recipe.model
            attach_acre(model, train_o_proj=m.train_o_proj, lora=m.lora.model_dump() if m.l1 == "lora" else None)
        else:
            model.requires_grad_(True)
    counts = count_parameters(model)
    groups = "  ".join(f"{k}={v:,}" for k, v in counts.items() if k not in ("trainable", "frozen", "total"))
    return f"trainable {counts['trainable']:,} of {counts['total']:,}" + (f" ({groups})" if groups else "")


def model_layers(recipe) -> int | None:
    """The model's layer count from its config alone (None where the config cannot be read here)."""
    source = recipe.model.source
    try:
        if source.startswith("tiny:"):
            from accelerate import init_empty_weights

            from ..tiny import tiny_model

            with init_empty_weights():
                return tiny_model(source.partition(":")[2], **recipe.model.tiny_config).config.num_hidden_layers
        from transformers import AutoConfig

        from ..base.fetch import resolve_source

        return AutoConfig.from_pretrained(resolve_source(source), trust_remote_code=False).num_hidden_layers
    except (OSError, ValueError):
        return None


def layer_problems(recipe, num_layers: int) -> list[str]:
    """The recipe's layer indices (refill loss, its scorer, the refill simulation's scorer) that a
    ``num_layers``-layer model lacks; training would stop on them only after the model loaded."""
    from ..modeling.scorer_spec import ScorerSettings

    t = recipe.train
    named = []
    if t.refill_loss.weight or t.refill_loss.params == "scorer":
        named += [("train.refill_loss.layers", tuple(t.refill_loss.layers))]
        if t.refill_loss.params == "scorer":
            named += [("train.refill_loss.scorer", ScorerSettings.parse(t.refill_loss.scorer).layers)]
    if t.refill_sim.enabled:
        named += [("train.refill_sim.scorer", ScorerSettings.parse(t.refill_sim.scorer).layers)]
    return [f"{key}: layers {list(layers)} out of range for this {num_layers}-layer model "
            f"(0..{num_layers - 1}, or -1 for the last)" for key, layers in named
            if any(not -num_layers <= x < num_layers for x in layers)]


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
