"""The data a run trains on, opened and planned before the model loads (data problems surface first):
the prepared dataset (prepared here on the main rank when the recipe has ``data.prepare``), its
held-out split, the batches of every epoch, and the collator that turns rows into tensors.

    >>> data = open_training_data(recipe, info, global_batch=8)  # doctest: +SKIP
    >>> data.steps_per_epoch, data.total_steps, data.batches(epoch=0)[0]  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .batching import PLAN_COLUMNS, REFILL_INPUTS, Collator, epoch_batches, list_lengths, split_held_out
from .distributed import DistInfo
from .recipe_schema import Recipe, RecipeError
from .refill_sim import SimSettings
from .vocabulary import data_vocabulary


@dataclass
class TrainingData:
    """The prepared data of one run and its plan over the steps."""

    recipe: Recipe
    global_batch: int
    dataset: Any  # datasets.Dataset, numpy-formatted plan columns
    eval_dataset: Any | None  # the held-out split (data.eval_split), or None
    manifest: dict[str, Any]
    vocabulary: tuple  # (vocabulary size, largest id, tokenizer fingerprint), checked against the model
    refill_weight: float  # train.refill_loss.weight in acre mode, else 0
    sim: SimSettings | None  # the inference train.refill_sim simulates, or None
    collate: Collator
    chunks: list[np.ndarray]  # per sample: its chunks' L1 intervals
    lengths: np.ndarray  # per sample: interleaved tokens
    raw_lengths: np.ndarray  # per sample: raw tokens
    steps_per_epoch: int
    total_steps: int

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The global batches (sample indices) of ``epoch``, in order."""
        r = self.recipe
        return epoch_batches(self.chunks, self.global_batch, epoch=epoch, seed=r.seed, shuffle=r.data.shuffle,
                             group_by_chunks=r.train.group_by_chunks)


def open_training_data(recipe: Recipe, info: DistInfo, global_batch: int,
                       log: Callable[[str], None] = print) -> TrainingData:
    """Prepare (main rank, when the recipe asks; an unchanged preparation is reused) and load the dataset,
    check it carries what the recipe's losses need, and plan its batches."""
    from ..data import load_prepared

    r = recipe
    # With data.prepare, always ask the preparation: it reuses data.path only when settings, inputs
    # and tokenizer match its fingerprint, and refuses a directory made from anything else -- an
    # edited input file must not train on the stale copy.
    if r.data.prepare is not None:
        if info.is_main:
            from ..data import prepare_stage1, prepare_stage2

            (prepare_stage1 if r.stage == 1 else prepare_stage2)(r.prepare_settings(), log=log)
        info.barrier()
    dataset, manifest = load_prepared(r.data.path)
    vocabulary = data_vocabulary(r.data.path, manifest, dataset)
    if r.data.max_samples is not None:
        dataset = dataset.select(range(min(r.data.max_samples, len(dataset))))
    dataset, held_out = split_held_out(dataset, r.data.eval_split, r.seed)
    refill_weight = r.train.refill_loss.weight if r.mode == "acre" else 0.0
    extra: tuple[str, ...] = REFILL_INPUTS if refill_weight else ()
    if refill_weight:
        _check_refill_inputs(r, manifest, dataset)
    if int(manifest.get("counts", {}).get("pack_questions") or 1) > 1 and not r.train.refill_sim.enabled:
        raise RecipeError([f"{r.data.path} packs several questions per sample (data.prepare.pack_questions); only "
                           "train.refill_sim trains them correctly (each question over the context alone): set "
                           "train.refill_sim.enabled=true, or prepare with pack_questions: 1"])
    sim = simulated_inference(r, manifest) if r.train.refill_sim.enabled else None
    if sim is not None:
        missing = [c for c in ("question", "evidence") if c not in dataset.column_names]
        if missing:
            raise RecipeError([f"train.refill_sim needs stage-2 data that records the question and its evidence; "
                               f"{r.data.path} lacks the columns {missing} (re-prepare it with this version)"])
        extra = tuple(c for c in ("evidence", "question", "evidence_question") if c in dataset.column_names)
    eval_dataset = held_out.with_format("numpy", columns=[*PLAN_COLUMNS, *(extra if sim is not None else ())]) \
        if held_out is not None else None
    chunks = list_lengths(dataset, "intervals")
    pad = manifest.get("tokenizer", {}).get("pad_token_id")
    data = TrainingData(
        recipe=r, global_batch=global_batch,
        dataset=dataset.with_format("numpy", columns=[*PLAN_COLUMNS, "intervals", "sample_index", *extra]),
        eval_dataset=eval_dataset, manifest=manifest, vocabulary=vocabulary, refill_weight=refill_weight, sim=sim,
        collate=Collator(vanilla=r.mode == "vanilla", pad_token_id=int(pad) if pad is not None else 0,
                         refill=bool(refill_weight), sim=sim, seed=r.seed),
        chunks=chunks, lengths=list_lengths(dataset, "input_ids"),
        raw_lengths=np.asarray(dataset["num_raw_tokens"], dtype=np.int64), steps_per_epoch=0, total_steps=0)
    data.steps_per_epoch = len(data.batches(0))
    if data.steps_per_epoch == 0:
        raise RecipeError([f"data.path {r.data.path} has {len(dataset)} samples, fewer than one global batch "
                           f"of {global_batch}; lower train.global_batch_size or add data"])
    data.total_steps = r.train.max_steps or max(1, int(r.train.epochs * data.steps_per_epoch))
    return data


def _check_refill_inputs(recipe: Recipe, manifest: dict[str, Any], dataset) -> None:
    missing = [c for c in REFILL_INPUTS if c not in dataset.column_names]
    if missing or not manifest.get("counts", {}).get("with_evidence", manifest.get("with_evidence")):
        raise RecipeError([f"train.refill_loss needs stage-2 data with evidence positions; {recipe.data.path} "
                           f"{'lacks the columns ' + str(missing) if missing else 'has no sample with evidence'} "
                           "(re-prepare it with this version, from inputs that carry 'evidence' or from SQuAD)"])


def simulated_inference(recipe: Recipe, manifest: dict[str, Any]) -> SimSettings:
    """The inference ``train.refill_sim`` simulates: what the export of this run will answer with
    (``RefillSimSection.answers_with``, which ``acre-train export`` stores too)."""
    from ..modeling.scorer_spec import ScorerSettings

    sim = recipe.train.refill_sim
    answer = sim.answers_with(manifest.get("plan") or {})
    return SimSettings(first_chunk=answer["first_chunk"], stride=answer["stride"], interval=answer["interval"],
                       working_window=answer["working_window"], max_refill=answer["max_refill"],
                       scorer=ScorerSettings.parse(answer["scorer"]), neighbors=answer["neighbors"],
                       grow=answer["grow"], grow_shape=answer["grow_shape"], k=sim.k,
                       force_evidence=sim.force_evidence)
