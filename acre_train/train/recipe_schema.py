"""The recipe's schema: one pydantic section per part of a training run (``extra="forbid"``: an unknown or
misspelt key is an error naming the key and the nearest valid one). Loading and overrides are in
``train/recipe.py``, the checks across fields and against the machine in ``train/recipe_checks.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class RecipeError(ValueError):
    """A recipe that cannot run; the message lists every problem found, one per line."""

    def __init__(self, problems: Sequence[str], source: str | None = None):
        self.problems = list(problems)
        head = f"recipe {source} has {len(self.problems)} problem(s):" if source else "recipe problem(s):"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


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

    @model_validator(mode="after")
    def _prepare_is_this_stages(self):
        if self.data.prepare is not None:
            try:
                self.prepare_settings()
            except ValueError as exc:  # the data package names the key and the nearest valid one
                raise ValueError(f"data.prepare (stage {self.stage}): {exc}") from None
        return self

    def prepare_settings(self):
        """``data.prepare`` typed: the data package's ``Stage1Settings``/``Stage2Settings`` of this stage, with
        ``output = data.path`` (what ``acre-train preprocess stage{1,2}`` runs)."""
        from ..data import Stage1Settings, Stage2Settings

        values = dict(self.data.prepare or {})
        if "output" in values:
            raise ValueError("data.prepare.output is data.path; remove it")
        return (Stage1Settings if self.stage == 1 else Stage2Settings).from_dict({**values, "output": self.data.path})

    @property
    def run_dir(self) -> Path:
        return Path(self.output_root) / self.run_name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
