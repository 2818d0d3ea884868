"""Training: recipes, the trainer loop (single process, DDP, DeepSpeed ZeRO-1/2), checkpoints, logging.

From Python::

    from acre_train.train import load_recipe, train
    result = train(load_recipe("recipes/tiny_stage1.yaml", ["train.max_steps=4"]))
    result.last_checkpoint  # checkpoints/<run_name>/checkpoint-4

From a shell: ``acre-train train RECIPE k=v``, ``python -m acre_train.train RECIPE k=v``,
``torchrun --nproc_per_node N -m acre_train.train RECIPE k=v`` or
``deepspeed --num_gpus N --module acre_train.train RECIPE k=v``.
"""

from .checkpoint import CheckpointMismatch, latest_checkpoint, list_checkpoints, read_meta
from .recipe import load_recipe, parse_overrides
from .recipe_checks import check_recipe, validate_recipe
from .recipe_schema import Recipe, RecipeError
from .trainer import TrainResult, train

__all__ = [
    "CheckpointMismatch", "Recipe", "RecipeError", "TrainResult", "check_recipe", "latest_checkpoint",
    "list_checkpoints", "load_recipe", "parse_overrides", "read_meta", "train", "validate_recipe",
]
