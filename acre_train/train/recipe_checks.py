"""Checks of a recipe across its fields and against the machine, data and run folder, before any model
weight loads: every problem one actionable line, all reported together (:func:`check_recipe`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..modeling import SUPPORTED_MODEL_TYPES
from .recipe_schema import LoraSection, Recipe, RecipeError


def world_size_from_env() -> int:
    """World size the launcher set (torchrun and deepspeed both export WORLD_SIZE), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_accumulation(recipe: Recipe, world_size: int) -> tuple[int, int, list[str]]:
    """``(gradient_accumulation_steps, global_batch_size, problems)`` for ``world_size`` ranks."""
    t = recipe.train
    per_step = t.micro_batch_size * world_size
    if t.gradient_accumulation_steps == "auto":
        if t.global_batch_size is None:
            return 1, per_step, []
        if t.global_batch_size % per_step:
            return 1, per_step, [
                f"train.global_batch_size={t.global_batch_size} cannot be split into micro_batch_size="
                f"{t.micro_batch_size} x {world_size} rank(s) x an integer accumulation; choose a "
                f"global_batch_size divisible by {per_step} or change micro_batch_size"
            ]
        return t.global_batch_size // per_step, t.global_batch_size, []
    gas = int(t.gradient_accumulation_steps)
    if gas < 1:
        return 1, per_step, [f"train.gradient_accumulation_steps must be >= 1 or 'auto', got {gas}"]
    if t.global_batch_size is not None and t.global_batch_size != per_step * gas:
        return gas, per_step * gas, [
            f"train.global_batch_size={t.global_batch_size} but micro_batch_size={t.micro_batch_size} x "
            f"gradient_accumulation_steps={gas} x {world_size} rank(s) = {per_step * gas}; set "
            "gradient_accumulation_steps: auto to derive it"
        ]
    return gas, per_step * gas, []


def check_recipe(recipe: Recipe, world_size: int | None = None) -> list[str]:
    """Every cross-field problem of ``recipe`` (empty list: it can run). Loads no model."""
    world_size = world_size_from_env() if world_size is None else world_size
    problems: list[str] = []
    problems += resolve_accumulation(recipe, world_size)[2]
    problems += _check_model(recipe)
    problems += _check_data(recipe)
    problems += _check_deepspeed(recipe, world_size)
    problems += _check_resume(recipe)
    if recipe.train.eval_every and not recipe.data.eval_split:
        problems.append("train.eval_every needs held-out samples: set data.eval_split (e.g. 0.05)")
    if recipe.train.warmup_steps is not None and recipe.train.warmup_ratio:
        problems.append("train.warmup_steps and train.warmup_ratio are both set; keep one")
    if recipe.mode == "vanilla" and recipe.model.train_o_proj:
        problems.append("model.train_o_proj only applies to mode: acre (vanilla trains the base's own weights)")
    return problems


def validate_recipe(recipe: Recipe, world_size: int | None = None, source: str | None = None) -> Recipe:
    """Raise :class:`RecipeError` listing every problem, else return ``recipe``."""
    problems = check_recipe(recipe, world_size)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or os.sep == "\\" and "\\" in source


def _check_model(recipe: Recipe) -> list[str]:
    m = recipe.model
    problems: list[str] = []
    if m.source.startswith("tiny:"):
        arch = m.source.partition(":")[2]
        if arch not in SUPPORTED_MODEL_TYPES:
            problems.append(f"model.source {m.source!r}: tiny architectures are {', '.join(SUPPORTED_MODEL_TYPES)}")
    elif m.tiny_config:
        problems.append("model.tiny_config applies only to tiny:<arch> sources; remove it")
    elif m.source.startswith("base:"):
        from ..base.fetch import resolve_source

        try:
            problems += _check_local_model_type(Path(resolve_source(m.source)))
        except FileNotFoundError as exc:
            problems.append(f"model.source: {exc}")
    elif _looks_like_path(m.source) and not Path(m.source).expanduser().exists():
        problems.append(f"model.source {m.source!r} does not exist (a local directory or a hub name is expected)")
    elif (Path(m.source).expanduser() / "config.json").is_file():
        problems += _check_local_model_type(Path(m.source).expanduser())
    vanilla_lora = recipe.mode == "vanilla" and m.vanilla == "lora"
    if m.vanilla == "lora" and recipe.mode != "vanilla":
        problems.append("model.vanilla applies to mode: vanilla (what it trains); acre runs set model.l1")
    if m.l1 != "lora" and m.lora != LoraSection() and not vanilla_lora:
        problems.append(f"model.lora sets {m.lora.model_dump()} but model.l1 is {m.l1!r} (full copies), so it would be "
                        "ignored: set model.l1=lora, or drop the LoRA settings (model.lora={})")
    if m.kernel == "flex":
        import torch

        if not torch.cuda.is_available():
            from ..modeling.adapter import FLEX_ON_CPU

            problems.append(f"model.kernel: {FLEX_ON_CPU}")
    if recipe.train.refill_sim.enabled and (recipe.stage != 2 or recipe.mode != "acre"):
        problems.append("train.refill_sim needs stage 2 in acre mode (question/answer samples); set "
                        "train.refill_sim.enabled=false or stage: 2")
    if recipe.train.distill.weight and recipe.mode != "acre":
        problems.append("train.distill trains an ACRE student against its own base; mode: vanilla has no student "
                        "to distil (set train.distill.weight=0)")
    if recipe.train.distill.weight and recipe.train.liger.fused_linear_cross_entropy:
        problems.append("train.distill needs the student's logits, which liger's fused linear cross-entropy never "
                        "forms; set train.liger.fused_linear_cross_entropy=false")
    if recipe.train.refill_sim.enabled and recipe.train.refill_loss.weight:
        problems.append("train.refill_sim and train.refill_loss cannot both be on yet (the refill loss reads the "
                        "plain stage-2 forward); set one of them off")
    if recipe.train.refill_loss.scorer_only and (recipe.train.refill_loss.params != "scorer" or not recipe.model.init_from):
        problems.append("train.refill_loss.scorer_only trains a learned scorer over fixed L1 weights: it needs "
                        "train.refill_loss.params=scorer and model.init_from")
    if recipe.train.refill_loss.params == "scorer" and not recipe.train.refill_loss.weight:
        problems.append("train.refill_loss.params=scorer trains the learned scorer through the refill loss, whose "
                        "weight is 0; set train.refill_loss.weight (e.g. 1)")
    if recipe.train.refill_loss.weight and (recipe.stage != 2 or recipe.mode != "acre"):
        problems.append("train.refill_loss needs stage 2 in acre mode (questions with evidence positions); "
                        "set train.refill_loss.weight=0 or stage: 2")
    if recipe.stage == 2 and recipe.mode == "acre" and not m.init_from:
        problems.append("stage 2 starts from stage-1 L1 weights: set model.init_from to a stage-1 run or checkpoint directory")
    if m.init_from and not (Path(m.init_from) / "config.json").is_file():  # an export is checked when loaded
        from .checkpoint import find_weights_checkpoint

        try:
            find_weights_checkpoint(Path(m.init_from))
        except FileNotFoundError as exc:
            problems.append(f"model.init_from: {exc}")
    if m.dtype in ("bfloat16", "float16") and not recipe.train.deepspeed:
        problems.append(
            f"model.dtype={m.dtype} without DeepSpeed would run AdamW on {m.dtype} weights; use train.deepspeed "
            "(fp32 master weights) or model.dtype: float32 with train.bf16: true (autocast)")
    return problems


def _check_local_model_type(folder: Path) -> list[str]:
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as exc:
        return [f"model.source {folder}: unreadable config.json ({exc})"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        return [f"model.source {folder} is a {model_type!r} model; ACRE supports {', '.join(SUPPORTED_MODEL_TYPES)}"]
    return []


def _check_data(recipe: Recipe) -> list[str]:
    from ..data.output import read_manifest

    d = recipe.data
    path = Path(d.path)
    if read_manifest(path) is not None:
        if d.prepare is None:
            return []
        # The trainer re-checks a prepared dataset against its inputs; say so before any GPU hour.
        from ..data.prepare import prepared_state

        try:
            settings = recipe.prepare_settings()
            stale = not settings.overwrite and prepared_state(settings) == "stale"
        except Exception as exc:  # DataError (inputs, tokenizer) or a settings TypeError
            return [f"data.prepare: {exc}"]
        if stale:
            return [f"data.path {d.path} was prepared from other settings, inputs or tokenizer than data.prepare "
                    "names now (an input file changed?); set data.prepare.overwrite=true to prepare it again, "
                    "or choose another data.path"]
        return []
    if d.prepare is None:
        state = "has no complete manifest.json (unfinished preparation?)" if path.exists() else "does not exist"
        return [f"data.path {d.path} {state}; run 'acre-train preprocess stage{recipe.stage} --output {d.path} ...' "
                "or add a data.prepare section"]
    try:
        recipe.prepare_settings()
    except Exception as exc:  # DataError or TypeError from the settings dataclass
        return [f"data.prepare: {exc}"]
    import glob

    missing = [p for p in d.prepare.get("inputs") or [] if not glob.glob(os.path.expanduser(str(p)))]
    if missing:
        return [f"data.path {d.path} does not exist and data.prepare.inputs {missing} match no file"]
    return []


# DeepSpeed keys the trainer fills from the recipe ("auto") and the recipe value each must equal.
def deepspeed_expected(recipe: Recipe, world_size: int) -> dict[tuple[str, ...], Any]:
    gas, global_batch, _ = resolve_accumulation(recipe, world_size)
    return {
        ("train_micro_batch_size_per_gpu",): recipe.train.micro_batch_size,
        ("gradient_accumulation_steps",): gas,
        ("train_batch_size",): global_batch,
        ("gradient_clipping",): float(recipe.train.max_grad_norm or 0.0),
        ("bf16", "enabled"): bool(recipe.train.bf16 or recipe.model.dtype == "bfloat16"),
        ("fp16", "enabled"): recipe.model.dtype == "float16",
    }


def _check_deepspeed(recipe: Recipe, world_size: int) -> list[str]:
    path = recipe.train.deepspeed
    if not path:
        return []
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"train.deepspeed: {path} does not exist"]
    except json.JSONDecodeError as exc:
        return [f"train.deepspeed: {path} is not valid JSON ({exc})"]
    problems = []
    for keys, expected in deepspeed_expected(recipe, world_size).items():
        node: Any = config
        for k in keys:
            node = node.get(k, "auto") if isinstance(node, dict) else "auto"
        if node != "auto" and node != expected:
            problems.append(f"{path}: {'.'.join(keys)}={node!r} but the recipe implies {expected!r}; set it to \"auto\"")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        problems.append(f"{path}: zero_optimization.stage={stage}; acre-train supports ZeRO 0, 1 and 2")
    if "optimizer" in config or "scheduler" in config:
        problems.append(f"{path}: remove 'optimizer'/'scheduler'; the recipe's train section defines them")
    return problems


RUN_FILES = ("metrics.jsonl", "tensorboard", "latest")  # what a run writes besides checkpoint-N/
RUN_MARKER = ".acre-train-run"  # written first into every run folder: what --overwrite may clear is ours
OURS = (*RUN_FILES, "recipe.yaml", "base_model", RUN_MARKER)  # and checkpoint-N/ folders


def foreign_files(run_dir: Path) -> list[str]:
    """What a run folder holds that no acre-train run wrote (empty for a run folder of ours or a new one).

    A folder with our marker is ours whatever else it holds (a run's user may keep notes in it); without
    it, anything but a run's own names is someone else's."""
    import re as re_

    if not run_dir.is_dir() or (run_dir / RUN_MARKER).is_file():
        return []
    ours = r"checkpoint-\d+|\.checkpoint-\d+\.partial|samples_rank\d+\.jsonl"
    return sorted(p.name for p in run_dir.iterdir() if p.name not in OURS and not re_.fullmatch(ours, p.name))


def earlier_run(run_dir: Path) -> str | None:
    """What shows that ``run_dir`` belongs to a run already (None: free to start in)."""
    from .checkpoint import list_checkpoints

    checkpoints = list_checkpoints(run_dir) if run_dir.is_dir() else []
    if checkpoints:
        return f"its newest checkpoint is {checkpoints[-1].name}"
    logged = [name for name in RUN_FILES if (run_dir / name).exists()]
    return f"it holds {', '.join(logged)}" if logged else None


def _check_resume(recipe: Recipe) -> list[str]:
    resume = recipe.checkpoint.resume_from_checkpoint
    foreign = foreign_files(recipe.run_dir)
    if foreign:  # a folder acre-train did not make: neither start in it nor clear it
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        return [f"run dir {recipe.run_dir} holds files no acre-train run wrote ({shown}); choose another run_name "
                "or output_root (nothing in it is touched)"]
    if (recipe.run_dir / "recipe.yaml").is_file() and not (recipe.run_dir / RUN_MARKER).is_file() \
            and not earlier_run(recipe.run_dir):
        return [f"run dir {recipe.run_dir} holds a recipe.yaml that no acre-train run wrote; a run would replace "
                "it: choose another run_name, or move the file"]
    if not resume and not recipe.checkpoint.overwrite:
        found = earlier_run(recipe.run_dir)
        if found:
            return [f"run dir {recipe.run_dir} already belongs to a run ({found}); continue it with "
                    "checkpoint.resume_from_checkpoint=latest, replace it with checkpoint.overwrite=true "
                    "(or --overwrite), or choose another run_name"]
    if resume and resume != "latest" and not recipe.checkpoint.overwrite:
        inside = Path(resume).expanduser().resolve().is_relative_to(recipe.run_dir.expanduser().resolve())
        found = None if inside else earlier_run(recipe.run_dir)
        if found:  # resuming another run's checkpoint here would prune this dir's and mix two metrics logs
            return [f"checkpoint.resume_from_checkpoint={resume} is not in run dir {recipe.run_dir}, which already "
                    f"belongs to a run ({found}); resume into a new run_name (or the checkpoint's own run dir)"]
    if resume and recipe.checkpoint.overwrite:
        return ["checkpoint.overwrite=true and checkpoint.resume_from_checkpoint are both set; keep one"]
    if not resume or resume == "latest":
        return []
    if not Path(resume).is_dir():
        return [f"checkpoint.resume_from_checkpoint: {resume} is not a directory (use 'latest' or a checkpoint-N path)"]
    return []
