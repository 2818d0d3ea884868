"""Refill-aware stage 2: an auxiliary loss that teaches a question to find its evidence's L1 entry.

Refilling helps only if the question's attention over the L1 entries ranks the span holding the
evidence near the top; plain stage 2 hopes the answer loss shapes that ranking. This loss trains it
directly. For every sample that records its evidence (``evidence`` and ``question`` columns of a
stage-2 dataset), it computes the refill score exactly as inference does (``modeling.scoring.score_entries``:
softmax over the L1 entries of question-query · L1-key / sqrt(d), mean over heads, question tokens and
scoring layers) and adds ``-log`` of the score mass on the entries whose spans hold evidence.

Which tokens take part (what inference scores, in the training plan's terms):

* queries: the question's raw tokens (after the context, before the answer) in the chunk of its first
  token -- at inference the tail and the question form one open chunk over the L1 cache;
* entries: the L1 tokens of every earlier chunk, keys rotated at their memory positions ``j``;
* targets: the entries whose span (the raw tokens since the previous L1 token of the chunk) holds an
  evidence token. A sample whose evidence lies in the question's own chunk has no target: skipped.

Gradients reach the L1 projections (the keys of the entries and, through them, every earlier L1
layer); the question's queries come from the frozen base and carry none of their own.

``params: scorer`` trains a learned scorer instead (``modeling/learned_scorer.py``): the captured queries
and keys are detached, the question's queries pass through the scorer's own low-rank map, and the
score is the inference scorer ``train.refill_loss.scorer`` names (``l1``, ``l2`` or ``bounds``, with
its layers, head pooling and sinks). Only the map gets a gradient; the answer loss and every L1
weight are exactly those of a run without it. The loss is ``-log`` of the evidence spans' share of
the pooled scores.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..modeling.scorer_spec import ScorerSettings
from ..modeling.scoring import score_entries
from ..modeling.rope import Rope

# Per-token masks of a stage-2 row: question queries, scored entries, their targets, the L2 context
# (raw tokens of earlier chunks), each raw token's text position and its index within its chunk.
COLUMNS = ("refill_query", "refill_entry", "refill_target", "refill_context", "refill_text", "refill_in_chunk")


def refill_masks(row: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The three per-token masks of one stage-2 row, or None when it gives the loss nothing to learn.

    >>> from acre_train.modeling import interleave
    >>> plan = interleave(list(range(10)), first_chunk=4, stride=6, intervals=2)
    >>> row = {**plan.as_dict(), "evidence": [2, 3], "question": [6, 8]}
    >>> m = refill_masks(row)
    >>> [int(i) for i in np.flatnonzero(m["refill_entry"])], [int(i) for i in np.flatnonzero(m["refill_target"])]
    ([2, 5], [5])
    """
    is_l1 = np.asarray(row["is_l1"], dtype=bool)
    chunks = np.asarray(row["chunk_ids"])
    raw = np.asarray(row["raw_index"])
    evidence = np.asarray(row.get("evidence", []), dtype=np.int64).reshape(-1, 2)
    question = np.asarray(row.get("question", []), dtype=np.int64)
    if not len(evidence) or len(question) != 2 or question[1] <= question[0]:
        return None
    asked = ~is_l1 & (raw >= question[0]) & (raw < question[1])
    if not asked.any():
        return None
    chunk = chunks[np.flatnonzero(asked)[0]]
    query = asked & (chunks == chunk)
    entry = is_l1 & (chunks < chunk)
    in_evidence = ~is_l1 & np.any((raw[:, None] >= evidence[:, 0]) & (raw[:, None] < evidence[:, 1]), axis=1)
    # The entry owning a raw token: the next L1 token of the same chunk (pending tokens own none).
    l1_at = np.flatnonzero(is_l1)
    after = np.searchsorted(l1_at, np.flatnonzero(in_evidence))
    owners = [l1_at[i] for i, p in zip(after, np.flatnonzero(in_evidence)) if i < len(l1_at) and chunks[l1_at[i]] == chunks[p]]
    target = np.zeros_like(is_l1)
    target[owners] = True
    target &= entry
    if not target.any():
        return None
    context = ~is_l1 & (chunks < chunk)
    in_chunk = np.zeros(len(raw), dtype=np.int64)
    for c in np.unique(chunks):
        rows = np.flatnonzero(~is_l1 & (chunks == c))
        in_chunk[rows] = raw[rows] - raw[rows].min()
    return {"refill_query": query, "refill_entry": entry, "refill_target": target, "refill_context": context,
            "refill_text": raw.astype(np.int64), "refill_in_chunk": in_chunk}


def pad_masks(rows: Sequence[dict[str, Any]], length: int) -> dict[str, torch.Tensor]:
    """``[B, length]`` bool masks of a batch (all False for rows without usable evidence)."""
    out = {name: torch.zeros(len(rows), length, dtype=torch.long if name in ("refill_text", "refill_in_chunk") else torch.bool)
           for name in COLUMNS}
    for b, row in enumerate(rows):
        masks = refill_masks(row)
        if masks is None:
            continue
        for name, mask in masks.items():
            out[name][b, : len(mask)] = torch.from_numpy(mask)
    return out


def num_samples(batch: dict[str, torch.Tensor]) -> int:
    """Samples of a collated batch that the refill loss learns from."""
    return int(batch["refill_target"].any(dim=1).sum()) if "refill_target" in batch else 0


class StopForward(Exception):
    """Raised by a capture with ``stop_after_last`` once its last layer is seen (skips the rest)."""


class QueryKeyCapture:
    """An ``acre_forward`` capture hook keeping the rotated queries and pre-RoPE keys of some layers."""

    def __init__(self, layers: Sequence[int], num_layers: int, stop_after_last: bool = False):
        if any(not -num_layers <= layer < num_layers for layer in layers):
            raise ValueError(f"refill_loss.layers {tuple(layers)} out of range for a {num_layers}-layer model")
        self.layers = sorted({layer % num_layers for layer in layers})
        self.stop_after_last = stop_after_last
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, _value: torch.Tensor) -> None:
        if layer in self.layers:
            self.seen[layer] = (query, key)
            if self.stop_after_last and layer == self.layers[-1]:
                raise StopForward


def sample_scores(model: nn.Module, capture: QueryKeyCapture, b: int, query: torch.Tensor, entry: torch.Tensor,
                  memory_positions: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Refill scores ``[m]`` of sample ``b``'s entries (what ``AcreEngine.scores`` computes at inference)."""
    rope = Rope.of(model)
    q_rows = torch.nonzero(query, as_tuple=False).reshape(-1)
    e_rows = torch.nonzero(entry, as_tuple=False).reshape(-1)
    positions = memory_positions.index_select(0, e_rows)
    queries, keys = [], []
    for layer in capture.layers:
        q, k = capture.seen[layer]
        queries.append(q[b].index_select(1, q_rows))
        keys.append(rope.rotate(k[b].index_select(1, e_rows), positions))
    return score_entries(queries, keys, temperature=temperature)


def refill_loss_sum(model: nn.Module, capture: QueryKeyCapture, batch: dict[str, torch.Tensor],
                    temperature: float = 1.0) -> torch.Tensor:
    """Sum over the batch's samples of ``-log`` (score mass on the evidence entries)."""
    total = torch.zeros((), device=batch["refill_target"].device)
    for b in range(batch["refill_target"].shape[0]):
        target = batch["refill_target"][b]
        if not bool(target.any()):
            continue
        entry = batch["refill_entry"][b]
        scores = sample_scores(model, capture, b, batch["refill_query"][b], entry, batch["memory_positions"][b], temperature)
        hit = target[entry]  # which of the scored entries are targets
        total = total - torch.log(scores[hit].sum().clamp_min(1e-30))
    return total


def learned_scores(model: nn.Module, capture: QueryKeyCapture, b: int, batch: dict[str, torch.Tensor],
                   scorer: ScorerSettings, qmap: nn.Module) -> torch.Tensor:
    """Sample ``b``'s span scores ``[m]`` by the learned ``scorer`` (what ``rank_spans`` computes at
    inference with the same map); gradients reach ``qmap`` only."""
    rope = Rope.of(model)
    rows = {name: torch.nonzero(batch[name][b], as_tuple=False).reshape(-1)
            for name in ("refill_query", "refill_entry", "refill_context")}
    q_rows, e_rows, c_rows = rows["refill_query"], rows["refill_entry"], rows["refill_context"]
    q_pos = batch["positions"][b].index_select(0, q_rows)  # where the forward rotated the question's queries
    text = batch["refill_text"][b]
    queries, keys = [], []
    for layer in scorer.resolved_layers(model.config.num_hidden_layers):
        q, k = (t[b].detach() for t in capture.seen[layer])
        mapped = qmap(layer, rope.unrotate(q.index_select(1, q_rows).float(), q_pos))
        if scorer.spec.frame == "memory":
            queries.append(rope.rotate(mapped, q_pos))
            keys.append(rope.rotate(k.index_select(1, e_rows).float(), batch["memory_positions"][b].index_select(0, e_rows)))
        else:
            queries.append(rope.rotate(mapped, text.index_select(0, q_rows)))
            keys.append(rope.rotate(k.index_select(1, c_rows).float(), text.index_select(0, c_rows)))
    # Span j: the context tokens between entry j-1 and entry j (an entry owns the raw tokens before it).
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), torch.searchsorted(c_rows, e_rows)]).cpu()
    ignore = None
    if scorer.sinks:
        ignore = (batch["refill_in_chunk"][b].index_select(0, c_rows) < scorer.sinks).cpu()
    return scorer.spec.score(queries, keys, bounds, scorer.heads, ignore)


def learned_loss_sum(model: nn.Module, capture: QueryKeyCapture, batch: dict[str, torch.Tensor],
                     scorer: ScorerSettings, qmap: nn.Module) -> torch.Tensor:
    """Sum over the batch's samples of ``-log`` (the evidence spans' share of the learned scores)."""
    total = sum(p.sum() for p in qmap.parameters()) * 0.0  # every rank's reducer sees the map used
    for b in range(batch["refill_target"].shape[0]):
        target = batch["refill_target"][b]
        if not bool(target.any()):
            continue
        scores = learned_scores(model, capture, b, batch, scorer, qmap)
        share = scores[target[batch["refill_entry"][b]]].sum() / scores.sum().clamp_min(1e-30)
        total = total - torch.log(share.clamp_min(1e-30))
    return total
