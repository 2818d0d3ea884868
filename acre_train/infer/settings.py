"""Inference settings: how a context is chunked (cache-defining) and how a question refills (per question)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from ..modeling.geometry import WindowGeometry, export_geometry, inference_section
from ..modeling.scorers import ScorerSettings

# The paper's geometry (modeling/geometry.py): W0 = 4096, S = 2048, l = 16, W = 32K, eta = 4096.
_PAPER = WindowGeometry()
DEFAULT_FIRST_CHUNK = _PAPER.first_chunk
DEFAULT_STRIDE = _PAPER.stride
DEFAULT_INTERVAL = _PAPER.interval
DEFAULT_WORKING_WINDOW = _PAPER.working_window
DEFAULT_MAX_REFILL = _PAPER.max_refill


@dataclass(frozen=True)
class CacheSettings:
    """What a built cache depends on (besides the model): part of the cache fingerprint."""

    first_chunk: int = DEFAULT_FIRST_CHUNK
    stride: int = DEFAULT_STRIDE
    interval: int = DEFAULT_INTERVAL

    def __post_init__(self) -> None:
        for f in fields(self):
            if int(getattr(self, f.name)) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class RefillSettings:
    """Per-question settings: working window ``W``, max refill length ``eta``, the scorer, decoding.

    ``scorer``: how spans are ranked (:class:`ScorerSettings`, or its spec string such as
    ``"l2:layers=3,heads=max,sinks=4"``; default: the paper's L1-key scorer at the last layer).
    ``neighbors``: each chosen span brings its better-scored neighbour, within the same ``k``.
    ``grow``: refill tokens, not whole spans, within the same ``k * l`` tokens: the ``grow`` best
    windows of ``l`` tokens seed the refill and grow toward their most-attended neighbouring tokens
    (``modeling/scorers.py:grow_tokens``; needs the ``l2`` scorer). 0: whole spans.
    ``grow_shape``: ``attention`` (grow toward the most-attended neighbouring token), ``centered``
    (each seed brings ``k * l / grow`` tokens centred on it) or ``densest`` (``grow`` disjoint windows of
    ``k * l / grow`` tokens holding the most mass) or ``sentences`` (those windows moved onto whole
    sentences; needs a cache built with the tokenizer).
    ``positions``: ``compact`` rotates the refilled cache at ``0..P-1`` (DESIGN.md §5); ``text`` at each
    token's index in the whole context, so refilled spans keep their distances in the text (the context
    must then fit the base's native window; ``infer/refill.py:POSITIONS``).
    """

    working_window: int = DEFAULT_WORKING_WINDOW
    max_refill: int = DEFAULT_MAX_REFILL
    scorer: ScorerSettings = field(default_factory=ScorerSettings)
    neighbors: bool = False
    grow: int = 0
    grow_shape: str = "attention"
    positions: str = "compact"
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())  # extra stop tokens
    stop_at_eos: bool = True  # stop at the model's/tokenizer's EOS and end-of-turn tokens

    def __post_init__(self) -> None:
        if self.working_window < 1 or self.max_refill < 0:
            raise ValueError("working_window must be >= 1 and max_refill >= 0")
        object.__setattr__(self, "scorer", ScorerSettings.parse(self.scorer))
        check_selection(self.scorer, self.neighbors, self.grow, self.grow_shape)
        from .refill import POSITIONS

        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")

    def describe_selection(self) -> str:
        """The scorer and the selection rule, as tables and logs print them: ``l2:layers=3 +grow=2``."""
        return (self.scorer.describe() + selection_suffix(self.neighbors, self.grow, self.grow_shape)
                + ("" if self.positions == "compact" else f" @{self.positions}"))

    def replace(self, **changes: Any) -> "RefillSettings":
        return RefillSettings(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


# What an export's ``acre.inference`` stores about the refill besides the geometry (``calibrate`` writes them).
SELECTION_KEYS = ("scorer", "neighbors", "grow", "grow_shape", "positions")


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
    from ..modeling.scorers import GROW_SHAPES

    if grow_shape not in GROW_SHAPES:
        raise ValueError(f"grow_shape must be one of {', '.join(GROW_SHAPES)}, got {grow_shape!r}")
    if grow < 0:
        raise ValueError(f"grow must be >= 0 (0: whole spans), got {grow}")
    if grow and neighbors:
        raise ValueError("choose neighbors (whole spans) or grow (tokens), not both")
    if grow and scorer.kind != "l2":
        raise ValueError(f"grow refills tokens by the l2 scorer's per-token mass; the scorer {scorer.describe()} "
                         "ranks whole spans (use an l2 scorer, or grow=0)")


def inference_settings(config: Mapping[str, Any] | Any, overrides: Mapping[str, Any] | None = None
                       ) -> tuple[CacheSettings, RefillSettings]:
    """The engine's settings: the export's stored geometry, then ``overrides`` (None = keep).

    ``config``: an export's ``config.json`` as a dict, or a loaded model's config. Overrides may also
    carry decoding keys (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``), ``scorer`` (a spec
    string or mapping), ``scoring_layers`` (replaces the scorer's layers), ``neighbors``, ``grow``, ``grow_shape`` and ``positions``. The
    export's ``inference.scorer`` / ``neighbors`` / ``grow`` / ``grow_shape`` (written by ``acre-train
    calibrate``) come first.

    >>> cache, refill = inference_settings({"acre": {"inference": {"first_chunk": 64, "interval": 8}}}, {"max_refill": 0})
    >>> cache.first_chunk, cache.interval, refill.max_refill
    (64, 8, 0)
    """
    from dataclasses import replace as replace_

    from ..modeling.scorers import ScorerSettings

    overrides = overrides or {}
    geometry = export_geometry(config).with_overrides(overrides)
    cache = CacheSettings(first_chunk=geometry.first_chunk, stride=geometry.stride, interval=geometry.interval)
    extra = {k: v for k, v in overrides.items()
             if k in ("max_new_tokens", "temperature", "top_p", "seed") and v is not None}
    stored = inference_section(config)
    scorer = ScorerSettings.parse(overrides.get("scorer") or stored.get("scorer") or ScorerSettings())
    if overrides.get("scoring_layers") is not None:
        scorer = replace_(scorer, layers=tuple(int(x) for x in overrides["scoring_layers"]))
    neighbors, grow = pick_selection(stored, overrides.get("neighbors"), overrides.get("grow"))
    grow_shape = overrides.get("grow_shape") or stored.get("grow_shape") or "attention"
    positions = overrides.get("positions") or stored.get("positions") or "compact"
    return cache, RefillSettings(working_window=geometry.working_window, max_refill=geometry.max_refill,
                                 scorer=scorer, neighbors=neighbors, grow=grow, grow_shape=grow_shape,
                                 positions=positions, **extra)
