"""The training loop: one small loop for single process, DDP (torchrun) and DeepSpeed ZeRO-1/2.

Why not the transformers ``Trainer``: acre-train needs L1-only checkpoints that still resume exactly,
the data order fixed by the global batch (not by the rank split), token-weighted accumulation across
ranks, and ranks read from the launcher environment. Each of those is an override of a private
``Trainer`` method (``_save_checkpoint``, ``_load_from_checkpoint``, ``get_train_dataloader``,
``compute_loss``, world-size detection); a ~300-line loop that calls DeepSpeed's engine directly is
smaller and keeps every one of those behaviours visible and tested. ``Trainer`` holds its parts
rather than inheriting them: the data (``training_data.TrainingData``), the run folder's life
(``run_folder.RunFolder``: prepare, identity, resume, save), what a checkpoint keeps
(``run_folder.TrainState``) and where the run stands (``run_folder.TrainingProgress``).

Loss weighting: every micro-batch contributes ``loss_sum * world_size / tokens_in_global_batch``;
DDP and DeepSpeed average gradients over ranks (÷ world_size) and DeepSpeed's own ÷accumulation is
switched off (``scale_wrt_gas=False``). The step's gradient is therefore the gradient of the mean
token loss over the whole global batch, whatever the split.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint as ckpt
from .batching import label_count, rank_micro_batches
from ..measure import PeakMemory
from .callbacks import StepLogger
from .cost import step_flops
from ..errors import PeerLost
from .distributed import DistInfo, peer_failure, setup, teardown
from .liger import apply_liger
from .model import LossModule, build_model
from .refill_loss import num_samples as refill_samples
from .recipe_checks import check_recipe, deepspeed_expected, resolve_accumulation
from .recipe_schema import Recipe, RecipeError
from .run_folder import NonFiniteError, RunFolder, TrainingProgress, TrainState
from .training_data import TrainingData, open_training_data
from .vocabulary import base_tokenizer_fingerprint, vocabulary_problems


@dataclass
class TrainResult:
    run_dir: Path
    steps: int  # global step reached
    losses: list[float] = field(default_factory=list)  # per step run in this launch (global token mean)
    last_checkpoint: Path | None = None
    tokens_per_s: float = 0.0
    checkpoint_seconds: list[float] = field(default_factory=list)


def _what(finite_loss: bool, norm: float) -> str:
    return "the loss is" if not finite_loss else f"the gradient norm ({norm}) is"


def train(recipe: Recipe, log=print) -> TrainResult:
    """Run ``recipe`` in this process (one rank of a launcher, or alone). Returns on every rank."""
    info = setup(use_deepspeed=bool(recipe.train.deepspeed), timeout_s=recipe.train.dist_timeout_s)
    try:
        return Trainer(recipe, info, log=log).run()
    except Exception as exc:
        if info.distributed and peer_failure(exc):
            newest = ckpt.latest_checkpoint(recipe.run_dir) if recipe.run_dir.is_dir() else None
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise PeerLost(
                f"rank {info.rank}: lost contact with the other ranks ({first}). A node died, was killed or became "
                f"unreachable (a collective waits at most train.dist_timeout_s={recipe.train.dist_timeout_s} s). "
                f"Last complete checkpoint: {newest or 'none'}; relaunch every node with "
                "checkpoint.resume_from_checkpoint=latest") from exc
        raise
    finally:
        if not (info.distributed and sys.exc_info()[0] is not None):
            teardown()  # after a peer failure, destroying the group would wait on the dead peer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """The loop over a run's data (``data``), model (``model``, inside ``state``) and folder (``folder``)."""

    def __init__(self, recipe: Recipe, info: DistInfo, log=print):
        problems = check_recipe(recipe, info.world_size)
        if problems:  # before any data or model is loaded
            raise RecipeError(problems)
        self.recipe = recipe
        self.info = info
        self.log = log if info.is_main else (lambda *_: None)
        self.gas, self.global_batch, _ = resolve_accumulation(recipe, info.world_size)
        self.run_dir = recipe.run_dir
        self.nonfinite_steps = 0  # steps skipped for a NaN/inf loss or gradient (train.skip_nonfinite_steps)
        self.ds_config: dict[str, Any] | None = None
        self.data: TrainingData  # open_data
        self.state: TrainState  # build
        self.folder: RunFolder  # build
        self.progress = TrainingProgress()

    # ------------------------------------------------------------------------------------ setup

    def open_data(self) -> None:
        """The run's data, prepared and planned before the model loads (``training_data.py``)."""
        self.data = open_training_data(self.recipe, self.info, self.global_batch, log=self.log)

    def check_vocabulary(self) -> None:
        """The data's token ids fit this model's embedding, and its tokenizer is the base's own (where the
        base folder has one): refused before the first step, naming both."""
        r = self.recipe
        fingerprint = None
        if not r.model.source.startswith("tiny:"):
            from ..base.fetch import resolve_source

            fingerprint = base_tokenizer_fingerprint(resolve_source(r.model.source))
        rows = self.model.get_input_embeddings().weight.shape[0]
        problems = vocabulary_problems(r, rows, fingerprint, *self.data.vocabulary)
        if problems:
            raise RecipeError(problems)

    def build(self) -> None:
        """Model, optimizer, scheduler, and the DDP/DeepSpeed wrapper."""
        from transformers import get_scheduler

        r, t = self.recipe, self.recipe.train
        seed_everything(r.seed)
        self.model = build_model(r).to(self.info.device)
        self.check_vocabulary()
        active = apply_liger(self.model, t.liger, log=self.log)
        refill = t.refill_loss
        settings = None
        if self.data.refill_weight:
            from ..modeling.scorer_spec import ScorerSettings

            settings = {"layers": refill.layers, "temperature": refill.temperature, "params": refill.params,
                        "scorer": ScorerSettings.parse(refill.scorer), "rank": refill.rank,
                        "scorer_only": refill.scorer_only}
            if refill.scorer_only:
                self.model.requires_grad_(False)  # the L1 weights stay as model.init_from left them
        self.loss_module = LossModule(self.model, kernel=r.model.kernel, fused_ce=active["fused_linear_cross_entropy"],
                                      refill=settings, sim=self.data.sim,
                                      distill={**t.distill.model_dump(), "stage": r.stage} if r.mode == "acre" else None)
        params = [p for p in self.loss_module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                                      eps=t.adam_epsilon, weight_decay=t.weight_decay)
        total = self.data.total_steps
        warmup = t.warmup_steps if t.warmup_steps is not None else math.ceil(t.warmup_ratio * total)
        scheduler = get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total)
        self.state = TrainState(self.model, optimizer, scheduler,
                                scorer_map=getattr(self.loss_module, "acre_scorer", None))  # params: scorer
        self.wrapped: torch.nn.Module = self.loss_module
        if t.deepspeed:
            import deepspeed

            self.ds_config = self.deepspeed_config()
            engine, optimizer, _, scheduler = deepspeed.initialize(
                model=self.loss_module, model_parameters=params, optimizer=optimizer, lr_scheduler=scheduler,
                config=self.ds_config)
            self.state.engine, self.state.optimizer, self.state.scheduler = engine, optimizer, scheduler
            self.wrapped = engine
        elif self.info.distributed:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.info.local_rank] if self.info.device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(self.loss_module, device_ids=ids)
        self.folder = RunFolder(r, self.info, global_batch=self.global_batch, steps_per_epoch=self.data.steps_per_epoch,
                                manifest=self.data.manifest, ds_config=self.ds_config, log=self.log)

    def deepspeed_config(self) -> dict[str, Any]:
        """The recipe's DeepSpeed JSON with every ``"auto"`` filled from the recipe."""
        config = json.loads(Path(self.recipe.train.deepspeed).read_text(encoding="utf-8"))
        for keys, value in deepspeed_expected(self.recipe, self.info.world_size).items():
            node = config
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = value
        config.setdefault("zero_allow_untested_optimizer", True)  # torch AdamW from the recipe
        config.setdefault("steps_per_print", 10**9)
        return config

    def summary(self) -> str:
        """What is about to run, in a few lines a person reads before the first step."""
        from ..modeling import count_parameters

        r, t = self.recipe, self.recipe.train
        counts = count_parameters(self.model)
        groups = "  ".join(f"{k}={v:,}" for k, v in counts.items() if k not in ("trainable", "frozen", "total"))
        plan = self.data.manifest.get("plan") or {}
        engine = f"DeepSpeed {Path(t.deepspeed).name}" if t.deepspeed else ("DDP" if self.info.distributed else "one process")
        return "\n".join([
            f"run {r.run_name}: stage {r.stage}, mode {r.mode}, base {r.model.source} -> {self.run_dir}",
            f"data {r.data.path}: {len(self.data.dataset):,} samples; plan {plan}" if plan else
            f"data {r.data.path}: {len(self.data.dataset):,} samples",
            f"steps {self.data.total_steps} x global batch {self.global_batch} = micro {t.micro_batch_size} x accumulation "
            f"{self.gas} x {self.info.world_size} rank(s), {engine}, lr {t.learning_rate:g}",
            f"parameters: trainable {counts['trainable']:,} of {counts['total']:,}" + (f" ({groups})" if groups else ""),
        ])

    # ------------------------------------------------------------------------------------- loop

    def run(self) -> TrainResult:
        """Train; the main rank owns the run dir for the whole run (a second process is refused at once)."""
        from ..errors import sigterm_as_interrupt

        if not self.info.is_main:
            with sigterm_as_interrupt():
                return self._run()
        from ..files import FolderLock

        with FolderLock(self.run_dir, "training run"), sigterm_as_interrupt():  # SIGTERM saves as Ctrl-C does
            self.check_still_free()
            return self._run()

    def check_still_free(self) -> None:
        """The recipe checks ran before this process owned the run dir: a run that started meanwhile (and
        has finished, releasing it) is refused here, as it would have been then."""
        from .recipe_checks import earlier_run

        c = self.recipe.checkpoint
        found = None if (c.resume_from_checkpoint or c.overwrite) else earlier_run(self.run_dir)
        if found:
            raise RecipeError([f"run dir {self.run_dir} already belongs to a run ({found}); continue it with "
                               "checkpoint.resume_from_checkpoint=latest or choose another run_name"])

    def _run(self) -> TrainResult:
        self.open_data()  # data problems surface before the model loads
        self.build()
        self.folder.prepare()
        self.progress = self.folder.resume(self.state)
        start, total = self.progress.step, self.data.total_steps
        r = self.recipe
        self.log(self.summary())
        stop = min(total, r.checkpoint.stop_after_step or total)
        logger = StepLogger(self.run_dir, rank=self.info.rank, total_steps=total, start_step=start,
                            tensorboard=r.logging.tensorboard, progress_bar=r.logging.progress_bar,
                            log_samples=r.logging.log_samples, every_steps=r.logging.every_steps,
                            resumed_line=self.progress.resumed_log)
        result = TrainResult(run_dir=self.run_dir, steps=start)
        tokens_run, time_run = 0, 0.0
        cached_epoch, epoch_plan = -1, []
        saved_step = start
        unlogged: dict[str, Any] | None = None  # the finished step's metrics until its line is written
        try:
            for step in range(start + 1, stop + 1):
                epoch, index = divmod(step - 1, self.data.steps_per_epoch)
                if epoch != cached_epoch:
                    cached_epoch, epoch_plan = epoch, self.data.batches(epoch)
                began = time.perf_counter()
                with PeakMemory(self.info.device) as memory:
                    metrics = self.train_step(epoch_plan[index], step, logger)
                elapsed = time.perf_counter() - began
                tokens_run += metrics["tokens"]
                time_run += elapsed
                metrics.update(epoch=epoch + index / self.data.steps_per_epoch, tokens_per_s=metrics["tokens"] / elapsed,
                               rank_gflops_per_s=1e3 * metrics["rank_tflop"] / elapsed,
                               step_seconds=elapsed, peak_memory_mib=memory.peak_mib)
                result.losses.append(metrics["loss"])
                result.steps, unlogged = step, metrics
                self.progress.step = step
                if r.train.eval_every and (step % r.train.eval_every == 0 or step == stop):
                    metrics["eval_loss"] = self.held_out_loss()
                every = r.checkpoint.every_steps
                if (every and step % every == 0) or step == stop:
                    began = time.perf_counter()
                    result.last_checkpoint = self.folder.save(self.state, self.progress, log=dict(metrics))
                    saved_step = step
                    result.checkpoint_seconds.append(time.perf_counter() - began)
                    metrics["checkpoint_seconds"] = result.checkpoint_seconds[-1]
                logger.log_step(step, metrics)
                unlogged = None
        except KeyboardInterrupt:  # Ctrl-C, and SIGTERM (errors.Terminated)
            # The weights hold the last *finished* step (an interrupted step never reached the
            # optimizer): keep it. Distributed ranks may be anywhere, so only one process saves.
            # A step stopped inside its save or held-out loss is finished: its line is written too.
            if unlogged is not None and not self.info.distributed:
                logger.log_step(result.steps, unlogged)
            if result.steps > saved_step and not self.info.distributed:
                result.last_checkpoint = self.folder.save(self.state, self.progress,
                                                          log=dict(unlogged) if unlogged else None)
                logger.message(f"interrupted: saved {result.last_checkpoint.name} (the last finished step); "
                               "continue with checkpoint.resume_from_checkpoint=latest")
            else:
                logger.message(f"interrupted: nothing new saved (last checkpoint: step {saved_step}); "
                               "continue with checkpoint.resume_from_checkpoint=latest")
            raise
        finally:
            logger.close()
        result.tokens_per_s = tokens_run / time_run if time_run else 0.0
        if result.steps < total:
            self.log(f"stopped after step {result.steps} of {total} (checkpoint.stop_after_step)")
        return result

    def train_step(self, batch: np.ndarray, step: int, logger: StepLogger) -> dict[str, Any]:
        """One optimizer step over one global batch; returns the global metrics of the step."""
        info = self.info
        micro = rank_micro_batches(batch, rank=info.rank, world_size=info.world_size,
                                   micro=self.recipe.train.micro_batch_size, accumulation=self.gas)
        data = self.data
        logger.log_samples(step, [int(data.dataset[int(i)]["sample_index"]) for m in micro for i in m])
        tensors = [data.collate([data.dataset[int(i)] for i in m], step=step) for m in micro]
        local_labels = sum(label_count(b) for b in tensors)
        (global_labels,) = info.all_reduce_sum([local_labels])
        scale = info.world_size / max(global_labels, 1.0)
        # The refill loss is a mean per sample that carries evidence (the answer loss: per label token).
        (global_refill,) = info.all_reduce_sum([sum(refill_samples(b) for b in tensors)]) if data.refill_weight else (0,)
        refill_scale = data.refill_weight * info.world_size / max(global_refill, 1.0)
        lr = float(self.state.scheduler.get_last_lr()[0])
        loss_total, refill_total, kl_total, kl_tokens = 0.0, 0.0, 0.0, 0
        for j, batch_tensors in enumerate(tensors):
            batch_tensors = {k: v.to(info.device) for k, v in batch_tensors.items()}
            lm, refill = self.micro_step(batch_tensors, scale, refill_scale, last=j == len(tensors) - 1)
            loss_total, refill_total = loss_total + lm, refill_total + refill
            kl_total, kl_tokens = kl_total + self.loss_module.last_kl[0], kl_tokens + self.loss_module.last_kl[1]
        (loss_sum, refill_sum) = info.all_reduce_sum([loss_total, refill_total])
        grad_norm = self.optimizer_step(step, finite_loss=math.isfinite(loss_sum) and math.isfinite(refill_sum))
        mix = Counter(int(v) for i in batch for v in data.dataset[int(i)]["intervals"])
        chunks = sum(mix.values())
        tokens = int(data.lengths[batch].sum()) if self.recipe.mode == "acre" else int(data.raw_lengths[batch].sum())
        self.progress.tokens_seen += tokens
        r = self.recipe
        flops = step_flops(self.model, tensors, trains_base=r.mode == "vanilla" and r.model.vanilla == "full")
        if self.recipe.train.refill_loss.scorer_only:  # no answer loss is computed: the run's loss is the refill loss
            loss_sum, global_labels = refill_sum, global_refill
        metrics = {"loss": loss_sum / max(global_labels, 1.0), "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                   "rank_tflop": flops / 1e12,
                   "tokens_seen": self.progress.tokens_seen, "label_tokens": int(global_labels),
                   "rank_chunk_spread": self.rank_chunk_spread(batch)}
        metrics.update({f"l1_interval_mix/{k}": v / chunks for k, v in sorted(mix.items())})
        if data.refill_weight:
            metrics.update(refill_loss=refill_sum / max(global_refill, 1.0), refill_samples=int(global_refill))
        if self.loss_module.distill is not None:  # "loss" is then the mixed loss; kl per distilled token
            kl_sum, kl_count = info.all_reduce_sum([kl_total, float(kl_tokens)])
            metrics.update(kl=kl_sum / max(kl_count, 1.0), kl_tokens=int(kl_count))
        return metrics

    @torch.no_grad()
    def held_out_loss(self) -> float:
        """Mean loss per label token over the held-out samples (nanoGPT's ``estimate_loss``); each
        rank takes every world_size-th sample and the sums are all-reduced."""
        loss_sum, count = 0.0, 0.0
        held_out = self.data.eval_dataset
        for i in range(self.info.rank, len(held_out), self.info.world_size):
            batch = {k: v.to(self.info.device) for k, v in self.data.collate([held_out[i]]).items()}
            part, n, refill = self.loss_module(**batch)
            if self.loss_module.scorer_only:
                part, n = refill, refill_samples(batch)
            loss_sum, count = loss_sum + float(part), count + float(n)
        loss_sum, count = self.info.all_reduce_sum([loss_sum, count])
        return loss_sum / max(count, 1.0)

    def rank_chunk_spread(self, batch: np.ndarray) -> int:
        """Max - min over ranks of the chunks each runs this step (the kernel loops to a micro-batch's max)."""
        per_rank = [sum(int(self.data.chunks[m].max()) for m in rank_micro_batches(
            batch, rank=r, world_size=self.info.world_size, micro=self.recipe.train.micro_batch_size,
            accumulation=self.gas)) for r in range(self.info.world_size)]
        return max(per_rank) - min(per_rank)

    def micro_step(self, batch: dict[str, torch.Tensor], scale: float, refill_scale: float, last: bool) -> tuple[float, float]:
        """Forward + backward of one micro-batch, gradients weighted by its share of label tokens (and of
        evidence samples for the refill loss); returns (answer-loss sum, refill-loss sum)."""
        engine = self.state.engine
        bf16 = self.recipe.train.bf16 and engine is None and self.info.device.type == "cuda"
        # DDP: skip the gradient all-reduce until the last micro-batch. DeepSpeed tracks the
        # accumulation boundary itself (its no_sync is refused under ZeRO-2).
        sync = last or engine is not None or not hasattr(self.wrapped, "no_sync")
        context = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()
        with context, (self.wrapped.no_sync() if not sync else nullcontext()):
            loss_sum, _, refill_sum = self.wrapped(**batch)
            loss = loss_sum * scale
            if refill_scale:
                loss = loss + refill_sum * refill_scale
            if engine is not None:
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()  # DeepSpeed counts micro-steps and updates at the boundary
            else:
                loss.backward()
        return float(loss_sum.detach()), float(refill_sum.detach())

    def optimizer_step(self, step: int, finite_loss: bool = True) -> float:
        """Clip, step, schedule (DeepSpeed already did all three); returns the pre-clip grad norm.

        A non-finite loss or gradient norm never reaches the weights (torch engine): the step is skipped
        while ``train.skip_nonfinite_steps`` allows, else the run stops with :class:`NonFiniteError`.
        Under DeepSpeed the update has happened by now; the run stops before anything is saved.
        """
        state = self.state
        if state.engine is not None:
            norm = state.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else float("nan")
            if not finite_loss or not math.isfinite(norm):
                raise NonFiniteError(self.folder.nonfinite_message(step, _what(finite_loss, norm), skippable=False))
            return norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.recipe.train.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip) if params else None
        if state.scorer_map is not None:  # clipped on its own: its gradient must not scale the L1 update
            scorer_norm = torch.nn.utils.clip_grad_norm_(list(state.scorer_map.parameters()), clip)
            norm = scorer_norm if norm is None else norm
        if not finite_loss or not math.isfinite(float(norm)):
            state.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            if self.nonfinite_steps > self.recipe.train.skip_nonfinite_steps:
                raise NonFiniteError(self.folder.nonfinite_message(step, _what(finite_loss, float(norm)), skippable=True))
            self.log(f"warning: step {step}: non-finite loss or gradient norm, skipped "
                     f"({self.nonfinite_steps} of train.skip_nonfinite_steps={self.recipe.train.skip_nonfinite_steps})")
            return float(norm)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        return float(norm)
