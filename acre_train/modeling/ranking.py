"""Ranking on a bi-layer cache: the question's query states (:class:`QuestionQueries`), one score per
span with a scorer (:func:`rank_spans`), what to refill within a budget (:func:`choose_refill`), and the
package's scorer kinds (``l1``, ``l2``, ``bounds``), registered in ``modeling/scorer_spec.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .scorer_spec import ScorerKind, ScorerSettings, scorer_kind
from .scoring import key_bounds, l2_mass, score_bounds, score_l1, score_l2, segment_scores, spans_with
from .span_choice import grow_tokens, select_spans, span_tokens


@dataclass
class QuestionQueries:
    """The question's rotated query states from the engine's scoring pass, per captured layer.

    ``memory_positions``: where the scoring pass rotated them (after the L1 entries);
    ``text_positions``: where the question sits in the text (after the whole context).
    """

    by_layer: dict[int, torch.Tensor]  # layer -> [H, n, D]
    memory_positions: torch.Tensor  # [n]
    text_positions: torch.Tensor  # [n]
    # ``[n]`` bool: the question's own words among the n tokens (PromptFormat.question_words); None:
    # not known (ids outside the project's prompt, or no tokenizer). ``find_own`` finds them when first
    # asked (most scorers pool every token and never ask).
    own: torch.Tensor | None = None
    find_own: Callable[[], list[bool] | None] | None = field(default=None, repr=False)
    # What several scorers of one question share (calibrate runs hundreds): queries moved to their
    # text positions, per layer, and (``keys``, shared with the own-words view) the rotated L2 keys;
    # freed with the question.
    derived: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    words: "QuestionQueries | None" = field(default=None, repr=False)  # the own-words view, made once
    # the pass's hidden states and KV, kept for the prefill to start above it (scoring_pass.PassStates)
    states: Any = field(default=None, repr=False)

    def for_scorer(self, scorer: ScorerSettings) -> "QuestionQueries":
        """The queries ``scorer`` pools over: all of them, or (``query=question``) the question's own words.

        The template around a question ("Answer the question using the context above", the end of
        turn, the generation prompt) is the same for every question; its tokens attend mostly to the
        context's last sentences, and with the mean over tokens they pull a refill there whatever
        was asked (docs/real-base.md).
        """
        if scorer.query == "all":
            return self
        if self.own is None and self.find_own is not None:
            found, self.find_own = self.find_own(), None
            self.own = None if found is None else torch.tensor(found, dtype=torch.bool)
        if self.own is not None and bool(self.own.all()):
            return self
        if self.own is None or not bool(self.own.any()):
            raise ValueError(f"scorer {scorer.describe()} pools the question's own words, but they are not known "
                             "here: give the engine its tokenizer and the question as text, or as the ids "
                             "PromptFormat.question_ids writes")
        if self.words is None:
            rows = torch.nonzero(self.own.cpu()).flatten()
            self.words = QuestionQueries(
                by_layer={x: q.index_select(1, rows.to(q.device)) for x, q in self.by_layer.items()},
                memory_positions=self.memory_positions[rows], text_positions=self.text_positions[rows],
                own=torch.ones(len(rows), dtype=torch.bool), keys=self.keys)
        return self.words

    def at_text(self, model, layer: int) -> torch.Tensor:
        from .rope import Rope

        key = ("query", layer)
        if key not in self.derived:
            q = self.by_layer[layer].float()
            self.derived[key] = Rope.of(model).reposition(q, self.memory_positions, self.text_positions)
        return self.derived[key]

    def learned(self, model, qmap, layer: int, frame: str) -> torch.Tensor:
        """The learned scorer's queries (``qmap`` on the pre-RoPE query), rotated at the ``frame``'s
        positions: ``"memory"`` (for L1 keys) or ``"text"`` (for raw keys)."""
        from .rope import Rope

        key = ("learned-" + frame, layer)
        if key not in self.derived:
            rope = Rope.of(model)
            with torch.no_grad():  # ranking only: the map trains in train/refill_loss.py, never here
                mapped = qmap(layer, rope.unrotate(self.by_layer[layer].float(), self.memory_positions))
            self.derived[key] = rope.rotate(mapped, self.memory_positions if frame == "memory" else self.text_positions)
        return self.derived[key]

    def l2_keys(self, model, cache, layer: int) -> torch.Tensor:
        if layer not in self.keys:
            self.keys[layer] = cache.l2_keys_rotated(model, layer)
        return self.keys[layer]


def rank_spans(model, cache, queries: QuestionQueries, scorer: ScorerSettings) -> torch.Tensor:
    """One score per span of ``cache`` (``[m]``) with ``scorer``; ``queries`` must hold its layers."""
    layers = scorer.resolved_layers(model.config.num_hidden_layers)
    queries = queries.for_scorer(scorer)
    missing = [x for x in layers if x not in queries.by_layer]
    if missing:
        raise ValueError(f"the scoring pass captured no queries at layers {missing}")
    qmap = _query_map(model, scorer, layers) if scorer.learned else None
    return scorer.spec.rank(model, cache, queries, scorer, layers, qmap)


def question_mass(model, cache, queries: QuestionQueries, scorer: ScorerSettings) -> list[torch.Tensor]:
    """The ``l2`` scorer's per-token mass of the question (:func:`l2_mass`, one per scoring layer)."""
    layers = scorer.resolved_layers(model.config.num_hidden_layers)
    queries = queries.for_scorer(scorer)
    qmap = _query_map(model, scorer, layers) if scorer.learned else None
    qs = [queries.learned(model, qmap, x, "text") if qmap else queries.at_text(model, x) for x in layers]
    ignore = cache.sink_tokens(scorer.sinks) if scorer.sinks else None
    mass = l2_mass(qs, [queries.l2_keys(model, cache, x) for x in layers], ignore)
    if not scorer.unscored:
        return mass
    # Out of the ranking, not out of the softmax: the mass they draw is simply not counted.
    counted = (~cache.sink_tokens(scorer.unscored)).to(mass[0])
    return [m * counted.to(m.device) for m in mass]


def choose_refill(model, cache, queries: QuestionQueries, scorer: ScorerSettings, k: int, *, neighbors: bool = False,
                  grow: int = 0, grow_shape: str = "attention", forced: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [m], refilled [N_closed] bool)``: rank the spans of ``cache`` and pick what to refill.

    The budget is ``k`` spans of ``l`` tokens. ``grow = 0``: whole spans (:func:`select_spans`, with
    ``neighbors``); ``grow = N``: tokens (:func:`grow_tokens` from ``N`` seeds, ``grow_shape``; ``l2`` scorers only).
    ``forced [m]`` bool: spans refilled first (with ``keep_sinks``, the sink spans are added to them).
    """
    sinks = forced_spans(cache, scorer)
    # keep_sinks=tokens keeps whole spans where a span is the unit refilled (no grow).
    if sinks is not None and (not grow or scorer.keep_sinks in ("spans", "first")):
        forced = sinks if forced is None else (forced | sinks)
    if not grow:
        scores = rank_spans(model, cache, queries, scorer)
        return scores, span_tokens(cache.span_bounds, select_spans(scores, k, neighbors=neighbors, forced=forced))
    if not scorer.spec.ranks_tokens:
        raise ValueError(f"refill grow needs a per-token mass (the l2 scorer's); {scorer.describe()} ranks whole spans")
    mass = question_mass(model, cache, queries, scorer)
    bounds = cache.span_bounds.to(torch.long)
    scores = segment_scores(mass, bounds[:-1], bounds[1:], scorer.heads)
    taken = span_tokens(bounds, torch.nonzero(forced).flatten()[:k]) if forced is not None else None
    ends = cache.sentence_ends if grow_shape == "sentences" else None
    if sinks is not None and scorer.keep_sinks == "tokens":
        kept = cache.sink_tokens(scorer.sinks)[: int(bounds[-1])].cpu()
        kept[: int(bounds[1]) if len(bounds) > 1 else 0] = True  # the first span whole: the prompt's instruction
        taken = kept if taken is None else (taken | kept)
    interval = int(torch.diff(bounds).max()) if len(bounds) > 1 else 1
    return scores, grow_tokens(mass, num_tokens=int(bounds[-1]), budget=k * interval, width=interval, seeds=grow,
                               heads=scorer.heads, taken=taken, shape=grow_shape, sentence_ends=ends, spend=True)


def _query_map(model, scorer: ScorerSettings, layers: list[int]):
    from .learned_scorer import query_map_of

    qmap = query_map_of(model)
    if qmap is None:
        raise ValueError(f"scorer {scorer.describe()} is learned, but this model has no learned scorer (an export "
                         "trained with train.refill_loss.params=scorer carries one in acre_scorer.safetensors)")
    missing = [x for x in layers if x not in qmap.layers]
    if missing:
        raise ValueError(f"the learned scorer was trained at layers {qmap.layers}; {scorer.describe()} asks for {missing}")
    return qmap


def forced_spans(cache, scorer: ScorerSettings) -> torch.Tensor | None:
    """``[m]`` bool: the spans ``keep_sinks`` refills whatever their score (None: none)."""
    if not (scorer.keep_sinks and scorer.sinks):
        return None
    if scorer.keep_sinks == "first":  # one span whatever the context's length
        first = torch.zeros(cache.num_l1, dtype=torch.bool)
        first[:1] = True
        return first
    return spans_with(cache.sink_tokens(scorer.sinks), cache.span_bounds)



@scorer_kind
class L1Keys(ScorerKind):
    """The paper's: the question's attention over the L1 keys."""

    name, frame, reads_raw_keys = "l1", "memory", False

    def rank(self, model, cache, queries, scorer, layers, qmap):
        qs = [queries.learned(model, qmap, x, "memory") if qmap else queries.by_layer[x].float() for x in layers]
        return score_l1(qs, [cache.l1_keys_rot[x] for x in layers], scorer.heads)

    def score(self, queries, keys, bounds, heads, ignore):
        return score_l1(queries, keys, heads)


@scorer_kind
class RawKeys(ScorerKind):
    """The question's attention over the raw keys, summed per span."""

    name, ranks_tokens = "l2", True

    def rank(self, model, cache, queries, scorer, layers, qmap):
        bounds = cache.span_bounds.to(torch.long)
        return segment_scores(question_mass(model, cache, queries, scorer), bounds[:-1], bounds[1:], scorer.heads)

    def score(self, queries, keys, bounds, heads, ignore):
        return score_l2(queries, keys, bounds, heads, ignore)


@scorer_kind
class KeyBoxes(ScorerKind):
    """Quest-style: the upper bound of the question's logit over each span's min/max key box."""

    name = "bounds"

    def rank(self, model, cache, queries, scorer, layers, qmap):
        qs = self._text_queries(model, queries, layers, qmap)
        return score_bounds(qs, [cache.key_box(model, x, scorer.sinks) for x in layers], scorer.heads)

    def score(self, queries, keys, bounds, heads, ignore):
        return score_bounds(queries, [key_bounds(k, bounds, ignore) for k in keys], heads)

    def prepare_cache(self, model, cache, scorer):
        for layer in scorer.resolved_layers(model.config.num_hidden_layers):
            cache.key_box(model, layer, scorer.sinks)
