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
    """

    working_window: int = DEFAULT_WORKING_WINDOW
    max_refill: int = DEFAULT_MAX_REFILL
    scorer: ScorerSettings = field(default_factory=ScorerSettings)
    neighbors: bool = False
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
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")

    def replace(self, **changes: Any) -> "RefillSettings":
        return RefillSettings(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def inference_settings(config: Mapping[str, Any] | Any, overrides: Mapping[str, Any] | None = None
                       ) -> tuple[CacheSettings, RefillSettings]:
    """The engine's settings: the export's stored geometry, then ``overrides`` (None = keep).

    ``config``: an export's ``config.json`` as a dict, or a loaded model's config. Overrides may also
    carry decoding keys (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``), ``scorer`` (a spec
    string or mapping), ``scoring_layers`` (replaces the scorer's layers) and ``neighbors``. The export's
    ``inference.scorer`` / ``inference.neighbors`` (written by ``acre-train calibrate``) come first.

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
    neighbors = overrides.get("neighbors")
    neighbors = bool(stored.get("neighbors", False) if neighbors is None else neighbors)
    return cache, RefillSettings(working_window=geometry.working_window, max_refill=geometry.max_refill,
                                 scorer=scorer, neighbors=neighbors, **extra)
