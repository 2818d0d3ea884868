"""Inference settings: how a context is chunked (cache-defining) and how a question refills (per question)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ..modeling.bilayer import CacheSettings
from ..modeling.geometry import WindowGeometry, export_geometry, inference_section
from ..modeling.scorer_spec import ScorerSettings
from ..modeling.selection import PATH_KEYS, LengthBands, Selection, stored_selection

# The paper's geometry (modeling/geometry.py): W0 = 4096, S = 2048, l = 16, W = 32K, eta = 4096.
_PAPER = WindowGeometry()  # the defaults where an export stores none


@dataclass(frozen=True)
class RefillSettings:
    """Per-question settings: working window ``W``, max refill length ``eta``, the scorer, decoding.

    ``scorer``: how spans are ranked (:class:`ScorerSettings`, or its spec string such as
    ``"l2:layers=3,heads=max,sinks=4"``; default: the paper's L1-key scorer at the last layer).
    ``neighbors``: each chosen span brings its better-scored neighbour, within the same ``k``.
    ``grow``: refill tokens, not whole spans, within the same ``k * l`` tokens: the ``grow`` best
    windows of ``l`` tokens seed the refill and grow toward their most-attended neighbouring tokens
    (``modeling/span_choice.py:grow_tokens``; needs the ``l2`` scorer). 0: whole spans.
    ``grow_shape``: ``attention`` (grow toward the most-attended neighbouring token), ``centered``
    (each seed brings ``k * l / grow`` tokens centred on it) or ``densest`` (``grow`` disjoint windows of
    ``k * l / grow`` tokens holding the most mass) or ``sentences`` (those windows moved onto whole
    sentences; needs a cache built with the tokenizer).
    ``positions``: ``compact`` rotates the refilled cache at ``0..P-1`` (DESIGN.md §5); ``text`` at each
    token's index in the whole context, so refilled spans keep their distances in the text (the context
    must then fit the base's native window; ``modeling/selection.py:POSITIONS``).
    ``close_tail``: the prefill reuses the raw tail's KV from the build (``AcreEngine``);
    ``refill_after_tail``: the refilled tokens then sit after that tail, next to the question;
    ``reuse_score_pass``: the question's layers up to the last scoring layer come from its scoring pass.
    ``bands``: a selection per band of context lengths (``modeling/selection.py:LengthBands``); when set,
    the engine answers with the band of the cache's length (:meth:`for_length`) instead of the fields above.
    """

    working_window: int = _PAPER.working_window
    max_refill: int = _PAPER.max_refill
    scorer: ScorerSettings = field(default_factory=ScorerSettings)
    neighbors: bool = False
    grow: int = 0
    grow_shape: str = "attention"
    positions: str = "compact"
    close_tail: bool = False
    refill_after_tail: bool = False
    reuse_score_pass: bool = False
    bands: LengthBands | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())  # extra stop tokens
    stop_at_eos: bool = True  # stop at the model's/tokenizer's EOS and end-of-turn tokens

    def __post_init__(self) -> None:
        if self.working_window < 1 or self.max_refill < 0:
            raise ValueError("working_window must be >= 1 and max_refill >= 0")
        object.__setattr__(self, "scorer", self.selection.scorer)  # validates the selection as a whole
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")

    @property
    def selection(self) -> Selection:
        """The selection fields as one :class:`Selection` (``max_refill`` is the geometry's, left out)."""
        return Selection(scorer=self.scorer, neighbors=self.neighbors, grow=self.grow, grow_shape=self.grow_shape,
                         positions=self.positions, **{key: getattr(self, key) for key in PATH_KEYS})

    def with_selection(self, selection: Selection) -> "RefillSettings":
        """These settings answering with ``selection`` (its ``eta`` where it sets one)."""
        eta = self.max_refill if selection.max_refill is None else selection.max_refill
        return self.replace(scorer=selection.scorer, neighbors=selection.neighbors, grow=selection.grow,
                            grow_shape=selection.grow_shape, positions=selection.positions,
                            **{key: getattr(selection, key) for key in PATH_KEYS}, max_refill=eta)

    def for_length(self, num_tokens: int) -> "RefillSettings":
        """The settings for a context of ``num_tokens`` tokens: its length band's selection, if any."""
        if self.bands is None:
            return self
        return self.with_selection(self.bands.pick(num_tokens)).replace(bands=None)

    def describe_selection(self) -> str:
        """The scorer and the selection rule, as tables and logs print them: ``l2:layers=3 +grow=2``;
        with length bands, every band: ``<=4096: ... | ...``."""
        if self.bands is not None:
            return " | ".join(self.bands.describe())
        return (self.scorer.describe() + selection_suffix(self.neighbors, self.grow, self.grow_shape)
                + ("" if self.positions == "compact" else f" @{self.positions}"))

    def replace(self, **changes: Any) -> "RefillSettings":
        return RefillSettings(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})



def selection_suffix(neighbors: bool, grow: int, grow_shape: str = "attention") -> str:
    """How tables and logs name the selection rule after the scorer: ``" +neighbors"``, ``" +grow=2"``,
    ``" +grow=3,centered"``."""
    if neighbors:
        return " +neighbors"
    return f" +grow={grow}" + ("" if grow_shape == "attention" else f",{grow_shape}") if grow else ""


def pick_selection(stored: Mapping[str, Any], neighbors: bool | None, grow: int | None) -> tuple[bool, int]:
    """``(neighbors, grow)``: the given ones over the ``stored`` ones (None = keep). The two rules exclude
    each other, so asking for one switches the stored other off.

    >>> pick_selection({"neighbors": True}, None, 2), pick_selection({"grow": 2}, True, None)
    ((False, 2), (True, 0))
    """
    if grow is None:
        grow = 0 if neighbors else int(stored.get("grow", 0) or 0)
    if neighbors is None:
        neighbors = False if grow else bool(stored.get("neighbors", False))
    return bool(neighbors), int(grow)


def check_selection(scorer: ScorerSettings, neighbors: bool, grow: int, grow_shape: str = "attention") -> None:
    """One line for a selection that cannot be made (raised where the setting is read)."""
    Selection(scorer=scorer, neighbors=neighbors, grow=grow, grow_shape=grow_shape)


def inference_settings(config: Mapping[str, Any] | Any, overrides: Mapping[str, Any] | None = None
                       ) -> tuple[CacheSettings, RefillSettings]:
    """The engine's settings: the export's stored geometry, then ``overrides`` (None = keep).

    ``config``: an export's ``config.json`` as a dict, or a loaded model's config. Overrides may also
    carry decoding keys (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``) and the selection's
    (``modeling/selection_words.py:FLAGS``): ``selection`` (a whole :class:`Selection`, replacing the
    export's and its length bands), then ``scorer`` (a spec string or mapping), ``scoring_layers``,
    ``neighbors``, ``grow``, ``grow_shape`` and ``positions`` over it, and ``close_tail``,
    ``refill_after_tail`` and ``reuse_score_pass`` over it and every length band (None = keep).

    >>> cache, refill = inference_settings({"acre": {"inference": {"first_chunk": 64, "interval": 8}}}, {"max_refill": 0})
    >>> cache.first_chunk, cache.interval, refill.max_refill
    (64, 8, 0)
    """
    from dataclasses import replace as replace_

    overrides = overrides or {}
    geometry = export_geometry(config).with_overrides(overrides)
    cache = CacheSettings(first_chunk=geometry.first_chunk, stride=geometry.stride, interval=geometry.interval)
    extra = {k: v for k, v in overrides.items()
             if k in ("max_new_tokens", "temperature", "top_p", "seed") and v is not None}
    selection, bands = stored_selection(inference_section(config))
    if overrides.get("selection") is not None:  # a whole selection replaces the export's, bands and all
        selection, bands = Selection.parse(overrides["selection"]), None
    asked = {k: overrides.get(k) for k in ("scorer", "neighbors", "grow", "grow_shape", "positions")}
    selection = selection.with_overrides(asked)
    if overrides.get("scoring_layers") is not None:
        scorer = replace_(selection.scorer, layers=tuple(int(x) for x in overrides["scoring_layers"]))
        selection = replace_(selection, scorer=scorer)
    if any(v is not None for v in asked.values()) or overrides.get("scoring_layers") is not None:
        bands = None  # a selection asked for on the command line holds at every length
    tail = {k: bool(overrides[k]) for k in PATH_KEYS if overrides.get(k) is not None}
    if tail:  # how the question's path runs (a cost choice): it holds in every band
        selection = replace_(selection, **tail)
        if bands is not None:
            bands = LengthBands(tuple((up, replace_(s, **tail)) for up, s in bands.bands))
    refill = RefillSettings(working_window=geometry.working_window, max_refill=geometry.max_refill, **extra)
    refill = refill.with_selection(selection)  # its eta where it names one
    if overrides.get("max_refill") is not None:  # an explicit --max-refill wins over a selection's eta
        refill = refill.replace(max_refill=geometry.max_refill)
    return cache, refill.replace(bands=bands)
