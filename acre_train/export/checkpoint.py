"""From a training run or checkpoint to an ACRE model: consolidate the weights, rebuild the base.

A checkpoint (``acre_train/train/checkpoint.py``) holds the trainable L1 weights only, plus a
reference to the frozen base. With DeepSpeed, the fp32 master weights are consolidated with
DeepSpeed's own API (``get_fp32_state_dict_from_zero_checkpoint(..., exclude_frozen_parameters=True)``),
which covers ZeRO-1 and ZeRO-2 shards; without it, ``trainable.safetensors`` is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..modeling.adapter import ACRE_PREFIX, acre_parameters, attach_from_section, load_acre_state_dict


@dataclass
class LoadedCheckpoint:
    """An ACRE model rebuilt from a checkpoint, and what the export needs to describe it."""

    model: nn.Module
    checkpoint: Path
    meta: dict[str, Any]
    recipe: dict[str, Any]
    base_pointer: str  # where an adapter-only export finds the base
    weights_from: str  # "deepspeed-zero" or "trainable.safetensors"
    tokenizer_spec: str | None = None
    inference: dict[str, Any] = field(default_factory=dict)
    # The learned scorer (train.refill_loss.params: scorer): its weights and the scorer spec it ranks with.
    scorer_state: dict[str, torch.Tensor] = field(default_factory=dict)
    scorer_spec: str | None = None


def consolidate_zero(ds_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """fp32 trainable weights from a DeepSpeed ZeRO-1/2 checkpoint folder (frozen params excluded).

    Loaded with ``weights_only=True`` (``files.deepspeed_weights_only``): a crafted ``*_states.pt``
    is refused, not run. Exporting someone else's checkpoint still means trusting its weights.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ..files import deepspeed_weights_only

    with deepspeed_weights_only():
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=tag, exclude_frozen_parameters=True))


def model_from_adapter(base: str, weights: str | Path, *, l1: str = "full", lora: dict | None = None,
                       dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """An ACRE model from a base and a file of L1 weights (an export's ``acre_adapter.safetensors``, a
    shipped adapter), with the L1 form (full copies or LoRA with ``lora`` settings) they were trained in."""
    from transformers import AutoModelForCausalLM

    from ..base.fetch import resolve_source
    from ..files import read_safetensors

    model = AutoModelForCausalLM.from_pretrained(resolve_source(base), trust_remote_code=False,
                                                 **({"dtype": dtype} if dtype else {}))
    attach_from_section(model, {"l1": l1, "lora": lora})
    load_acre_state_dict(model, read_safetensors(weights))
    return model.eval()


def match_acre_names(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Map consolidated names onto the model's L1 parameter names.

    The engine wraps the model (e.g. a loss module holding it as ``model``), so names may carry
    wrapper prefixes; the unique suffix match is taken. Non-L1 entries are an error: checkpoints
    must hold L1 weights only.
    """
    own = [name for name, _ in acre_parameters(model)]
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if not any(part.startswith(ACRE_PREFIX) for part in key.split(".")):
            raise ValueError(f"the checkpoint holds a non-L1 weight {key!r}: not an ACRE (L1-only) checkpoint")
        hits = [name for name in own if key == name or key.endswith("." + name)]
        if len(hits) != 1:
            raise ValueError(f"checkpoint weight {key!r} matches {len(hits)} L1 parameters of the model")
        out[hits[0]] = tensor
    return out


def load_checkpoint_model(path: str | Path, *, dtype: torch.dtype | None = None) -> LoadedCheckpoint:
    """Rebuild the trained ACRE model from a run directory (newest checkpoint) or a checkpoint."""
    from transformers import AutoModelForCausalLM

    from ..train.checkpoint import DS_DIR, DS_TAG, find_weights_checkpoint, load_trainable, read_meta

    checkpoint = find_weights_checkpoint(Path(path))
    meta = read_meta(checkpoint)
    if meta.get("mode", "acre") != "acre":
        raise ValueError(f"{checkpoint} is a {meta.get('mode')!r} run; only ACRE runs can be exported as ACRE models")
    recipe = _run_recipe(checkpoint)
    pointer = base_pointer(checkpoint, meta)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    base = AutoModelForCausalLM.from_pretrained(pointer, trust_remote_code=False, **kwargs)

    ds_dir = checkpoint / DS_DIR
    if ds_dir.is_dir():
        state, origin = consolidate_zero(ds_dir, tag=DS_TAG), "deepspeed-zero"
    else:
        state, origin = load_trainable(checkpoint), "trainable.safetensors"
    from ..modeling.learned_scorer import split_state

    state, scorer_state = split_state(state)
    model_section = recipe.get("model") or {}
    model = attach_from_section(base, {"train_o_proj": any(".acre_o_proj." in key for key in state),
                                       "l1": model_section.get("l1", "full"), "lora": model_section.get("lora")})
    weights = match_acre_names(state, model)
    own = next(model.parameters())
    load_acre_state_dict(model, {k: v.to(own.device, own.dtype) for k, v in weights.items()})
    prepare = ((recipe.get("data") or {}).get("prepare") or {})
    return LoadedCheckpoint(
        model=model.eval(), checkpoint=checkpoint, meta=meta, recipe=recipe, base_pointer=pointer,
        weights_from=origin, tokenizer_spec=prepare.get("tokenizer") or _data_tokenizer(recipe),
        inference=answers_with(trained_geometry(meta, recipe), recipe),
        scorer_state=scorer_state, scorer_spec=_learned_spec(recipe) if scorer_state else None,
    )


def _run_recipe(checkpoint: Path) -> dict[str, Any]:
    from ..train.recipe import read_yaml

    recipe_file = checkpoint / "recipe.yaml"
    return read_yaml(recipe_file.read_text(encoding="utf-8"), str(recipe_file)) if recipe_file.is_file() else {}


def base_pointer(checkpoint: Path, meta: dict[str, Any]) -> str:
    """Where the base a checkpoint was trained on lies (a tiny run's saved base folder, or its source)."""
    source = str((meta.get("base_model") or {}).get("source", ""))
    if source.startswith("tiny:"):
        base_dir = meta.get("base_model_dir") or str(checkpoint.parent / "base_model")
        if not Path(base_dir).is_dir():
            raise FileNotFoundError(f"{checkpoint}: the tiny base model folder {base_dir} is missing")
        return str(Path(base_dir).resolve())
    if source:
        from ..base.fetch import resolve_source

        return resolve_source(source)
    raise ValueError(f"{checkpoint}: acre_checkpoint.json names no base model")


def load_vanilla_model(path: str | Path, *, dtype: torch.dtype | None = None) -> tuple[nn.Module, Path, dict, str]:
    """A ``mode: vanilla`` run's model as a plain causal LM (a LoRA merged into the base's q/k/v):
    ``(model, checkpoint, recipe, base pointer)``."""
    from transformers import AutoModelForCausalLM

    from ..train.checkpoint import DS_DIR, DS_TAG, find_weights_checkpoint, load_trainable, read_meta

    checkpoint = find_weights_checkpoint(Path(path))
    meta = read_meta(checkpoint)
    if meta.get("mode") != "vanilla":
        raise ValueError(f"{checkpoint} is not a mode: vanilla run")
    recipe = _run_recipe(checkpoint)
    pointer = base_pointer(checkpoint, meta)
    model = AutoModelForCausalLM.from_pretrained(pointer, trust_remote_code=False,
                                                 **({"dtype": dtype} if dtype is not None else {}))
    ds_dir = checkpoint / DS_DIR
    state = consolidate_zero(ds_dir, tag=DS_TAG) if ds_dir.is_dir() else load_trainable(checkpoint)
    section = recipe.get("model") or {}
    if section.get("vanilla") == "lora":
        from ..train.model import vanilla_lora
        from ..train.recipe_schema import LoraSection

        model = vanilla_lora(model, LoraSection(**(section.get("lora") or {})).model_dump())
    own = dict(model.named_parameters())
    names = {k.removeprefix("model.") if k not in own and k.removeprefix("model.") in own else k: v
             for k, v in state.items()}  # a loss module's "model." prefix, where the checkpoint kept it
    missing = [k for k in names if k not in own]
    if missing:
        raise ValueError(f"{checkpoint} holds weights this model does not have: {missing[:3]}")
    with torch.no_grad():
        for name, tensor in names.items():
            own[name].copy_(tensor)
    if section.get("vanilla") == "lora":
        model = model.merge_and_unload()
    return model.eval(), checkpoint, recipe, pointer


def _learned_spec(recipe: dict[str, Any]) -> str:
    """The scorer a learned map was trained for (``train.refill_loss.scorer``), marked learned."""
    from ..modeling.scorer_spec import ScorerSettings

    spec = ((recipe.get("train") or {}).get("refill_loss") or {}).get("scorer") or "l2:layers=-1,heads=max"
    return ScorerSettings.parse(spec + ",learned=1" if "learned" not in spec else spec).describe()


def answers_with(plan: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """What the export answers with: for a run trained in the refilled layout (``train.refill_sim``),
    what its training simulated (``RefillSimSection.answers_with``, the trainer's own function); else
    the inference defaults of its chunking. ``calibrate`` or an export flag may still override it."""
    from ..train.recipe_schema import RefillSimSection

    sim = (recipe.get("train") or {}).get("refill_sim") or {}
    if sim.get("enabled"):
        return RefillSimSection.model_validate(sim).answers_with(plan)
    return inference_defaults(plan)


def trained_geometry(meta: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """The chunking the model trained with: the checkpoint's record of its data's plan, else the prepared
    data's manifest at the recipe's ``data.path``, else the recipe's ``data.prepare`` (older runs)."""
    if meta.get("geometry"):
        return dict(meta["geometry"])
    data = recipe.get("data") or {}
    manifest = Path(str(data.get("path") or "")) / "manifest.json"
    if data.get("path") and manifest.is_file():
        plan = json.loads(manifest.read_text(encoding="utf-8")).get("plan") or {}
        if plan:
            return plan
    return dict(data.get("prepare") or {})


def _data_tokenizer(recipe: dict[str, Any]) -> str | None:
    data = recipe.get("data") or {}
    manifest = Path(str(data.get("path") or "")) / "manifest.json"
    if data.get("path") and manifest.is_file():
        return (json.loads(manifest.read_text(encoding="utf-8")).get("tokenizer") or {}).get("name")
    return None


def inference_defaults(prepare: dict[str, Any]) -> dict[str, Any]:
    """The inference geometry of the chunking the model was trained with (``data.prepare``): its W0 and
    S, interval 16 when trained with it (DESIGN §1), the paper's W and eta."""
    from ..modeling.geometry import WindowGeometry

    keys = ("first_chunk", "stride", "intervals")
    return WindowGeometry.from_mapping({k: prepare[k] for k in keys if k in prepare}).inference_dict()


def load_tokenizer(spec: str | None, fallback: str | None) -> Any:
    """The run's tokenizer: ``tiny`` (built-in), a path or hub id; ``None`` when none can be found."""
    if spec == "tiny":
        from ..data.tiny_tokenizer import tiny_tokenizer

        return tiny_tokenizer()
    from ..data.tokenizer import auto_tokenizer

    for candidate in (spec, fallback):
        if not candidate:
            continue
        try:
            return auto_tokenizer(candidate)
        except (OSError, ValueError):
            continue
    return None
