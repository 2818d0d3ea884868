"""Stage 2 in the layout inference answers in (``train.refill_sim``).

Plain stage 2 trains the answer tokens over the L1 entries of earlier chunks and their own chunk. At
inference they attend to the L1 entries **with the top-k raw spans refilled next to them**, then to
the raw tail of the context, the question and what was generated so far, as one open chunk. This
module trains in that second layout, built from the inference code itself:

1. the context's finished chunks run as the cache build does (one ACRE forward with the plan of the
   context; chunk ``t`` sees the L1 entries of chunks ``< t`` and itself), keeping every layer's keys
   and values *with their gradients*;
2. a no-grad scoring pass picks the spans exactly as ``AcreEngine.answer`` does: the same
   ``open_chunk`` plan and ``k = floor(min(W - m, eta) / l)``, the same ``refill.scorer`` and
   selection (``choose_refill``: spans or grown tokens, sink rule). With probability
   ``force_evidence`` the spans holding the evidence are taken first (teacher forcing), the rest by score;
3. the selected spans' raw keys/values are placed before their L1 entries by ``refill_layout`` (the
   function inference assembles with) and rotated at ``0..P-1``;
4. the open chunk (raw tail + question + answer, interleaved with L1 tokens as decoding does) runs
   over that prefix; the loss is the answer tokens' cross-entropy.

Gradients reach the L1 weights through the L1 keys/values of the prefix, through the refilled raw
keys/values (which depend on L1 memory in every chunk after the first) and through the open chunk's
own L1 tokens. The test that matters (tests/test_refill_sim.py): for a fixed selection, the logits at
the answer positions equal ``AcreEngine.answer``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..modeling.bilayer import (BiLayerCache, CacheSettings, finished_chunks, num_selected, refill_layout,
                                span_layout)
from ..modeling.interleave import IGNORE_INDEX, interleave
from ..modeling.ranking import choose_refill
from ..modeling.rope import Rope
from ..modeling.scorer_spec import ScorerSettings
from ..modeling.scoring import spans_with
from ..modeling.scoring_pass import open_chunk_plan, question_queries
from ..modeling.span_choice import span_tokens

PLAN = ("input_ids", "is_l1", "chunk_ids", "positions", "memory_positions")


@dataclass(frozen=True)
class SimSettings:
    """Geometry and refill settings of the simulated inference (what the export will answer with)."""

    first_chunk: int
    stride: int
    interval: int
    working_window: int
    max_refill: int
    scorer: ScorerSettings
    neighbors: bool = False
    grow: int = 0
    grow_shape: str = "attention"
    k: int | None = None  # None: inference's k from W and eta
    force_evidence: float = 0.0

    def __post_init__(self) -> None:
        if self.scorer.query != "all":  # the training pass has token ids, not the question's text
            raise ValueError(f"train.refill_sim selects with scorer query=all only, got {self.scorer.describe()}; "
                             "query=question is an inference setting (calibrate it on the export)")

    def cache_settings(self) -> CacheSettings:
        return CacheSettings(self.first_chunk, self.stride, self.interval)


# ------------------------------------------------------------------------------- one sample, numpy

def split_row(row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """``(raw ids, raw labels (shifted, as the row stores them), questions)``; each question is
    ``(start, answer start, end)`` of its segment. A packed row (``question`` holds N start/end pairs)
    is one context followed by N question+answer segments, each answered as if it came alone."""
    is_l1 = np.asarray(row["is_l1"], dtype=bool)
    raw = np.asarray(row["input_ids"])[~is_l1].astype(np.int64)
    labels = np.asarray(row["labels"])[~is_l1].astype(np.int64)
    question = np.asarray(row.get("question", []), dtype=np.int64).reshape(-1)
    if len(question) < 2 or len(question) % 2:
        raise ValueError("train.refill_sim needs stage-2 rows that record where the question starts ('question' "
                         "column); re-prepare the data with this version")
    starts = [int(x) for x in question[0::2]]
    ends = starts[1:] + [len(raw)]
    out = []
    for q_start, end in zip(starts, ends):
        targets = q_start + np.flatnonzero(labels[q_start:end] != IGNORE_INDEX)
        out.append((q_start, int(targets[0]) + 1 if len(targets) else end, end))
    return raw, labels, out


def sim_sample(row: dict[str, Any], settings: SimSettings, force: bool | Sequence[bool] = False) -> dict[str, np.ndarray]:
    """What the simulated inference of one row needs, as arrays (the collator pads them).

    Every question ``j`` of the row gets an open chunk (the context's raw tail + its own segment),
    concatenated with ``open_question`` naming the question of each token; ``force[j]``: refill
    question ``j``'s evidence first."""
    raw, labels, questions = split_row(row)
    n_q = len(questions)
    force = [bool(force)] * n_q if isinstance(force, (bool, np.bool_)) else [bool(f) for f in force]
    cache = settings.cache_settings()
    context = raw[: questions[0][0]]
    done, raw_done = finished_chunks(len(context), cache)
    plan = interleave(context, first_chunk=cache.first_chunk, stride=cache.stride, intervals=cache.interval)
    closed = plan.chunk_ids < done
    bounds, carry = span_layout(plan, done, raw_done)  # exactly as build_cache lays out the spans
    tail = np.arange(raw_done, questions[0][0])
    evidence = np.asarray(row.get("evidence", []), dtype=np.int64).reshape(-1, 2)
    owner = np.asarray(row.get("evidence_question", [0] * len(evidence) if n_q == 1 else []), dtype=np.int64)
    opens: dict[str, list[np.ndarray]] = {k: [] for k in ("input_ids", "is_l1", "positions", "labels", "question")}
    q_ids, q_bounds, ev_spans = [], [0], []
    for j, (q_start, a_start, end) in enumerate(questions):
        # Raw token i of the open chunk predicts unshifted[i + 1]: the row's shifted label of that token.
        rows = np.concatenate([tail, np.arange(q_start, end)])
        unshifted = np.concatenate([[IGNORE_INDEX], labels[rows[:-1]]]) if len(rows) else rows
        open_plan = interleave(raw[rows], first_chunk=max(len(rows), 1), stride=max(len(rows), 1),
                               intervals=cache.interval, carry_in=carry, raw_labels=unshifted)
        for k in ("input_ids", "is_l1", "positions", "labels"):
            opens[k].append(np.asarray(getattr(open_plan, k)))
        opens["question"].append(np.full(len(open_plan.input_ids), j, dtype=np.int64))
        q_ids.append(raw[q_start:a_start])
        q_bounds.append(q_bounds[-1] + a_start - q_start)
        in_evidence = np.zeros(raw_done, dtype=bool)
        mine = evidence if not len(owner) else evidence[owner == j] if len(owner) == len(evidence) else evidence
        for a, b in mine:
            in_evidence[max(a, 0):min(b, raw_done)] = True
        ev_spans.append(spans_with(torch.from_numpy(in_evidence), torch.from_numpy(bounds)).numpy()
                        if len(bounds) > 1 else np.zeros(0, dtype=bool))
    out = {f"ctx_{k}": np.asarray(getattr(plan, k))[closed] for k in PLAN}
    out.update({f"open_{k}": np.concatenate(v) for k, v in opens.items()})
    out.update(raw_ids=raw[:raw_done], question_ids=np.concatenate(q_ids), question_bounds=np.asarray(q_bounds),
               tail_ids=raw[tail], span_bounds=bounds, evidence_spans=np.concatenate(ev_spans),
               force=np.asarray(force, dtype=bool), scalars=np.asarray([carry, raw_done, n_q], dtype=np.int64))
    return out


def force_draw(seed: int, sample_index: int, step: int, probability: float) -> bool:
    """The teacher-forcing coin of one sample at one step (a pure function: resume redraws it)."""
    if probability <= 0:
        return False
    rng = np.random.default_rng(np.random.SeedSequence((seed, int(sample_index), int(step), 0x5E1F)))
    return bool(rng.random() < probability)


def collate_sim(samples: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Pad each array of the samples to the longest (``sim_<name>`` and ``sim_<name>_len``)."""
    out: dict[str, torch.Tensor] = {}
    for name in samples[0]:
        arrays = [np.asarray(s[name]) for s in samples]
        length = max(len(a) for a in arrays)
        pad = -1 if name.endswith("chunk_ids") else (IGNORE_INDEX if name.endswith("labels") else 0)
        dtype = torch.bool if arrays[0].dtype == bool else torch.long
        tensor = torch.full((len(arrays), length), pad, dtype=dtype) if dtype == torch.long else \
            torch.zeros(len(arrays), length, dtype=torch.bool)
        for i, a in enumerate(arrays):
            tensor[i, : len(a)] = torch.from_numpy(a.astype(np.int64) if dtype == torch.long else a)
        out[f"sim_{name}"] = tensor
        out[f"sim_{name}_len"] = torch.as_tensor([len(a) for a in arrays])
    return out


def unpad(batch: dict[str, torch.Tensor], b: int) -> dict[str, torch.Tensor]:
    """Sample ``b`` of a collated batch, each array cut to its own length."""
    names = [k[4:] for k in batch if k.startswith("sim_") and not k.endswith("_len")]
    return {n: batch[f"sim_{n}"][b, : int(batch[f"sim_{n}_len"][b])] for n in names}


# -------------------------------------------------------------------------------------- forward

def sim_forward(model: nn.Module, sample: dict[str, torch.Tensor], settings: SimSettings, *, kernel: str | None = None,
                selected: Sequence[Sequence[int]] | None = None, return_logits: bool = False):
    """``[(open-chunk AcreOutput, refilled tokens)]`` of one sample in the refilled layout, one per question
    (the tokens as a ``[N_closed]`` bool mask over the context's finished chunks, as ``Answer.refilled``).

    The context runs once; every question refills and answers over it on its own. ``selected[j]``
    fixes question ``j``'s spans or tokens (a bool mask; tests, oracle studies); otherwise they are chosen
    as inference does.
    """
    from ..modeling.adapter import acre_forward

    device = next(model.parameters()).device
    layers = model.config.num_hidden_layers
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}

    def capture(layer: int, _q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        keys[layer], values[layer] = key[0], value[0]

    ctx_is_l1 = sample["ctx_is_l1"].bool().to(device)
    if len(ctx_is_l1):
        acre_forward(model, **{k: sample[f"ctx_{k}"].to(device)[None] for k in PLAN}, kernel=kernel, capture=capture)
    cache = _cache_view(model, keys, values, ctx_is_l1, sample, settings)
    results = []
    m = cache.num_l1
    for j in range(int(sample["scalars"][2])):
        bounds = sample["question_bounds"]
        q_ids = sample["question_ids"][int(bounds[j]) : int(bounds[j + 1])].tolist()
        if selected is None:
            evidence = sample["evidence_spans"][j * m : (j + 1) * m].bool().cpu() if bool(sample["force"][j]) else None
            chosen = choose(model, cache, q_ids, settings, evidence=evidence)
        else:
            fixed = selected[j]
            chosen = fixed.cpu() if isinstance(fixed, torch.Tensor) and fixed.dtype == torch.bool else \
                span_tokens(cache.span_bounds, list(fixed))
        prefix = _refilled_prefix(model, keys, values, ctx_is_l1, cache, chosen, layers)
        length = prefix[0][0].shape[2] if prefix else 0
        mine = sample["open_question"] == j
        n = int(mine.sum())
        positions = sample["open_positions"][mine].to(device)[None] + length
        open_is_l1 = sample["open_is_l1"][mine].bool().to(device)[None]
        out = acre_forward(
            model, input_ids=sample["open_input_ids"][mine].to(device)[None], is_l1=open_is_l1,
            chunk_ids=torch.zeros(1, n, dtype=torch.long, device=device), positions=positions,
            memory_positions=torch.where(open_is_l1, positions, -1), labels=sample["open_labels"][mine].to(device)[None],
            kernel="chunked", prefix=(lambda layer, prefix=prefix: prefix[layer]) if prefix else None,
            return_logits=return_logits,
        )
        results.append((out, chosen))
    return results


def choose(model: nn.Module, cache: BiLayerCache, q_ids: list[int], settings: SimSettings, *,
           evidence: torch.Tensor | None = None) -> torch.Tensor:
    """What inference would refill for this question, as a ``[N_closed]`` bool token mask (``evidence``
    ``[m]`` bool: those spans first): inference's ``k`` (or ``settings.k``), the same scoring pass and
    the same choice (``AcreEngine.answer``)."""
    m = cache.num_l1
    k = num_selected(m, settings.interval, settings.working_window, settings.max_refill)
    if settings.k is not None:
        k = max(0, min(settings.k, m))
    if not 0 < k < m:
        return span_tokens(cache.span_bounds, torch.arange(k))
    scorer = settings.scorer
    forced = evidence if evidence is not None and bool(evidence.any()) else None
    with torch.no_grad():
        queries = question_queries(model, cache, open_chunk_plan(cache, q_ids), num_tail=len(cache.tail_ids),
                                   layers=scorer.resolved_layers(model.config.num_hidden_layers),
                                   device=cache.l1_keys.device)
        _, tokens = choose_refill(model, cache, queries, scorer, k, neighbors=settings.neighbors,
                                  grow=settings.grow, grow_shape=settings.grow_shape, forced=forced)
    return tokens


def _cache_view(model: nn.Module, keys, values, ctx_is_l1: torch.Tensor, sample, settings: SimSettings) -> BiLayerCache:
    """A detached :class:`BiLayerCache` of the captured context (what the scoring pass reads)."""
    kv_heads, dim = model.config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
    dtype = next(model.parameters()).dtype
    device = ctx_is_l1.device
    layers = model.config.num_hidden_layers
    l1_rows = torch.nonzero(ctx_is_l1).reshape(-1)
    raw_rows = torch.nonzero(~ctx_is_l1).reshape(-1)
    if keys:
        l1_keys = torch.stack([keys[x].detach().index_select(1, l1_rows) for x in range(layers)])
        l1_values = torch.stack([values[x].detach().index_select(1, l1_rows) for x in range(layers)])
        l2_keys = torch.stack([keys[x].detach().index_select(1, raw_rows) for x in range(layers)])
        l2_values = torch.stack([values[x].detach().index_select(1, raw_rows) for x in range(layers)])
    else:
        empty = torch.zeros(layers, kv_heads, 0, dim, dtype=dtype, device=device)
        l1_keys = l1_values = l2_keys = l2_values = empty
    rot = Rope.of(model).rotate(l1_keys, torch.arange(l1_keys.shape[2])) if l1_keys.shape[2] else l1_keys
    carry, raw_done = int(sample["scalars"][0]), int(sample["scalars"][1])
    return BiLayerCache(settings=settings.cache_settings(), fingerprint="", l1_keys=l1_keys, l1_keys_rot=rot,
                        l1_values=l1_values, l2_keys=l2_keys, l2_values=l2_values,
                        span_bounds=sample["span_bounds"].cpu().long(), tail_ids=sample["tail_ids"].tolist(),
                        carry=carry, num_context_tokens=raw_done + len(sample["tail_ids"]))


def _refilled_prefix(model, keys, values, ctx_is_l1, cache: BiLayerCache, selected: torch.Tensor, layers: int):
    """Per layer ``(keys [1, H_kv, P, D] rotated at 0..P-1, values)``, differentiable: the L1 entries and
    the selected tokens (or spans) in ``refill_layout``'s order, gathered from the captured context."""
    if not keys:
        return None
    l2_index, l2_slots, l1_slots = refill_layout(cache, selected.cpu())
    device = ctx_is_l1.device
    l1_rows = torch.nonzero(ctx_is_l1).reshape(-1).cpu().numpy()
    raw_rows = torch.nonzero(~ctx_is_l1).reshape(-1).cpu().numpy()
    order = np.empty(len(l1_slots) + len(l2_slots), dtype=np.int64)
    order[l1_slots] = l1_rows
    order[l2_slots] = raw_rows[l2_index]
    index = torch.as_tensor(order, device=device)
    rope = Rope.of(model)
    positions = torch.arange(len(order))
    return [(rope.rotate(keys[x].index_select(1, index), positions)[None], values[x].index_select(1, index)[None])
            for x in range(layers)]


def sim_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], settings: SimSettings, kernel: str | None = None,
                 distill: dict[str, Any] | None = None) -> tuple[torch.Tensor, int, tuple[torch.Tensor, int] | None]:
    """``(answer-loss sum, label tokens, (KL sum, KL tokens) or None)`` of a collated batch, each sample
    (and each question of a packed sample) in the refilled layout; with ``distill`` the frozen base (full
    attention over the context and that question alone) is the teacher of every answer token."""
    total, count = None, 0
    kl_total, kl_count = None, 0
    for b in range(batch["sim_scalars"].shape[0]):
        sample = unpad(batch, b)
        for j, (out, _) in enumerate(sim_forward(model, sample, settings, kernel=kernel)):
            total = out.loss_sum if total is None else total + out.loss_sum
            count += out.num_tokens
            if distill is not None:
                part, n = _question_kl(model, sample, j, out.hidden_states[0], distill)
                kl_total = part if kl_total is None else kl_total + part
                kl_count += n
    return total, count, (kl_total, kl_count) if distill is not None else None


def _question_kl(model: nn.Module, sample: dict[str, torch.Tensor], j: int, hidden: torch.Tensor, distill: dict[str, Any]):
    from .distill import kl_sum, teacher_top_k

    mine = sample["open_question"] == j
    labels = sample["open_labels"][mine].to(hidden.device)
    rows = labels != IGNORE_INDEX
    raw = ~sample["open_is_l1"][mine].bool()
    # The teacher reads the context's closed chunks, then this question's open chunk, all raw.
    teacher = torch.cat([sample["raw_ids"], sample["open_input_ids"][mine][raw]]).to(hidden.device)
    at = len(sample["raw_ids"]) + (torch.cumsum(raw.long(), 0).to(hidden.device) - 1)[rows]
    logp, ids = teacher_top_k(model, teacher, at, distill["top_k"], distill["temperature"])
    return kl_sum(model.lm_head, hidden[rows], logp, ids, distill["temperature"]), int(rows.sum())
