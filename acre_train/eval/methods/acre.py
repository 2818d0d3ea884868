"""The ``acre`` and ``acre-l1`` rows: an ACRE model answering through its bi-layer cache.

Both rows feed :class:`acre_train.infer.AcreEngine` the harness's own token ids, so every row of a
table reads identical tokens: the context part (``prefix + documents``) is cached once, query
independently; the question part (the suffix) is answered over it. ``acre`` refills the most
relevant L2 spans (DESIGN.md §5); ``acre-l1`` is the same engine with ``max_refill = 0``: the question
sees the L1 cache and the raw tail only.

Settings left at ``0`` come from the model's export (``config.acre.inference``), else the paper's
inference defaults (interval 16, W = 32K, η = 4096) with the recipe chunking ``W0 = 4096, S = 2048``.

``close_tail=1`` runs the context's raw tail once at build time (it then attends to the L1 memory,
not to the refilled spans) so that a question runs only its own tokens.

``positions=text`` rotates the refilled cache at each token's index in the context instead of at
``0..P-1`` (refilled spans keep their distances in the text; ``modeling/selection_words.py:POSITIONS``).

``selection=`` takes a whole selection in its one spelling (docs/selection.md; what ``--selection``
takes) and runs to the end of the row: ``acre:selection=l2:layers=3,heads=max +grow=2,sentences eta=512``.
``scorer=`` takes what ``--scorer`` takes, ``acre:scorer=l2:layers=3,heads=max,sinks=4`` (the older
``scorer=l2:layers=3:heads=max`` reads the same). The single options (``layers``, ``heads``, ``sinks``,
``keep_sinks``, ``query``, ``unscored``, ``neighbors``, ``grow``, ``grow_shape``, ``positions``) change the
row's selection, or the export's stored one. A row that sets any of them answers with it at every
length; one that sets none answers with the export's length bands.

``kv_attended`` counts what the first generated token attends to per layer: L1 entries, refilled raw
tokens, and the open chunk (raw tail, question and their L1 tokens). ``refill_recall`` is the share
of the evidence (needles holding a gold answer, or gold documents) that a refilled span or the raw tail
*overlapped*; ``refill_coverage`` the share of the evidence's tokens that were visible (a needle cut
in two by a span boundary and refilled by half counts 0.5); ``refill_visible_share`` the share of the
context so made visible (what a random choice of as many spans would reach on average).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..prompt import PreparedExample, document_text
from .base import CostRecord, EvalMethod, GenerationConfig, MethodResult, decode_text



@dataclass
class Acre(EvalMethod):
    """ACRE with query-guided refilling (0 = the export's stored default)."""

    name: ClassVar[str] = "acre"
    needs_acre: ClassVar[bool] = True
    first_chunk: int = 0
    stride: int = 0
    interval: int = 0
    working_window: int = 0
    max_refill: int = -1  # -1: the export's default; 0 disables refilling (acre-l1)
    selection: str = ""  # a whole selection, its one spelling ("": the export's)
    scorer: str = ""  # a scorer spec as --scorer takes it, "l2:layers=3,heads=max" ("": the export's)
    layers: str = ""  # scoring layers, "7+9"
    heads: str = ""  # mean | max
    sinks: int = -1
    keep_sinks: str = ""  # 0 | 1 (= spans) | spans | tokens ("": the export's)
    query: str = ""  # all | question: the question tokens the scorer pools over ("": the export's)
    unscored: int = -1  # l2: chunk-start tokens whose mass places no refill (-1: the export's)
    neighbors: int = -1
    grow: int = -1  # token-granular refill from this many seeds (0: whole spans; -1: the export's)
    grow_shape: str = ""  # attention | centered | densest ("": the export's)
    close_tail: int = 0  # 1: the raw tail runs once at build time (AcreEngine(close_tail=True))
    positions: str = ""  # compact | text: where the refilled cache is rotated ("": the export's)

    @classmethod
    def join_options(cls, opts: list[str]) -> list[str]:
        """``selection=`` takes the rest of the row; ``scorer=`` the scorer options after it."""
        from ...modeling.scorer_spec import ScorerSettings

        scorer_keys = {f for f in ScorerSettings.__dataclass_fields__ if f != "kind"}
        out: list[str] = []
        for i, opt in enumerate(opts):
            key = opt.partition("=")[0]
            if key == "selection":
                return out + [":".join(opts[i:])]
            if out and out[-1].startswith("scorer=") and key in scorer_keys:
                out[-1] += ("," if ":" in out[-1] else ":") + opt
            else:
                out.append(opt)
        return out

    def check(self) -> None:
        for key in ("first_chunk", "stride", "interval", "working_window"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0 (0: the export's default), got {getattr(self, key)}")
        if self.max_refill < -1:
            raise ValueError(f"max_refill must be >= 0 (-1: the export's default), got {self.max_refill}")
        self.scorer_settings(None)  # a bad scorer option fails when the row is parsed
        if self.selection:
            from ...modeling.selection import Selection

            Selection.parse(self.selection)
        from ...modeling.selection_words import GROW_SHAPES

        if self.grow_shape and self.grow_shape not in GROW_SHAPES:
            raise ValueError(f"grow_shape must be one of {', '.join(GROW_SHAPES)}, got {self.grow_shape!r}")
        from ...modeling.selection import POSITIONS

        if self.positions and self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")

    def scorer_settings(self, stored):
        """The row's scorer: ``scorer=`` starts afresh, other options change ``stored`` (the export's)."""
        from dataclasses import replace

        from ...modeling.scorer_spec import ScorerSettings

        base = ScorerSettings.parse(self.scorer) if self.scorer else (stored or ScorerSettings())
        changes = {}
        if self.layers:
            changes["layers"] = ScorerSettings.parse(f"l1:layers={self.layers}").layers
        if self.heads:
            changes["heads"] = self.heads
        if self.sinks >= 0:
            changes["sinks"] = self.sinks
        if self.keep_sinks:
            changes["keep_sinks"] = self.keep_sinks
        if self.query:
            changes["query"] = self.query
        if self.unscored >= 0:
            changes["unscored"] = self.unscored
        return replace(base, **changes)

    def _sets_selection(self) -> bool:
        return bool(self.selection or self.scorer or self.layers or self.heads or self.keep_sinks or self.query or self.grow_shape
                    or self.positions or any(x >= 0 for x in (self.max_refill, self.sinks, self.unscored,
                                                               self.neighbors, self.grow)))

    def overrides(self) -> dict[str, int]:
        """This row's options that replace the export's stored geometry."""
        mine = {key: getattr(self, key) for key in ("first_chunk", "stride", "interval", "working_window")
                if getattr(self, key) > 0}
        if self.max_refill >= 0:
            mine["max_refill"] = self.max_refill
        return mine

    def settings(self, model) -> dict[str, int]:
        """The effective settings: this row's options over the export's over the paper's."""
        from ...modeling.geometry import export_geometry

        return export_geometry(model.config).with_overrides(self.overrides()).inference_dict()

    def prepare(self, model, tokenizer, example: PreparedExample) -> Any:
        from ...infer import AcreEngine
        from ...modeling import is_acre_model
        from ...infer.settings import inference_settings, pick_selection

        if not is_acre_model(model):
            raise ValueError(f"method {self.name!r} needs an ACRE model (an 'acre-train export' folder)")
        cache_settings, refill = inference_settings(model.config, self.overrides() | {"selection": self.selection or None})
        neighbors, grow = pick_selection({"neighbors": refill.neighbors, "grow": refill.grow},
                                         bool(self.neighbors) if self.neighbors >= 0 else None,
                                         self.grow if self.grow >= 0 else None)
        refill = refill.replace(scorer=self.scorer_settings(refill.scorer), neighbors=neighbors, grow=grow,
                                grow_shape=self.grow_shape or refill.grow_shape,
                                positions=self.positions or refill.positions)
        if self._sets_selection():  # the row's own selection holds at every length (no stored length bands)
            refill = refill.replace(bands=None)
        engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill, close_tail=bool(self.close_tail))
        ids = [*example.prefix_ids, *(t for doc in example.doc_ids for t in doc)]
        return engine, engine.build(ids, progress=False)

    def answer(self, model, tokenizer, example: PreparedExample, state: Any,
               generation: GenerationConfig) -> MethodResult:
        engine, cache = state
        # Exactly the harness's stop set, as for every other row (the engine would add its own EOS ids).
        ans = engine.answer(cache, list(example.suffix_ids), max_new_tokens=generation.max_new_tokens,
                            stop_token_ids=tuple(sorted(generation.stop_ids)), stop_at_eos=False)
        settings = engine.settings_for(cache)  # the length band's selection, where the export stores bands
        open_chunk = ans.open_chunk  # raw tail + question + their L1 tokens (the question alone: closed tail)
        if (engine.close_tail or settings.close_tail) and cache.tail_keys is not None:
            open_chunk += int(cache.tail_keys.shape[2])
        t = ans.timings
        cost = CostRecord(
            tokens_prefilled=len(example) + cache.num_l1,
            token_layers_computed=(len(example) + cache.num_l1 + open_chunk) * model.config.num_hidden_layers,
            kv_attended=float(ans.cache_length + open_chunk),
            ttft_s=t.get("score_s", 0.0) + t.get("refill_s", 0.0) + t.get("prefill_s", 0.0),
        )
        extra = {"acre_k": ans.k, "acre_num_l1": ans.num_l1, "acre_selected": ans.selected,
                 "acre_scorer": settings.describe_selection(),
                 **refill_recall(tokenizer, example, cache, ans.refilled, ans.scores)}
        return MethodResult(prediction=decode_text(tokenizer, ans.token_ids, generation.stop_ids),
                            output_ids=list(ans.token_ids), cost=cost, first_logits=ans.first_logits, extra=extra)


def evidence_token_ranges(tokenizer, example: PreparedExample,
                          gold: list[tuple[int, int] | None] | None = None) -> list[tuple[int, int]]:
    """Token ranges (prompt coordinates) of the evidence the question needs: the needles whose text
    holds a gold answer (context tasks), or in each gold document the sentence that holds the first
    occurrence of an answer (document tasks such as SQuAD; the whole gold document when no answer
    string occurs in it). ``gold``: :func:`gold_token_ranges`, when the caller has it already."""
    ex = example.example
    base = len(example.prefix_ids)
    if ex.documents is not None:
        out, pos = [], base
        for i, d in enumerate(example.doc_ids):
            if i in (example.gold_docs or []):
                out.extend(_answer_sentence_tokens(tokenizer, document_text(i, ex.documents[i]), ex.answers, pos, len(d)))
            pos += len(d)
        return out
    holding = [any(ans in ex.context[a:b] for ans in ex.answers) for a, b in (ex.gold_spans or [])]
    if not any(holding):
        return []
    gold = gold_token_ranges(tokenizer, example) if gold is None else gold
    return [r for r, keep in zip(gold, holding) if keep and r is not None]


def gold_token_ranges(tokenizer, example: PreparedExample) -> list[tuple[int, int] | None]:
    """Token ranges (prompt coordinates) of every gold span of a context task, in ``gold_spans`` order: the
    evidence and the spans that only look like it (a multikey context's other needles). None where a span
    covers no token; [] for document tasks and contexts without gold spans."""
    ex = example.example
    if ex.documents is not None or not ex.gold_spans:
        return []
    base = len(example.prefix_ids)
    offsets = tokenizer(ex.context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    out: list[tuple[int, int] | None] = []
    for span in ex.gold_spans:
        hit = _token_span(offsets, [span])
        out.append((base + hit[0][0], base + hit[0][1]) if hit else None)
    return out


def answer_sentence(text: str, answers: list[str]) -> tuple[int, int] | None:
    """Character range of the sentence of ``text`` holding the earliest answer occurrence (None: none).

    >>> answer_sentence("Paris is big. It is in France. Yes.", ["France"])
    (14, 30)
    """
    found = [(text.find(a), a) for a in answers if a and text.find(a) >= 0]
    if not found:
        return None
    at, answer = min(found)
    start = max(text.rfind(". ", 0, at) + 2 if text.rfind(". ", 0, at) >= 0 else 0, text.rfind("\n", 0, at) + 1)
    ends = [e for e in (text.find(". ", at + len(answer)), text.find("\n", at + len(answer))) if e >= 0]
    end = min(ends) + 1 if ends else len(text)
    return start, end


def _token_span(offsets, spans) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        hit = [i for i, (s, e) in enumerate(offsets) if s < b and e > a]
        if hit:
            out.append((hit[0], hit[-1] + 1))
    return out


def _answer_sentence_tokens(tokenizer, text: str, answers: list[str], pos: int, length: int) -> list[tuple[int, int]]:
    sentence = answer_sentence(text, answers) if tokenizer is not None else None
    if sentence is None:
        return [(pos, pos + length)]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) != length:  # tokenized otherwise than the prompt piece: fall back to the document
        return [(pos, pos + length)]
    return [(pos + a, pos + b) for a, b in _token_span(enc["offset_mapping"], [sentence])]


def refill_recall(tokenizer, example: PreparedExample, cache, selected, scores=None) -> dict[str, Any]:
    """Did refilling bring the evidence back? See :func:`evidence_visibility`.

    Context tasks with gold spans also get ``refill_visible_gold``: the indices (``gold_spans`` order) of
    the gold spans visible whole, the evidence and its look-alikes (a multikey context's other needles),
    so that a wrong answer can be traced to a look-alike the refill brought back, or not."""
    gold = gold_token_ranges(tokenizer, example)
    seen = visible_tokens(cache, selected)
    out = evidence_visibility(evidence_token_ranges(tokenizer, example, gold), cache, selected, scores, seen=seen)
    if gold and out["refill_recall"] is not None:
        out["refill_visible_gold"] = [i for i, r in enumerate(gold) if r is not None and bool(seen[r[0]:r[1]].all())]
    return out


def visible_tokens(cache, selected) -> torch.Tensor:
    """``[num_context_tokens]`` bool: the context tokens a question sees after refilling ``selected`` (span
    indices, or a refilled-token mask as ``Answer.refilled``); pending raw tokens and the tail always."""
    from ...modeling.span_choice import span_tokens

    tokens = selected if isinstance(selected, torch.Tensor) and selected.dtype == torch.bool else \
        span_tokens(cache.span_bounds, list(selected))
    seen = torch.ones(cache.num_context_tokens, dtype=torch.bool)
    seen[: len(tokens)] = tokens
    return seen


def evidence_visibility(evidence: list[tuple[int, int]], cache, selected, scores=None,
                        seen: torch.Tensor | None = None) -> dict[str, Any]:
    """How much of the ``evidence`` (token ranges of the context) a question saw after refilling.

    ``selected``: the refilled spans (L1 entry indices), or the refilled tokens (``[N_closed]`` bool, as
    ``Answer.refilled``).

    ``refill_recall``: share of evidence ranges that overlap a refilled span or the raw tail (which the
    question always sees); ``refill_coverage``: share of evidence *tokens* so visible;
    ``refill_visible_share``: share of the context visible (what a random choice of the same number
    of spans would reach on average); ``refill_rank``: where the best-scored span holding evidence
    ranked among all spans (1 = first; None without scores or when no finished span holds evidence).
    ``seen``: :func:`visible_tokens` of ``selected``, when the caller has it already.
    """
    if not evidence:
        return {"refill_recall": None, "refill_coverage": None, "refill_visible_share": None, "refill_rank": None}
    bounds = cache.span_bounds.tolist()
    n_ctx = cache.num_context_tokens
    seen = visible_tokens(cache, selected) if seen is None else seen
    hits = sum(bool(seen[a:b].any()) for a, b in evidence)
    tokens = sum(b - a for a, b in evidence)
    coverage = sum(int(seen[a:b].sum()) for a, b in evidence) / max(1, tokens)
    share = float(seen.sum()) / max(1, n_ctx)
    rank = None
    if scores is not None:
        holding = [j for j in range(len(bounds) - 1) if any(a < bounds[j + 1] and b > bounds[j] for a, b in evidence)]
        if holding:
            order = torch.argsort(scores.float(), descending=True).tolist()
            rank = 1 + min(order.index(j) for j in holding)
    return {"refill_recall": hits / len(evidence), "refill_coverage": coverage, "refill_visible_share": share,
            "refill_rank": rank}


@dataclass
class AcreL1(Acre):
    """ACRE without refilling: the question reads the L1 cache and the raw tail only."""

    name: ClassVar[str] = "acre-l1"
    max_refill: int = 0
