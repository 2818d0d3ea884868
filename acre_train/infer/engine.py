"""Answering questions from a bi-layer cache: score, select, refill, re-run the query, decode.

>>> engine = AcreEngine(model, tokenizer)                      # doctest: +SKIP
>>> cache = engine.build(open("book.txt").read())              # once per context  # doctest: +SKIP
>>> engine.answer(cache, "Who is the narrator?").text          # any number of times  # doctest: +SKIP
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..data.prompt import PromptFormat
from ..modeling.bilayer import BiLayerCache, CacheSettings, num_selected
from ..modeling.interleave import interleave
from ..modeling.kv_buffer import KVBuffer
from ..modeling.ranking import QuestionQueries, choose_refill, rank_spans
from ..modeling.rope import Rope
from ..modeling.scorer_spec import ScorerSettings
from ..modeling.scoring import spans_with
from ..modeling.scoring_pass import (PassStates, open_chunk_plan, question_queries, resume_open_chunk,
                                      run_open_chunk, slice_plan)
from ..modeling.selection import PATH_KEYS, SELECTION_KEYS
from ..modeling.span_choice import span_tokens
from .cache import CacheMismatchError, ContextTooLongError, build_cache, fingerprint, load_cache, max_context_tokens
from .decode import decode
from .placement import execution_device
from .refill import assemble
from .sentences import sentence_ends
from .settings import RefillSettings


@dataclass
class Answer:
    """What one question produced, and what it cost."""

    token_ids: list[int]
    text: str | None
    first_logits: torch.Tensor  # [V] next-token logits after the question (before decoding)
    scores: torch.Tensor | None  # [m] relevance of every L1 entry (None when no scoring was needed)
    selected: list[int]  # L1 entries whose spans were refilled (wholly, or in part with grow), in text order
    k: int
    num_l1: int
    cache_length: int  # refilled cache length P (L1 entries + refilled raw tokens)
    open_chunk: int = 0  # tokens after the refilled cache before decoding: raw tail + question + their L1 tokens
    # score_s (= score_pass_s + select_s when scored), refill_s, prefill_s: the time to the first token;
    # decode_s: the len(token_ids) - 1 decoding steps after it
    timings: dict[str, float] = field(default_factory=dict)
    refilled: torch.Tensor | None = None  # [N_closed] bool: the finished chunks' raw tokens refilled

    def describe(self) -> str:
        t = self.timings
        tokens = f", {int(self.refilled.sum())} tokens" if self.refilled is not None else ""
        return (f"refilled {len(self.selected)}/{self.num_l1} spans{tokens} (k={self.k}), cache {self.cache_length} tokens; "
                f"score {t.get('score_s', 0):.3f}s, refill {t.get('refill_s', 0):.3f}s, "
                f"query {t.get('prefill_s', 0):.3f}s, decode {t.get('decode_s', 0):.3f}s "
                f"({len(self.token_ids)} tokens)")


class _KV(KVBuffer):
    """The refilled cache + the open chunk (rotated keys, values ``[L, H_kv, T, D]``) as a question and its
    answer extend it. ``position``: where the next token is rotated (the cache's length, unless the
    refill kept text positions)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, position: int | None = None):
        length = keys.shape[2]
        buffer = KVBuffer.empty(keys, max(capacity, length), values_like=values)
        super().__init__(buffer.keys, buffer.values)
        self.append(keys, values)
        self.position = length if position is None else position

    def prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.filled(layer)
        return keys[None], values[None]

    def extend(self, new: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append one forward's new entries, given per layer (every layer's)."""
        added = next(iter(new.values()))[0].shape[1]
        for layer, (k, v) in new.items():
            self.write(self.length, k, v, index=layer)
        self.commit(added)
        self.position += added


class AcreEngine:
    """Inference with query-guided refilling over a bi-layer cache (batch size 1).

    ``cache_settings`` fix how contexts are chunked (a cache is tied to them); ``refill`` holds the
    per-question defaults (``W``, ``eta``, scoring layers, decoding), overridable per call.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, cache_settings: CacheSettings | None = None,
                 refill: RefillSettings | None = None, prompt: PromptFormat | None = None,
                 backend: str | None = None, close_tail: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.cache_settings = cache_settings or CacheSettings()
        self.refill = refill or RefillSettings()
        self.prompt = prompt or PromptFormat(tokenizer)
        self.backend = backend
        # Every build runs the context's raw tail once over the L1 memory and keeps its KV: the scoring pass
        # sees exactly that (the tail before any refill), so a question's scoring pass runs only its own
        # tokens. close_tail: the prefill reuses that KV too, so a question runs only its own tokens there
        # as well. What changes then: the tail attends to the L1 memory, not to the refilled spans (it
        # cannot know the question); off, the tail re-runs over every refilled cache, as training has it.
        self.close_tail = close_tail  # every question closed; else each question's selection decides
        layers = model.config.num_hidden_layers  # a stored scorer's layers fail here, not at the first question
        for selection in [self.refill.selection] + [s for _, s in (self.refill.bands.bands if self.refill.bands else ())]:
            selection.scorer.resolved_layers(layers)
        self.device = execution_device(model)
        self._fingerprint: str | None = None
        self._pieces: dict[int, str] = {}  # each token id's text, for sentence ends (decoded once per engine)

    @property
    def fingerprint(self) -> str:
        """This model's cache fingerprint (computed once: the weights must not change under an engine)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model, self.cache_settings)
        return self._fingerprint

    # ------------------------------------------------------------------------------------- build

    def build(self, context: str | Sequence[int], *, progress: bool | None = None) -> BiLayerCache:
        """Build the bi-layer cache of ``context`` (text, rendered into the user turn, or token ids)."""
        ids = self.prompt.context_ids(context) if isinstance(context, str) else list(context)
        cache = build_cache(self.model, ids, self.cache_settings, working_window=self.refill.working_window,
                            progress=progress, kernel_backend=self.backend)
        if cache.tail_ids:
            self._close_tail(cache)
        if self.tokenizer is not None:  # what refill.grow_shape=sentences snaps to (ids past L2: the next token's space)
            cache.sentence_ends = sentence_ends(self.tokenizer, ids, self._pieces)[: cache.num_l2]
        scorer = self.refill.scorer  # what it keeps in the cache (bounds: the key boxes) is made once, saved with it
        scorer.spec.prepare_cache(self.model, cache, scorer)
        return cache

    def read_context(self, path, piece_chars: int = 1 << 20) -> str:
        """The text of a context file, read and counted in pieces: a file longer than this engine can serve
        is refused once its first pieces pass the limit, before the whole of it is read or tokenized."""
        limit = max_context_tokens(self.model, self.cache_settings, self.refill.working_window)
        limit = float("inf") if limit is None else limit
        pieces, count = [], 0
        with open(path, encoding="utf-8") as f:
            while piece := f.read(piece_chars):
                pieces.append(piece)
                if self.tokenizer is not None:  # a piece's edges split at most a token or two differently
                    count += len(self.tokenizer(piece, add_special_tokens=False)["input_ids"]) - 2
                    if count > limit:
                        raise ContextTooLongError(
                            f"{path} holds more than the {limit:,} tokens this export can serve (W = "
                            f"{self.refill.working_window}, interval {self.cache_settings.interval}, position window "
                            f"{getattr(self.model.config, 'max_position_embeddings', '?')}); stopped reading after "
                            f"{sum(map(len, pieces)):,} characters")
        return "".join(pieces)

    def load_cache(self, path) -> BiLayerCache:
        return load_cache(path, self.model, self.cache_settings)

    # ------------------------------------------------------------------------------------ answer

    def answer(self, cache: BiLayerCache, question: str | Sequence[int], *, selected: Sequence[int] | None = None,
               **overrides: Any) -> Answer:
        """Answer ``question`` from ``cache`` (the context is not re-encoded).

        ``selected``: refill these spans (L1 entry indices), or these tokens (a ``[N_closed]`` bool mask of
        the finished raw tokens), instead of scoring (oracle studies, and the check that training in the
        refilled layout computes what this does).

        The unfinished last chunk of the context (raw tail), the question and the answer form one open
        chunk after the refilled cache, whatever its length (it is not split at the stride): ``W``
        bounds the refilled cache, the open chunk comes on top of it.
        """
        settings = self.settings_for(cache, **overrides)
        if cache.settings != self.cache_settings:
            raise CacheMismatchError(f"this cache was built with {cache.settings}, the engine uses {self.cache_settings}")
        if cache.fingerprint != self.fingerprint:
            raise CacheMismatchError("this cache was built by another model (different weights, dtype or architecture)")
        q_ids = self.prompt.question_ids(question) if isinstance(question, str) else list(question)
        if not q_ids:
            raise ValueError("the question is empty")
        timings: dict[str, float] = {}
        plan, k = self.open_chunk(cache, q_ids, settings)
        m = cache.num_l1
        close_tail = self.close_tail or settings.close_tail
        if close_tail and cache.tail_ids and cache.tail_keys is None:  # a cache saved without it
            self._close_tail(cache)
        closed = close_tail and cache.tail_keys is not None
        reuse = closed and settings.reuse_score_pass
        if reuse and max(settings.scorer.resolved_layers(self.model.config.num_hidden_layers)) + 1 >= \
                self.model.config.num_hidden_layers:
            raise ValueError(f"reuse_score_pass starts the prefill above the last scoring layer; the scorer "
                             f"{settings.scorer.describe()} scores at the model's last layer (choose a lower one)")

        tic = time.perf_counter()
        scores = queries = None
        if isinstance(selected, torch.Tensor) and selected.dtype == torch.bool:
            if len(selected) != int(cache.span_bounds[-1]):
                raise ValueError(f"a token selection covers the {int(cache.span_bounds[-1])} finished raw tokens, "
                                 f"got {len(selected)}")
            refill_tokens = selected.cpu()
        elif selected is not None:
            selected = torch.as_tensor(sorted(set(int(j) for j in selected)), dtype=torch.long)
            if len(selected) and not 0 <= int(selected[0]) <= int(selected[-1]) < m:
                raise ValueError(f"selected spans must lie in 0..{m - 1}, got {selected.tolist()}")
            refill_tokens = span_tokens(cache.span_bounds, selected)
        elif 0 < k < m:
            scorer = settings.scorer
            layers = scorer.resolved_layers(self.model.config.num_hidden_layers)
            queries = self.question_queries(cache, plan, num_tail=len(cache.tail_ids), layers=layers, keep_states=reuse)
            timings["score_pass_s"] = time.perf_counter() - tic  # the question through the scoring layers
            scores, refill_tokens = choose_refill(self.model, cache, queries, scorer, k, neighbors=settings.neighbors,
                                           grow=settings.grow, grow_shape=settings.grow_shape)
        else:
            refill_tokens = span_tokens(cache.span_bounds, torch.arange(k))  # all or nothing: no need to score
        timings["score_s"] = time.perf_counter() - tic
        if "score_pass_s" in timings:  # the rest: ranking the spans and choosing the tokens to refill
            timings["select_s"] = timings["score_s"] - timings["score_pass_s"]

        # refill_after_tail: the refilled tokens go after the closed tail, next to the question, not before
        # their L1 entries (the L1 memory and the pending raw tokens stay where they are)
        after = closed and settings.refill_after_tail
        tic = time.perf_counter()
        placed = torch.zeros(int(cache.span_bounds[-1]), dtype=torch.bool) if after else refill_tokens
        refilled = assemble(self.model, cache, placed, settings.positions)
        timings["refill_s"] = time.perf_counter() - tic
        moved = torch.nonzero(refill_tokens).flatten() if after else None  # refill_tokens: a mask of raw tokens
        extra = len(moved) if moved is not None else 0
        self._check_room(refilled.next_position + extra, len(plan), settings.max_new_tokens)

        tic = time.perf_counter()
        interval = self.cache_settings.interval
        capacity = refilled.length + extra + len(plan) + settings.max_new_tokens * (1 + interval) // interval + 1
        kv = _KV(refilled.keys, refilled.values, capacity, position=refilled.next_position)
        if closed:  # the closed tail goes in as KV; only the question runs
            self._extend_rotated(kv, cache.tail_keys, cache.tail_values)
            if after and extra:
                self._extend_rotated(kv, cache.l2_keys.index_select(2, moved).to(kv.keys.device, kv.keys.dtype),
                                     cache.l2_values.index_select(2, moved).to(kv.keys.device, kv.keys.dtype))
            plan = self._question_plan(cache, q_ids)
        first_logits = self._prefill(kv, plan, queries.states if queries is not None else None)
        timings["prefill_s"] = time.perf_counter() - tic

        tic = time.perf_counter()
        tokens = self._decode(kv, first_logits, plan.carry_out, settings)
        timings["decode_s"] = time.perf_counter() - tic
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return Answer(token_ids=tokens, text=text, first_logits=first_logits, scores=scores,
                      selected=torch.nonzero(spans_with(refill_tokens, cache.span_bounds)).flatten().tolist(),
                      refilled=refill_tokens, k=k, num_l1=m, cache_length=refilled.length + extra, open_chunk=len(plan),
                      timings=timings)

    def settings_for(self, cache: BiLayerCache, **overrides: Any) -> RefillSettings:
        """What a question on ``cache`` is answered with: the engine's settings, the length band of the
        cache's context (where the export stores bands), then ``overrides`` (a selection key among them
        holds at every length; the question-path keys, ``close_tail`` and the like, apply to the band's selection)."""
        settings = self.refill
        if any((k in SELECTION_KEYS and k not in PATH_KEYS) or k == "scorer" for k in overrides):
            settings = settings.replace(bands=None)
        settings = settings.for_length(cache.context_tokens)
        return settings.replace(**overrides) if overrides else settings

    def open_chunk(self, cache: BiLayerCache, q_ids: Sequence[int], settings: RefillSettings | None = None):
        """``(plan, k)``: the raw tail + question interleaved as one open chunk, and the spans to refill."""
        settings = settings or self.refill
        k = num_selected(cache.num_l1, self.cache_settings.interval, settings.working_window, settings.max_refill)
        return open_chunk_plan(cache, q_ids), k

    def scores(self, cache: BiLayerCache, plan, *, num_tail: int, layers: Sequence[int] = (-1,),
               scorer: ScorerSettings | str | None = None) -> torch.Tensor:
        """Relevance of every span for the question in ``plan`` (tail + question, interleaved): the
        ``scorer`` (default: the paper's L1-key scorer at ``layers``) on the scoring pass's queries."""
        n_layers = self.model.config.num_hidden_layers
        scorer = ScorerSettings(layers=tuple(layers)) if scorer is None else ScorerSettings.parse(scorer)
        queries = self.question_queries(cache, plan, num_tail=num_tail, layers=scorer.resolved_layers(n_layers))
        return rank_spans(self.model, cache, queries, scorer)

    def question_queries(self, cache: BiLayerCache, plan, *, num_tail: int, layers: Sequence[int],
                         keep_states: bool = False) -> QuestionQueries:
        """The question's query states at ``layers`` (``modeling/scoring_pass.py:question_queries``)."""
        return question_queries(self.model, cache, plan, num_tail=num_tail, layers=layers, device=self.device,
                                backend=self.backend, find_own=self.prompt.question_words, keep_states=keep_states)

    # --------------------------------------------------------------------------------- internals

    def _close_tail(self, cache: BiLayerCache) -> None:
        """Run the raw tail's plan over the L1 memory (as every question's scoring pass would) and keep its
        pre-RoPE keys and values in the cache."""
        plan = cache.tail_plan()
        keys, values = {}, {}

        def capture(layer: int, _q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
            keys[layer], values[layer] = key[0], value[0]

        self._forward(plan, offset=cache.num_l1, prefix=lambda layer: (cache.l1_keys_rot[layer][None],
                                                                       cache.l1_values[layer][None]), capture=capture)
        layers = range(self.model.config.num_hidden_layers)
        cache.tail_keys = torch.stack([keys[x] for x in layers])
        cache.tail_values = torch.stack([values[x] for x in layers])

    def _extend_rotated(self, kv: _KV, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append pre-RoPE ``keys``/``values`` ``[L, H_kv, T, D]`` to ``kv``, rotated at its next positions."""
        rope = Rope.of(self.model)
        rotation = torch.arange(kv.position, kv.position + keys.shape[2])
        kv.extend({layer: (rope.rotate(keys[layer], rotation), values[layer]) for layer in range(keys.shape[0])})

    def _question_plan(self, cache: BiLayerCache, q_ids: Sequence[int]):
        """The question's part of the open chunk, positions from 0 (after the closed tail)."""
        return slice_plan(self.open_chunk(cache, q_ids)[0], cache.tail_keys.shape[2])

    def _forward(self, plan, *, offset: int, prefix, capture, want_hidden: bool = False) -> torch.Tensor | None:
        return run_open_chunk(self.model, plan, offset=offset, prefix=prefix, capture=capture, device=self.device,
                              backend=self.backend, want_hidden=want_hidden)

    def _run_and_extend(self, kv: _KV, plan, states: PassStates | None = None) -> torch.Tensor:
        """Run ``plan`` after ``kv``, append its KV (rotated at its positions), return the hidden states.
        ``states``: the plan's scoring pass, whose layers are taken (keys rotated here) and not run again."""
        offset = kv.position
        new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        rope = Rope.of(self.model)
        cos, sin = rope.cos_sin(torch.as_tensor(plan.positions) + offset, kv.keys.dtype)  # once, not per layer

        def rotated(key: torch.Tensor) -> torch.Tensor:
            return rope.apply(key, cos.to(key.device), sin.to(key.device))

        def capture(layer: int, _q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
            new[layer] = (rotated(key[0]), value[0])

        if states is None:
            hidden = self._forward(plan, offset=offset, prefix=kv.prefix, capture=capture, want_hidden=True)
        else:
            new.update({layer: (rotated(states.keys[layer]), states.values[layer]) for layer in states.keys})
            hidden = resume_open_chunk(self.model, plan, states.hidden, first_layer=states.next_layer, offset=offset,
                                       prefix=kv.prefix, capture=capture, device=self.device, backend=self.backend)
        kv.extend(new)
        return hidden

    def _prefill(self, kv: _KV, plan, states: PassStates | None = None) -> torch.Tensor:
        hidden = self._run_and_extend(kv, plan, states)
        last_raw = int(np.nonzero(~plan.is_l1)[0][-1])
        return self.model.lm_head(hidden[0, last_raw]).float()

    def _decode(self, kv: _KV, logits: torch.Tensor, carry: int, settings: RefillSettings) -> list[int]:
        """Greedy or sampled decoding; an L1 token follows every ``l``-th generated raw token, as in training."""
        interval = self.cache_settings.interval
        stop = set(settings.stop_token_ids)
        if settings.stop_at_eos:
            stop |= self.prompt.stop_ids(self.model.config)

        def step(token: int) -> torch.Tensor:
            nonlocal carry
            plan = interleave([token], first_chunk=1, stride=1, intervals=interval, carry_in=carry)
            carry = plan.carry_out
            with torch.no_grad():
                hidden = self._run_and_extend(kv, plan)
                return self.model.lm_head(hidden[0, 0]).float()

        return decode(logits, step, max_new_tokens=settings.max_new_tokens, stop_ids=stop,
                      temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed)

    def _check_room(self, start: int, query_length: int, max_new: int) -> None:
        """``start``: the position the open chunk starts at (the refilled cache's length, or the context's)."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        interval = self.cache_settings.interval
        needed = start + query_length + max_new + max_new // interval + 1
        if limit is not None and needed > limit:
            raise ContextTooLongError(
                f"refilled cache ({start} positions) + open chunk and question ({query_length}) + "
                f"{max_new} new tokens need {needed} positions, the model has {limit}; lower W / max_refill, "
                "max_new_tokens, or the stride")

