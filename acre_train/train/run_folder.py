"""A training run's folder: what it holds and how a run continues (prepare, identity, resume, save).

``Trainer`` (``trainer.py``) holds one :class:`RunFolder` beside its data and model; everything here is
about the run directory's life, so the loop reads top to bottom without it. What a checkpoint stores
is a :class:`TrainState` (the weights being trained and the optimiser's state) and a
:class:`TrainingProgress` (where the run stands):

    run_dir/recipe.yaml, checkpoint-N/, latest, metrics.jsonl, tensorboard/   (see checkpoint.py)

A checkpoint records the run's *identity* (what must match to continue it: mode, stage, seed, base,
trainable shapes, global batch, data fingerprint, engine); resume refuses a checkpoint whose identity
differs, or a recipe whose optimisation settings changed, and picks the newest readable checkpoint
for ``latest`` (a damaged one is skipped, saying so).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import checkpoint as ckpt
from .model import base_reference, load_base, load_trainable_state, save_base, trainable_state
from .recipe import read_yaml, recipe_from_dict
from .distributed import DistInfo
from .recipe_schema import Recipe, RecipeError


class NonFiniteError(ValueError):
    """A NaN/inf loss, gradient or weight: the run stops before it is saved (a ValueError: a setting to fix)."""


@dataclass
class TrainingProgress:
    """Where a run stands: what a checkpoint records besides the weights, and a resume restores."""

    step: int = 0  # the last finished optimizer step
    tokens_seen: int = 0
    resumed_log: dict[str, Any] | None = None  # the resumed step's metrics line (a kill may have come before it was logged)


@dataclass
class TrainState:
    """What training changes and a checkpoint keeps: the model's trainable weights (and the learned
    scorer's), the optimizer and the schedule, or the DeepSpeed engine that holds them."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    engine: Any = None  # DeepSpeed engine
    scorer_map: nn.Module | None = None  # the learned scorer (train.refill_loss.params: scorer)

    def trainable(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores: the L1 weights, and the learned scorer's under ``acre_scorer.``."""
        state = trainable_state(self.model)
        if self.scorer_map is not None:
            from ..modeling.learned_scorer import STATE_PREFIX

            state.update({STATE_PREFIX + k: v for k, v in self.scorer_map.state().items()})
        return state


class RunFolder:
    """The run directory of ``recipe`` on this rank: prepare it, save and resume checkpoints.

    ``global_batch``, ``steps_per_epoch`` and ``manifest`` come from the opened data, ``ds_config`` from the
    DeepSpeed engine (None without): what a checkpoint's identity records.
    """

    def __init__(self, recipe: Recipe, info: DistInfo, *, global_batch: int, steps_per_epoch: int,
                 manifest: dict[str, Any], ds_config: dict[str, Any] | None = None,
                 log: Callable[[str], None] = print):
        self.recipe, self.info, self.log = recipe, info, log
        self.run_dir = recipe.run_dir
        self.global_batch, self.steps_per_epoch = global_batch, steps_per_epoch
        self.manifest, self.ds_config = manifest, ds_config

    def identity(self, state: TrainState) -> dict[str, Any]:
        """Fields a checkpoint must share with the recipe to continue it (see check_compatible)."""
        r = self.recipe
        zero = (self.ds_config or {}).get("zero_optimization", {}).get("stage", 0) if r.train.deepspeed else None
        ident = {
            "mode": r.mode, "stage": r.stage, "seed": r.seed, "base_model": base_reference(r),
            "trainable": {k: list(v.shape) for k, v in state.trainable().items()},
            "global_batch_size": self.global_batch, "data_fingerprint": self.manifest.get("fingerprint"),
            "max_samples": r.data.max_samples, "shuffle": r.data.shuffle, "group_by_chunks": r.train.group_by_chunks,
            "eval_split": r.data.eval_split,
            "engine": f"deepspeed-zero{zero}" if r.train.deepspeed else "torch",
        }
        if r.train.deepspeed:
            ident["world_size"] = self.info.world_size  # ZeRO optimizer shards are per rank
        return ident

    def prepare(self) -> None:
        """Make (or, with ``checkpoint.overwrite``, clear) the folder and write its marker and recipe."""
        if self.info.is_main:
            if self.recipe.checkpoint.overwrite:
                self.clear_earlier_run()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            from .recipe_checks import RUN_MARKER

            marker = self.run_dir / RUN_MARKER
            if not marker.is_file():
                marker.write_text(f"acre-train run folder: {self.recipe.run_name}\n", encoding="utf-8")
            (self.run_dir / "recipe.yaml").write_text(self.recipe.to_yaml(), encoding="utf-8")
            base_dir = self.run_dir / "base_model"
            if self.recipe.model.source.startswith("tiny:") and self.recipe.model.save_base and not base_dir.exists():
                save_base(load_base(self.recipe), base_dir, self.recipe)
        self.info.barrier()

    def clear_earlier_run(self) -> None:
        """``checkpoint.overwrite``: remove what an earlier run wrote here (checkpoints, logs), nothing else;
        a folder holding what no run of ours wrote is refused before anything goes (``recipe._check_resume``)."""
        import shutil

        from .recipe_checks import RUN_FILES, foreign_files

        if foreign_files(self.run_dir):  # checked at validation too; a file that appeared since stops it here
            raise RecipeError([f"run dir {self.run_dir} holds files no acre-train run wrote: "
                               f"{', '.join(foreign_files(self.run_dir))}; nothing was removed"])

        for path in [*ckpt.list_checkpoints(self.run_dir), *(self.run_dir / n for n in RUN_FILES)]:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def resume(self, state: TrainState) -> TrainingProgress:
        """Load the checkpoint the recipe names (if any) into ``state``; returns where the run stands."""
        path = ckpt.resolve_resume(self.run_dir, self.recipe.checkpoint.resume_from_checkpoint)
        if path is None:
            return TrainingProgress()
        if self.recipe.checkpoint.resume_from_checkpoint == "latest":
            path = self.newest_readable(path, with_optimizer=state.engine is None)
        meta = ckpt.read_meta(path)
        ckpt.check_compatible(meta, self.identity(state), path)
        self.check_recipe_changes(path)
        if state.engine is not None:
            from ..files import deepspeed_weights_only

            with deepspeed_weights_only():  # DeepSpeed's loader would unpickle anything
                loaded, _ = state.engine.load_checkpoint(str(path / ckpt.DS_DIR), tag=ckpt.DS_TAG, load_module_strict=False)
            if loaded is None:
                raise ckpt.CheckpointMismatch(f"DeepSpeed found no state in {path / ckpt.DS_DIR}")
        else:
            from ..modeling.learned_scorer import split_state

            l1, scorer = split_state(ckpt.load_trainable(path))
            load_trainable_state(state.model, l1)
            if state.scorer_map is not None:
                state.scorer_map.load_state_dict(scorer)
            # weights_only: tensors and plain containers; a crafted file cannot run code on resume.
            state.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.info.device, weights_only=True))
            state.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        ckpt.load_rng(path, self.info.rank)
        self.log(f"resumed from {path} at step {meta['step']}")
        return TrainingProgress(step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]), resumed_log=meta.get("log"))

    def newest_readable(self, newest: Path, with_optimizer: bool = True) -> Path:
        """``latest``: the newest checkpoint whose files read back; a damaged one is skipped, saying so."""
        for candidate in reversed(ckpt.list_checkpoints(newest.parent)):
            problem = ckpt.damage(candidate, with_optimizer=with_optimizer)
            if problem is None:
                return candidate
            self.log(f"warning: {candidate.name} is damaged ({problem}); trying the previous checkpoint")
        raise ckpt.CheckpointMismatch(f"no readable checkpoint in {self.run_dir}: every one is damaged")

    def check_recipe_changes(self, checkpoint: Path) -> None:
        """Resume continues the saved optimizer and schedule: a changed learning rate, scheduler or other
        optimisation setting would be silently ignored, so it is refused; step budget, logging and
        checkpoint cadence may change (and the change is logged)."""
        saved_file = checkpoint / "recipe.yaml"
        if not saved_file.is_file():
            return
        saved = read_yaml(saved_file.read_text(encoding="utf-8"), str(saved_file)) or {}
        try:  # keys added to the recipe since that checkpoint take their defaults, not "changed from None"
            saved = recipe_from_dict(saved).model_dump(mode="json")
        except RecipeError:
            pass
        applied, refused = ckpt.recipe_changes(saved, self.recipe.model_dump(mode="json"))
        if refused:
            raise ckpt.CheckpointMismatch(
                f"resuming {checkpoint} with a changed recipe; these settings cannot change mid-run (the saved "
                "optimizer/schedule would ignore them):\n" + "\n".join(f"  - {c}" for c in refused)
                + "\nrestore them, or start a new run_name (model.init_from can start from this checkpoint)")
        for change in applied:
            self.log(f"resume: {change} (applied)")

    def nonfinite_message(self, step: int, what: str, skippable: bool) -> str:
        """Why the run stops at ``step`` and what the folder keeps."""
        latest = ckpt.latest_checkpoint(self.run_dir)
        kept = f"{latest.name} (the last finite checkpoint) stays latest" if latest else "no checkpoint was written"
        hint = ("lower train.learning_rate or the loss weights, or tolerate a few such steps with "
                "train.skip_nonfinite_steps=N" if skippable else "lower train.learning_rate or the loss weights")
        return f"step {step}: {what} not finite (NaN/inf); the run stops, {kept}; {hint}"

    def save(self, state: TrainState, progress: TrainingProgress, log: dict[str, Any] | None = None) -> Path:
        """Checkpoint the step ``progress`` has reached; ``log``: its metrics line, kept in the meta so that a
        resume after a kill between this save and the log write fills the line in (metrics.jsonl keeps no gap)."""
        step = progress.step
        weights = state.trainable()
        if not all(bool(torch.isfinite(t).all()) for t in weights.values()):
            raise NonFiniteError(self.nonfinite_message(step, "the trained weights are", skippable=False))
        meta = {
            "step": step, "epoch": step // self.steps_per_epoch, "step_in_epoch": step % self.steps_per_epoch,
            "tokens_seen": progress.tokens_seen, "samples_seen": step * self.global_batch,
            "world_size": self.info.world_size,
            "base_model": base_reference(self.recipe), "mode": self.recipe.mode, "stage": self.recipe.stage,
            "base_model_dir": str(self.run_dir / "base_model") if (self.run_dir / "base_model").is_dir() else None,
            "identity": self.identity(state),
            # What the model trained on (the prepared data's plan): export's default inference geometry.
            "geometry": {k: plan[k] for k in ("first_chunk", "stride", "intervals") if k in (plan := self.manifest.get("plan") or {})},
            "log": log,
        }
        return ckpt.save_checkpoint(
            self.run_dir, step, rank=self.info.rank, barrier=self.info.barrier, trainable=weights,
            meta=meta, recipe_yaml=self.recipe.to_yaml(), optimizer=state.optimizer, scheduler=state.scheduler,
            engine=state.engine, keep_last=self.recipe.checkpoint.keep_last)
