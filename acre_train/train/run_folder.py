"""A training run's folder: what it holds and how a run continues (prepare, identity, resume, save).

``Trainer`` (``trainer.py``) extends this with the data, the model and the loop; everything here is
about the run directory's life, so the loop reads top to bottom without it:

    run_dir/recipe.yaml, checkpoint-N/, latest, metrics.jsonl, tensorboard/   (see checkpoint.py)

A checkpoint records the run's *identity* (what must match to continue it: mode, stage, seed, base,
trainable shapes, global batch, data fingerprint, engine); resume refuses a checkpoint whose identity
differs, or a recipe whose optimisation settings changed, and picks the newest readable checkpoint
for ``latest`` (a damaged one is skipped, saying so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .model import base_reference, load_base, load_trainable_state, save_base, trainable_state
from .recipe import read_yaml, recipe_from_dict
from .recipe_schema import RecipeError


class NonFiniteError(ValueError):
    """A NaN/inf loss, gradient or weight: the run stops before it is saved (a ValueError: a setting to fix)."""


class RunFolder:
    """The run directory's life, for a ``Trainer`` (which sets ``recipe``, ``info``, ``log``, ``run_dir``,
    the model, optimizer, scheduler or DeepSpeed ``engine``, ``manifest`` and the step counters)."""

    def identity(self) -> dict[str, Any]:
        """Fields a checkpoint must share with the recipe to continue it (see check_compatible)."""
        r = self.recipe
        zero = (self.ds_config or {}).get("zero_optimization", {}).get("stage", 0) if r.train.deepspeed else None
        ident = {
            "mode": r.mode, "stage": r.stage, "seed": r.seed, "base_model": base_reference(r),
            "trainable": {k: list(v.shape) for k, v in self.trainable().items()},
            "global_batch_size": self.global_batch, "data_fingerprint": self.manifest.get("fingerprint"),
            "max_samples": r.data.max_samples, "shuffle": r.data.shuffle, "group_by_chunks": r.train.group_by_chunks,
            "eval_split": r.data.eval_split,
            "engine": f"deepspeed-zero{zero}" if r.train.deepspeed else "torch",
        }
        if r.train.deepspeed:
            ident["world_size"] = self.info.world_size  # ZeRO optimizer shards are per rank
        return ident

    def prepare_run_dir(self) -> None:
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

    def resume(self) -> int:
        """Load the checkpoint the recipe names (if any); returns the step to continue after."""
        path = ckpt.resolve_resume(self.run_dir, self.recipe.checkpoint.resume_from_checkpoint)
        if path is None:
            return 0
        if self.recipe.checkpoint.resume_from_checkpoint == "latest":
            path = self.newest_readable(path)
        meta = ckpt.read_meta(path)
        ckpt.check_compatible(meta, self.identity(), path)
        self.check_recipe_changes(path)
        if self.engine is not None:
            from ..files import deepspeed_weights_only

            with deepspeed_weights_only():  # DeepSpeed's loader would unpickle anything
                loaded, _ = self.engine.load_checkpoint(str(path / ckpt.DS_DIR), tag=ckpt.DS_TAG, load_module_strict=False)
            if loaded is None:
                raise ckpt.CheckpointMismatch(f"DeepSpeed found no state in {path / ckpt.DS_DIR}")
        else:
            from ..modeling.learned_scorer import split_state

            l1, scorer = split_state(ckpt.load_trainable(path))
            load_trainable_state(self.model, l1)
            if self.scorer_map is not None:
                self.scorer_map.load_state_dict(scorer)
            # weights_only: tensors and plain containers; a crafted file cannot run code on resume.
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.info.device, weights_only=True))
            self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        ckpt.load_rng(path, self.info.rank)
        self.tokens_seen = int(meta["tokens_seen"])
        self.resumed_log = meta.get("log")  # the step's metrics line, in case a kill came before it was logged
        self.log(f"resumed from {path} at step {meta['step']}")
        return int(meta["step"])

    def newest_readable(self, newest: Path) -> Path:
        """``latest``: the newest checkpoint whose files read back; a damaged one is skipped, saying so."""
        for candidate in reversed(ckpt.list_checkpoints(newest.parent)):
            problem = ckpt.damage(candidate, with_optimizer=self.engine is None)
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

    def trainable(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores: the L1 weights, and the learned scorer's under ``acre_scorer.``."""
        state = trainable_state(self.model)
        if self.scorer_map is not None:
            from ..modeling.learned_scorer import STATE_PREFIX

            state.update({STATE_PREFIX + k: v for k, v in self.scorer_map.state().items()})
        return state

    def _nonfinite_message(self, step: int, what: str, skippable: bool) -> str:
        latest = ckpt.latest_checkpoint(self.run_dir)
        kept = f"{latest.name} (the last finite checkpoint) stays latest" if latest else "no checkpoint was written"
        hint = ("lower train.learning_rate or the loss weights, or tolerate a few such steps with "
                "train.skip_nonfinite_steps=N" if skippable else "lower train.learning_rate or the loss weights")
        return f"step {step}: {what} not finite (NaN/inf); the run stops, {kept}; {hint}"

    def save(self, step: int, log: dict[str, Any] | None = None) -> Path:
        """Checkpoint ``step``; ``log``: its metrics line, kept in the meta so that a resume after a kill
        between this save and the log write fills the line in (metrics.jsonl keeps no gap)."""
        state = self.trainable()
        if not all(bool(torch.isfinite(t).all()) for t in state.values()):
            raise NonFiniteError(self._nonfinite_message(step, "the trained weights are", skippable=False))
        meta = {
            "step": step, "epoch": step // self.steps_per_epoch, "step_in_epoch": step % self.steps_per_epoch,
            "tokens_seen": self.tokens_seen, "samples_seen": step * self.global_batch, "world_size": self.info.world_size,
            "base_model": base_reference(self.recipe), "mode": self.recipe.mode, "stage": self.recipe.stage,
            "base_model_dir": str(self.run_dir / "base_model") if (self.run_dir / "base_model").is_dir() else None,
            "identity": self.identity(),
            # What the model trained on (the prepared data's plan): export's default inference geometry.
            "geometry": {k: plan[k] for k in ("first_chunk", "stride", "intervals") if k in (plan := self.manifest.get("plan") or {})},
            "log": log,
        }
        return ckpt.save_checkpoint(
            self.run_dir, step, rank=self.info.rank, barrier=self.info.barrier, trainable=state,
            meta=meta, recipe_yaml=self.recipe.to_yaml(), optimizer=self.optimizer, scheduler=self.scheduler,
            engine=self.engine, keep_last=self.recipe.checkpoint.keep_last)
