"""Training recipes: a typed YAML schema, dotted ``key=value`` overrides, and checks before model load.

A recipe is validated in three layers, all before any model weight is touched:

1. **Schema** (pydantic, ``extra="forbid"``): unknown or misspelled keys are errors naming the key
   and the nearest valid one (``train.lerning_rate: unknown key; did you mean 'learning_rate'?``).
2. **Cross-field checks** (:func:`check_recipe`): batch split vs. world size, missing dataset,
   stage-2 initial weights, DeepSpeed config values that contradict the recipe, ... Every problem
   gets one actionable message and all of them are reported together.
3. The resolved recipe (after overrides) is what gets written into the run dir and every checkpoint.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import explain_validation
from ..modeling import SUPPORTED_MODEL_TYPES


class RecipeError(ValueError):
    """A recipe that cannot run; the message lists every problem found, one per line."""

    def __init__(self, problems: Sequence[str], source: str | None = None):
        self.problems = list(problems)
        head = f"recipe {source} has {len(self.problems)} problem(s):" if source else "recipe problem(s):"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


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


class _Section(BaseModel):
    # Misspelled keys must be errors (CONVENTIONS: tools that silently drop keys are hated).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSection(_Section):
    """LoRA shape of the L1 projections when ``model.l1: lora`` (peft's rank, alpha, dropout)."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)


class ModelSection(_Section):
    """What to train. ``source``: a local directory, a hub name, ``base:<name>`` (``acre-train base
    fetch``) or ``tiny:<arch>`` (built in-process)."""

    source: str = "tiny:qwen2"
    tiny_config: dict[str, Any] = Field(default_factory=dict)  # tiny_model(...) overrides (tiny: sources only)
    tiny_seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    attn_implementation: str = "sdpa"
    train_o_proj: bool = False  # also train an L1 copy of o_proj (DESIGN §4: optional)
    # L1 projections: "full" trains copies of the base q/k/v (the paper); "lora" trains a peft LoRA
    # delta on frozen copies (a few MB of weights instead of a copy of every q/k/v).
    l1: Literal["full", "lora"] = "full"
    lora: LoraSection = Field(default_factory=lambda: LoraSection())
    # mode: vanilla trains every base weight ("full") or a peft LoRA of model.lora's shape on the base's
    # own q/k/v ("lora"): the paper's SFT-vanilla control, the same data with plain causal attention.
    vanilla: Literal["full", "lora"] = "full"
    kernel: Literal["chunked", "dense", "flex"] | None = None  # ACRE attention kernel; None = default for the device
    gradient_checkpointing: bool = False  # always non-reentrant (DESIGN §3: gradients cross chunks)
    init_from: str | None = None  # stage 2: a stage-1 run directory, checkpoint directory or adapter-only export
    save_base: bool = True  # tiny sources: save the base into <run>/base_model so later stages can reload it


class DataSection(_Section):
    """A prepared dataset directory, and optionally how to prepare it when it does not exist yet."""

    path: str
    # Settings of acre_train.data.prepare_stage1/2 (minus ``output``, which is ``path``); run when
    # ``path`` has no complete dataset. None: the dataset must already exist.
    prepare: dict[str, Any] | None = None
    max_samples: int | None = None  # use only the first N rows (smoke runs)
    shuffle: bool = True
    eval_split: float = Field(0.0, ge=0, lt=1)  # share of samples held out (seeded) for train.eval_every


class LigerSection(_Section):
    """Per-kernel liger toggles, applied only with CUDA; the ACRE forward is never replaced."""

    rms_norm: bool = False
    swiglu: bool = False
    rope: bool = False
    # Fused linear + cross-entropy is computed inside acre_forward, never by patching model.forward.
    fused_linear_cross_entropy: bool = False


class RefillLossSection(_Section):
    """Refill-aware stage 2 (``train/refill_loss.py``): ``weight`` x the retrieval loss is added to the
    answer loss (0: off, plain stage 2); the score is inference's at ``layers`` (default: the last)."""

    weight: float = Field(0.0, ge=0)
    layers: list[int] = Field(default_factory=lambda: [-1], min_length=1)  # (an empty list scores nothing)
    temperature: float = Field(1.0, gt=0)
    # shared: the loss trains the L1 keys decoding attends to. scorer: it trains a learned scorer of its
    # own (modeling/learned_scorer.py, rank ``rank``) for the inference scorer ``scorer`` names; the L1
    # weights then train exactly as without the loss, and the export ranks with ``scorer`` + learned=1.
    params: Literal["shared", "scorer"] = "shared"
    scorer: str = "l2:layers=-1,heads=max"
    rank: int = Field(8, ge=1, le=256)
    # With params=scorer: keep the L1 weights as model.init_from left them and train the scorer alone
    # (a no-grad forward to the last scoring layer per sample; the run's loss is the refill loss).
    scorer_only: bool = False

    @field_validator("scorer")
    @classmethod
    def _scorer_spec(cls, value: str) -> str:
        from ..modeling.scorer_spec import ScorerSettings

        scorer = ScorerSettings.parse(value)  # a misspelt option fails here, with a suggestion
        if scorer.unscored or scorer.query != "all":  # the loss scores spans from the training pass alone
            raise ValueError(f"train.refill_loss.scorer takes no unscored/query option (got {scorer.describe()}); "
                             "they are inference settings: calibrate them on the export")
        return scorer.describe()


class RefillSimSection(_Section):
    """Stage 2 in the refilled layout (``train/refill_sim.py``): each sample's answer attends to the L1
    entries with the spans inference would refill (same scorer, ``k = floor(min(W - m, eta) / l)``)
    next to them, plus the raw tail, as ``AcreEngine.answer`` does. ``force_evidence``: the share of
    samples whose evidence spans are refilled first (teacher forcing). ``interval``: the ``l`` the
    export answers with (default: what ``acre-train export`` stores for this data); ``max_refill`` /
    ``working_window``: eta / W (default: the export's defaults)."""

    enabled: bool = False
    k: int | None = Field(None, ge=0)  # fixed k instead of inference's
    force_evidence: float = Field(0.0, ge=0, le=1)
    interval: int | None = Field(None, ge=1)
    working_window: int | None = Field(None, ge=1)
    max_refill: int | None = Field(None, ge=0)
    # The selection in its one spelling (docs/selection.md), e.g. "l2:layers=7,heads=max +grow=2,centered eta=192":
    # it sets scorer, neighbors, grow, grow_shape and (its eta) max_refill, which may then be left out.
    selection: str | None = None
    scorer: str = "l1:layers=-1"
    neighbors: bool = False
    grow: int = Field(0, ge=0)  # token-granular refill from this many seeds (infer/settings.py: RefillSettings)
    # how grown regions take their tokens ("sentences" needs the text's sentence ends, which training lacks)
    grow_shape: Literal["attention", "centered", "densest"] = "attention"

    @field_validator("scorer")
    @classmethod
    def _scorer_spec(cls, value: str) -> str:
        from ..modeling.scorer_spec import ScorerSettings

        return ScorerSettings.parse(value).describe()

    @model_validator(mode="after")
    def _from_selection(self) -> "RefillSimSection":
        """``selection`` sets the parts; parts given beside it must agree with it."""
        if self.selection is None:
            return self
        from ..modeling.selection import Selection

        chosen = Selection.parse(self.selection)
        if chosen.positions != "compact" or chosen.close_tail:
            raise ValueError(f"train.refill_sim.selection {self.selection!r}: @text and close_tail are inference "
                             "settings; training refills in the compact layout with the tail open")
        if chosen.grow_shape == "sentences":
            raise ValueError("train.refill_sim.selection: +grow=N,sentences needs the text's sentence ends, which "
                             "training does not have; use attention, centered or densest")
        parts = {"scorer": chosen.scorer.describe(), "neighbors": chosen.neighbors, "grow": chosen.grow,
                 "grow_shape": chosen.grow_shape}
        if chosen.max_refill is not None:
            parts["max_refill"] = chosen.max_refill
        defaults = {"scorer": "l1:layers=-1", "neighbors": False, "grow": 0, "grow_shape": "attention", "max_refill": None}
        clash = [k for k, v in parts.items() if getattr(self, k) != defaults[k] and getattr(self, k) != v]
        if clash:
            raise ValueError(f"train.refill_sim.selection {self.selection!r} and train.refill_sim.{clash[0]} "
                             f"({getattr(self, clash[0])!r}) disagree; give the selection or its parts")
        for key, value in parts.items():
            object.__setattr__(self, key, value)
        return self

    def answers_with(self, plan: Mapping[str, Any]) -> dict[str, Any]:
        """What a run trained in the refilled layout answers with, for data chunked by ``plan`` (its
        manifest's ``first_chunk``/``stride``/``intervals``): the geometry inference defaults to for that
        chunking, with this section's l, W and eta where it names them, and its selection. The trainer
        simulates exactly this and ``acre-train export`` stores exactly this (``config.acre.inference``).

        >>> RefillSimSection(enabled=True, max_refill=96).answers_with({"first_chunk": 64, "stride": 32})["max_refill"]
        96
        """
        from ..modeling.geometry import WindowGeometry
        from ..modeling.selection import Selection

        geometry = WindowGeometry.from_mapping({k: plan[k] for k in ("first_chunk", "stride", "intervals") if k in plan})
        out: dict[str, Any] = geometry.inference_dict()
        out.update({k: getattr(self, k) for k in ("interval", "working_window", "max_refill") if getattr(self, k) is not None})
        selection = Selection(scorer=self.scorer, neighbors=self.neighbors, grow=self.grow, grow_shape=self.grow_shape)
        out.update({k: v for k, v in selection.to_dict().items() if k in ("scorer", "neighbors", "grow", "grow_shape")})
        return out


class DistillSection(_Section):
    """Distillation from the frozen base (``train/distill.py``): the loss per label token is
    ``weight * KL(teacher || student) + (1 - weight) * CE``; the teacher is the base with full attention
    over the same raw tokens, keeping its ``top_k`` probabilities at ``temperature``. Stage 1 distils the
    raw tokens of chunks >= 1, stage 2 the answer tokens (in the refilled layout with refill_sim)."""

    weight: float = Field(0.0, ge=0, le=1)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(64, ge=1)


class TrainSection(_Section):
    """Optimisation. ``global_batch_size = micro_batch_size x gradient_accumulation_steps x world``."""

    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int | Literal["auto"] = "auto"
    global_batch_size: int | None = Field(None, ge=1)
    learning_rate: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "cosine"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    warmup_steps: int | None = Field(None, ge=0)
    epochs: float = Field(1.0, gt=0, le=1_000_000)  # finite: the step count is epochs x steps per epoch
    max_steps: int | None = Field(None, ge=1)  # overrides epochs when set
    eval_every: int | None = Field(None, ge=1)  # held-out loss every N steps and at the end (needs data.eval_split)
    max_grad_norm: float | None = 1.0
    # A step whose loss or gradient norm is not finite (NaN/inf) stops the run with an error naming the
    # step; up to this many such steps are skipped instead (no update; torch engine only).
    skip_nonfinite_steps: int = Field(0, ge=0)
    bf16: bool = False
    deepspeed: str | None = None  # a DeepSpeed JSON config (paths are relative to the recipe file, then cwd)
    group_by_chunks: bool = True  # every rank runs the same number of chunks per step
    # Longest wait for another rank in a collective (and at start-up): past it, a rank whose peer died
    # stops with an error naming the cause instead of hanging (torch's default is 30 minutes).
    dist_timeout_s: int = Field(600, ge=10)
    liger: LigerSection = Field(default_factory=LigerSection)
    refill_loss: RefillLossSection = Field(default_factory=RefillLossSection)
    refill_sim: RefillSimSection = Field(default_factory=RefillSimSection)
    distill: DistillSection = Field(default_factory=DistillSection)


class LoggingSection(_Section):
    every_steps: int = Field(1, ge=1)
    tensorboard: bool = True
    progress_bar: bool = True
    log_samples: bool = False  # write <run>/samples_rank<r>.jsonl: sample_index per step (rank checks)


class CheckpointSection(_Section):
    every_steps: int | None = Field(None, ge=1)  # None: only at the end
    keep_last: int | None = Field(2, ge=1)
    resume_from_checkpoint: str | None = None  # "latest" or a checkpoint directory
    overwrite: bool = False  # start afresh in a run dir that holds an earlier run (its checkpoints and logs go)
    stop_after_step: int | None = Field(None, ge=1)  # stop (after saving) at this step: interruption drills


class Recipe(_Section):
    """One training run. See ``recipes/*.yaml`` for commented examples."""

    run_name: str
    output_root: str = "checkpoints"
    stage: Literal[1, 2] = 1
    mode: Literal["acre", "vanilla"] = "acre"  # vanilla: full fine-tune without ACRE (SFT-Vanilla ablation)
    seed: int = Field(0, ge=0, lt=2**32)  # numpy's and torch's seeds are unsigned 32-bit
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection
    train: TrainSection = Field(default_factory=TrainSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)

    @field_validator("run_name")
    @classmethod
    def _one_folder_name(cls, value: str) -> str:
        """The run folder is ``output_root/run_name``: a name with a path in it would write (and, with
        ``--overwrite``, delete) outside ``output_root``."""
        if not value.strip() or value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
            raise ValueError(f"run_name must be one folder name (no '/', '\\' or '..'), got {value!r}; "
                             "put the parent folder in output_root")
        return value

    @property
    def run_dir(self) -> Path:
        return Path(self.output_root) / self.run_name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ------------------------------------------------------------------------------------ loading


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


# ------------------------------------------------------------------------------ cross-field checks


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
            settings = prepare_settings(recipe)
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
        prepare_settings(recipe)
    except Exception as exc:  # DataError or TypeError from the settings dataclass
        return [f"data.prepare: {exc}"]
    import glob

    missing = [p for p in d.prepare.get("inputs") or [] if not glob.glob(os.path.expanduser(str(p)))]
    if missing:
        return [f"data.path {d.path} does not exist and data.prepare.inputs {missing} match no file"]
    return []


def prepare_settings(recipe: Recipe):
    """The data package's settings object for ``data.prepare`` (output = ``data.path``)."""
    from ..data import Stage1Settings, Stage2Settings

    cls = Stage1Settings if recipe.stage == 1 else Stage2Settings
    values = dict(recipe.data.prepare or {})
    if "output" in values:
        raise ValueError("data.prepare.output is data.path; remove it")
    return cls.from_dict({**values, "output": recipe.data.path})


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
