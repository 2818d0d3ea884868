"""Stage 2 in the layout inference answers in (``train.refill_sim``).

Plain stage 2 trains the answer tokens over the L1 entries of earlier chunks and their own chunk. At
inference they attend to the L1 entries **with the top-k raw spans refilled next to them**, then to
the raw tail of the context, the question and what was generated so far, as one open chunk. This
module trains in that second layout, built from the inference code itself:

1. the context's finished chunks run as the cache build does (one ACRE forward with the plan of the
   context; chunk ``t`` sees the L1 entries of chunks ``< t`` and itself), keeping every layer's keys
   and values *with their gradients*;
2. a no-grad scoring pass picks the spans exactly as ``AcreEngine.answer`` does: the same
   ``open_chunk`` plan and ``k = floor(min(W - m, eta) / l)``, the same ``refill.scorer``,
   ``select_spans`` and sink rule. With probability ``force_evidence`` the spans holding the evidence
   are taken first (teacher forcing), the rest by score;
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

from ..infer.cache import BiLayerCache, finished_chunks
from ..infer.refill import refill_layout
from ..infer.scorers import ScorerSettings, forced_spans, rank_spans, select_spans, spans_with
from ..infer.settings import CacheSettings, RefillSettings
from ..modeling.interleave import IGNORE_INDEX, interleave
from ..modeling.rope import Rope

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
    k: int | None = None  # None: inference's k from W and eta
    force_evidence: float = 0.0

    def cache_settings(self) -> CacheSettings:
        return CacheSettings(self.first_chunk, self.stride, self.interval)

    def refill(self) -> RefillSettings:
        return RefillSettings(working_window=self.working_window, max_refill=self.max_refill, scorer=self.scorer,
                              neighbors=self.neighbors)


# ------------------------------------------------------------------------------- one sample, numpy

def split_row(row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(raw ids, raw labels (shifted, as the row stores them), question start, answer start)``."""
    is_l1 = np.asarray(row["is_l1"], dtype=bool)
    raw = np.asarray(row["input_ids"])[~is_l1].astype(np.int64)
    labels = np.asarray(row["labels"])[~is_l1].astype(np.int64)
    question = np.asarray(row.get("question", []), dtype=np.int64).reshape(-1)
    if len(question) != 2:
        raise ValueError("train.refill_sim needs stage-2 rows that record where the question starts ('question' "
                         "column); re-prepare the data with this version")
    targets = np.flatnonzero(labels != IGNORE_INDEX)
    answer = int(targets[0]) + 1 if len(targets) else len(raw)
    return raw, labels, int(question[0]), answer


def sim_sample(row: dict[str, Any], settings: SimSettings, force: bool = False) -> dict[str, np.ndarray]:
    """What the simulated inference of one row needs, as arrays (the collator pads them)."""
    raw, labels, q_start, a_start = split_row(row)
    cache = settings.cache_settings()
    context = raw[:q_start]
    done, raw_done = finished_chunks(len(context), cache)
    plan = interleave(context, first_chunk=cache.first_chunk, stride=cache.stride, intervals=cache.interval)
    closed = plan.chunk_ids < done
    finished = plan.raw_index[closed]
    l1_slots = np.flatnonzero(finished < 0)
    span_ends = l1_slots - np.arange(len(l1_slots))  # raw tokens before each L1 entry (as build_cache)
    bounds = np.concatenate([[0], span_ends]).astype(np.int64)
    carry = raw_done - int(span_ends[-1]) if len(span_ends) else raw_done
    # The open chunk predicts what the row labels after the context: raw token i of it predicts
    # unshifted[i + 1], i.e. the row's shifted label of raw token raw_done + i.
    open_raw = raw[raw_done:]
    unshifted = np.concatenate([[IGNORE_INDEX], labels[raw_done:-1]]) if len(open_raw) else open_raw
    open_plan = interleave(open_raw, first_chunk=max(len(open_raw), 1), stride=max(len(open_raw), 1),
                           intervals=cache.interval, carry_in=carry, raw_labels=unshifted)
    evidence = np.asarray(row.get("evidence", []), dtype=np.int64).reshape(-1, 2)
    in_evidence = np.zeros(raw_done, dtype=bool)
    for a, b in evidence:
        in_evidence[max(a, 0):min(b, raw_done)] = True
    out = {f"ctx_{k}": np.asarray(getattr(plan, k))[closed] for k in PLAN}
    out.update({f"open_{k}": np.asarray(getattr(open_plan, k)) for k in ("input_ids", "is_l1", "positions")})
    out["open_labels"] = np.asarray(open_plan.labels)
    out.update(raw_ids=raw, question_ids=raw[q_start:a_start], tail_ids=raw[raw_done:q_start], span_bounds=bounds,
               evidence_spans=spans_with(torch.from_numpy(in_evidence), torch.from_numpy(bounds)).numpy()
               if len(bounds) > 1 else np.zeros(0, dtype=bool),
               scalars=np.asarray([carry, raw_done, int(force)], dtype=np.int64))
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
                selected: Sequence[int] | None = None, return_logits: bool = False):
    """``(open-chunk AcreOutput, selected spans)`` of one sample in the refilled layout.

    ``selected`` fixes the spans (tests, oracle studies); otherwise they are chosen as inference does.
    """
    from ..infer.engine import AcreEngine
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
    engine = AcreEngine(model, cache_settings=settings.cache_settings(), refill=settings.refill())
    carry, raw_done, force = (int(x) for x in sample["scalars"])
    if selected is None:
        selected_t = choose(engine, cache, sample, settings, force=bool(force))
    else:
        selected_t = torch.as_tensor(list(selected), dtype=torch.long)

    prefix = _refilled_prefix(model, keys, values, ctx_is_l1, cache, selected_t, layers)
    length = prefix[0][0].shape[2] if prefix else 0
    n = len(sample["open_input_ids"])
    positions = sample["open_positions"].to(device)[None] + length
    open_is_l1 = sample["open_is_l1"].bool().to(device)[None]
    out = acre_forward(
        model, input_ids=sample["open_input_ids"].to(device)[None], is_l1=open_is_l1,
        chunk_ids=torch.zeros(1, n, dtype=torch.long, device=device), positions=positions,
        memory_positions=torch.where(open_is_l1, positions, -1), labels=sample["open_labels"].to(device)[None],
        kernel="chunked", prefix=(lambda layer: prefix[layer]) if prefix else None, return_logits=return_logits,
    )
    return out, selected_t


def choose(engine, cache: BiLayerCache, sample: dict[str, torch.Tensor], settings: SimSettings, *, force: bool) -> torch.Tensor:
    """The spans inference would refill for this question (evidence first when ``force``)."""
    q_ids = sample["question_ids"].tolist()
    plan, k = engine.open_chunk(cache, q_ids)
    if settings.k is not None:
        k = max(0, min(settings.k, cache.num_l1))
    m = cache.num_l1
    if not 0 < k < m:
        return torch.arange(k)
    scorer = settings.scorer
    forced = forced_spans(cache, scorer)
    if force and bool(sample["evidence_spans"].any()):
        evidence = sample["evidence_spans"].bool().cpu()
        forced = evidence if forced is None else (evidence | forced)
    with torch.no_grad():
        queries = engine.question_queries(cache, plan, num_tail=len(cache.tail_ids),
                                          layers=scorer.resolved_layers(engine.model.config.num_hidden_layers))
        scores = rank_spans(engine.model, cache, queries, scorer)
    return select_spans(scores, k, neighbors=settings.neighbors, forced=forced)


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
    carry, raw_done, _ = (int(x) for x in sample["scalars"])
    return BiLayerCache(settings=settings.cache_settings(), fingerprint="", l1_keys=l1_keys, l1_keys_rot=rot,
                        l1_values=l1_values, l2_keys=l2_keys, l2_values=l2_values,
                        span_bounds=sample["span_bounds"].cpu().long(), tail_ids=sample["tail_ids"].tolist(),
                        carry=carry, num_context_tokens=raw_done + len(sample["tail_ids"]))


def _refilled_prefix(model, keys, values, ctx_is_l1, cache: BiLayerCache, selected: torch.Tensor, layers: int):
    """Per layer ``(keys [1, H_kv, P, D] rotated at 0..P-1, values)``, differentiable: the L1 entries and
    the selected spans in ``refill_layout``'s order, gathered from the captured context."""
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
    """``(answer-loss sum, label tokens, (KL sum, KL tokens) or None)`` of a collated batch, each sample in
    the refilled layout; with ``distill`` the frozen base (full attention over the row's raw tokens)
    is the teacher of every answer token."""
    total, count = None, 0
    kl_total, kl_count = None, 0
    for b in range(batch["sim_scalars"].shape[0]):
        sample = unpad(batch, b)
        out, _ = sim_forward(model, sample, settings, kernel=kernel)
        total = out.loss_sum if total is None else total + out.loss_sum
        count += out.num_tokens
        if distill is not None:
            part, n = _sample_kl(model, sample, out.hidden_states[0], distill)
            kl_total = part if kl_total is None else kl_total + part
            kl_count += n
    return total, count, (kl_total, kl_count) if distill is not None else None


def _sample_kl(model: nn.Module, sample: dict[str, torch.Tensor], hidden: torch.Tensor, distill: dict[str, Any]):
    from .distill import kl_sum, teacher_top_k

    labels = sample["open_labels"].to(hidden.device)
    rows = labels != IGNORE_INDEX
    raw_done = int(sample["scalars"][1])
    open_raw = torch.cumsum((~sample["open_is_l1"].bool()).long(), 0).to(hidden.device) - 1
    at = raw_done + open_raw[rows]
    logp, ids = teacher_top_k(model, sample["raw_ids"].to(hidden.device), at, distill["top_k"], distill["temperature"])
    return kl_sum(model.lm_head, hidden[rows], logp, ids, distill["temperature"]), int(rows.sum())
