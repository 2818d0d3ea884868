"""Training recipes: a typed YAML schema, dotted ``key=value`` overrides, and checks before model load.

A recipe is validated in three layers, all before any model weight is touched:

1. **Schema** (``train/recipe_schema.py``, pydantic, ``extra="forbid"``): unknown or misspelled keys are
   errors naming the key and the nearest valid one (``train.lerning_rate: unknown key; did you mean
   'learning_rate'?``).
2. **Cross-field checks** (``train/recipe_checks.py:check_recipe``): batch split vs. world size, missing
   dataset, stage-2 initial weights, DeepSpeed config values that contradict the recipe, ... Every
   problem gets one actionable message and all of them are reported together.
3. The resolved recipe (after overrides) is what gets written into the run dir and every checkpoint.

This module reads recipes: YAML without aliases or tags, overrides, the packaged recipes by name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from ..errors import explain_validation
from .recipe_schema import Recipe, RecipeError


class _PlainLoader(yaml.SafeLoader):
    """YAML without aliases: a 1 KB file of nested ``*alias`` references expands to gigabytes once
    validated (a "billion laughs"), and a recipe has no need of them."""

    def compose_node(self, parent, index):  # noqa: ANN001 (PyYAML's signature)
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a recipe; write the "
                                              "value out", self.peek_event().start_mark)
        return super().compose_node(parent, index)


def read_yaml(text: str, source: str | None = None, what: str = "recipe") -> Any:
    """Parse recipe YAML (no aliases, no Python tags); a syntax error is a :class:`RecipeError` naming
    the line and column."""
    try:
        return yaml.load(text, Loader=_PlainLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError([f"{what} is not valid YAML{where}: {problem}"], source) from None


def parse_overrides(argv: Sequence[str]) -> list[tuple[str, Any]]:
    """``["train.learning_rate=1e-4", "--local_rank=0"]`` -> ``[("train.learning_rate", 1e-4)]``.

    Values are parsed as YAML scalars (``1e-4``, ``true``, ``null``, ``[8,16]``). The deepspeed launcher
    appends ``--local_rank=N`` (or ``--local_rank N``); torchrun sets ``LOCAL_RANK``: both are skipped.
    """
    out: list[tuple[str, Any]] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg in ("--local_rank", "--local-rank"):
            skip_next = True
            continue
        if re.fullmatch(r"--local[_-]rank=\d+", arg):
            continue
        key, sep, value = arg.partition("=")
        if not sep or not key or key.startswith("-"):
            raise RecipeError([f"override {arg!r} is not of the form key=value (e.g. train.learning_rate=1e-4)"])
        out.append((key.strip(), _scalar(value)))
    return out


def _scalar(text: str) -> Any:
    """YAML-parse an override value; ``1e-4`` is a float here (YAML 1.1 would keep it a string)."""
    if text == "":
        return None
    value = read_yaml(text, what=f"override value {text!r}")
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value):
        return float(value)
    return value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (intermediate dicts are created; the schema checks names)."""
    for key, value in overrides:
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError([f"override {key}: {part!r} is a value ({child!r}), not a section"])
            node = child
        node[parts[-1]] = value
    return raw


PACKAGED_RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def packaged_recipe(name: str | os.PathLike) -> Path | None:
    """A recipe shipped with acre-train, by its path under ``recipes/`` (``qwen2.5-0.5b/stage1.yaml``,
    ``recipes/tiny_stage1.yaml``, or without ``.yaml``); None when there is no such recipe."""
    rel = Path(name).as_posix().removeprefix("recipes/")
    for candidate in (rel, rel + ".yaml"):
        path = PACKAGED_RECIPES / candidate
        if path.is_file():
            return path
    return None


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] | Sequence[tuple[str, Any]] = ()) -> Recipe:
    """Read a YAML recipe (a file, or a packaged recipe by name), apply overrides, validate the schema
    (not the cross-field checks)."""
    path = Path(path)
    if not path.is_file():
        packaged = packaged_recipe(path)
        if packaged is None:
            raise RecipeError([f"recipe file {path} does not exist (packaged recipes: acre-train recipes ls)"])
        path = packaged
    raw = read_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    if not isinstance(raw, dict):
        raise RecipeError(["the recipe must be a mapping of sections"], str(path))
    pairs = parse_overrides(overrides) if overrides and isinstance(overrides[0], str) else list(overrides)
    recipe = recipe_from_dict(apply_overrides(raw, pairs), source=str(path))
    # A relative DeepSpeed config path is tried against the cwd first, then the recipe's folder.
    _resolve_relative(recipe, path.parent.resolve())
    return recipe


def recipe_from_dict(raw: dict[str, Any], source: str | None = None) -> Recipe:
    """Validate a dict against the schema; errors name the key and the nearest valid one."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(explain_validation(exc, Recipe), source) from None


def _resolve_relative(recipe: Recipe, recipe_dir: Path) -> None:
    """A relative DeepSpeed config: the cwd, the recipe's folder, or the packaged ``recipes/...``."""
    ds = recipe.train.deepspeed
    if not ds or Path(ds).is_absolute() or Path(ds).exists():
        return
    for candidate in (recipe_dir / ds, PACKAGED_RECIPES.parent / ds, PACKAGED_RECIPES / Path(ds).name):
        if candidate.exists():
            recipe.train.deepspeed = str(candidate)
            return
