"""The refill selection as one typed value: what a question refills, and how it is spelled everywhere.

A :class:`Selection` is the scorer (``modeling/scorer_spec.py:ScorerSettings``) plus the rule that turns
its scores into refilled tokens: whole spans (optionally each with its better neighbour) or ``grow``
token regions of a ``grow_shape``; where the refilled cache is rotated (``positions``); whether the
context's raw tail is closed at build time (``close_tail``), whether the refilled tokens then go
after it, next to the question (``refill_after_tail``), and whether the question's layers up to the
last scoring layer are taken from its scoring pass instead of run again (``reuse_score_pass``); and optionally the refill's length
``max_refill`` (η) where it differs from the export's geometry.

One spelling, which :meth:`Selection.describe` writes and :meth:`Selection.parse` reads back::

    l2:layers=3,heads=max,sinks=4,keep_sinks=first +grow=2,densest @text eta=512 close_tail

the scorer spec, then ``+neighbors`` or ``+grow=N[,shape]``, ``@text`` for text positions, ``eta=N``,
``close_tail``, ``refill_after_tail`` and ``reuse_score_pass`` — each optional, in any order after the scorer.

:class:`LengthBands` holds one selection per band of context lengths. A setting calibrated at one
length can fail at another (a rule whose cost grows with the number of chunks, a budget sized for a
short context), so an export may store a choice per band and the engine picks by the length of the
context it answers from (``acre.inference.bands``, written by ``acre-train calibrate``).

>>> Selection.parse("l2:layers=3,heads=max +grow=2,densest @text").describe()
'l2:layers=3,heads=max +grow=2,densest @text'
>>> LengthBands.parse(["4096: l2:layers=3 +grow=1", "l2:layers=3 +grow=3,densest"]).pick(10000).grow
3
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from ..errors import key_hint
from .scorer_spec import ScorerSettings
from .selection_words import GROW_SHAPES, POSITIONS

SELECTION_KEYS = ("scorer", "neighbors", "grow", "grow_shape", "positions", "close_tail", "refill_after_tail",
                  "reuse_score_pass", "max_refill")
# How the question's path runs around its refill (the raw tail, where the refill goes, what is run twice):
# cost choices that hold in every length band.
PATH_KEYS = ("close_tail", "refill_after_tail", "reuse_score_pass")


@dataclass(frozen=True)
class Selection:
    """What a question refills (see the module docstring)."""

    scorer: ScorerSettings = field(default_factory=ScorerSettings)
    neighbors: bool = False
    grow: int = 0  # 0: whole spans; N: token regions from N seeds (l2 scorers only)
    grow_shape: str = "attention"
    positions: str = "compact"
    close_tail: bool = False
    refill_after_tail: bool = False  # with close_tail: the refilled tokens after the closed tail, not before it
    # with close_tail: the question's layers up to the last scoring layer come from its scoring pass, so
    # they do not see what is refilled (the refill enters above them) and are not run a second time
    reuse_score_pass: bool = False
    max_refill: int | None = None  # eta; None: the export's geometry

    def __post_init__(self) -> None:
        object.__setattr__(self, "scorer", ScorerSettings.parse(self.scorer))
        object.__setattr__(self, "grow", int(self.grow))
        if self.grow_shape not in GROW_SHAPES:
            raise ValueError(f"grow_shape must be one of {', '.join(GROW_SHAPES)}, got {self.grow_shape!r}")
        if self.grow < 0:
            raise ValueError(f"grow must be >= 0 (0: whole spans), got {self.grow}")
        if self.grow and self.neighbors:
            raise ValueError("choose neighbors (whole spans) or grow (tokens), not both")
        if self.grow and not self.scorer.spec.ranks_tokens:
            raise ValueError(f"grow refills tokens by the l2 scorer's per-token mass; the scorer "
                             f"{self.scorer.describe()} ranks whole spans (use an l2 scorer, or grow=0)")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.refill_after_tail and not self.close_tail:
            raise ValueError("refill_after_tail places the refill after a closed tail: it needs close_tail")
        if self.refill_after_tail and self.positions != "compact":
            raise ValueError("refill_after_tail moves the refilled tokens out of text order: it needs @compact "
                             "positions")
        if self.reuse_score_pass and not self.close_tail:
            raise ValueError("reuse_score_pass reuses a pass over the closed tail's KV: it needs close_tail")
        if self.max_refill is not None and int(self.max_refill) < 0:
            raise ValueError(f"max_refill (eta) must be >= 0, got {self.max_refill}")

    # ------------------------------------------------------------------------------ spellings

    def describe(self) -> str:
        """The one-line spelling :meth:`parse` reads back (defaults left out)."""
        out = self.scorer.describe()
        if self.neighbors:
            out += " +neighbors"
        elif self.grow:
            out += f" +grow={self.grow}" + ("" if self.grow_shape == "attention" else f",{self.grow_shape}")
        if self.positions != "compact":
            out += f" @{self.positions}"
        if self.max_refill is not None:
            out += f" eta={self.max_refill}"
        if self.close_tail:
            out += " close_tail"
        if self.refill_after_tail:
            out += " refill_after_tail"
        if self.reuse_score_pass:
            out += " reuse_score_pass"
        return out

    @classmethod
    def parse(cls, spec: "str | Mapping[str, Any] | Selection") -> "Selection":
        """From :meth:`describe`'s spelling, a mapping (:meth:`from_mapping`) or a selection."""
        if isinstance(spec, Selection):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_mapping(spec)
        words = str(spec).split()
        if not words:
            raise ValueError("an empty selection; start with a scorer, e.g. 'l2:layers=3,heads=max +grow=2'")
        values: dict[str, Any] = {"scorer": ScorerSettings.parse(words[0])}
        for word in words[1:]:
            if word == "+neighbors":
                values["neighbors"] = True
            elif m := re.fullmatch(r"\+grow=(\d+)(?:,(\w+))?", word):
                values["grow"] = int(m.group(1))
                values["grow_shape"] = m.group(2) or "attention"
            elif word.startswith("@"):
                values["positions"] = word[1:]
            elif m := re.fullmatch(r"eta=(\d+)", word):
                values["max_refill"] = int(m.group(1))
            elif word in PATH_KEYS:
                values[word] = True
            else:
                raise ValueError(f"selection word {word!r} is not +neighbors, +grow=N[,shape], @positions, eta=N, "
                                 f"{', '.join(PATH_KEYS)} (in {spec!r})")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """What an export's ``acre.inference`` stores (``max_refill`` only where set)."""
        out = {"scorer": self.scorer.describe(), "neighbors": self.neighbors, "grow": self.grow,
               "grow_shape": self.grow_shape, "positions": self.positions,
               **{key: getattr(self, key) for key in PATH_KEYS}}
        if self.max_refill is not None:
            out["max_refill"] = self.max_refill
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, ignore: Iterable[str] = ()) -> "Selection":
        """From stored keys (:data:`SELECTION_KEYS`; others fail with a suggestion unless in ``ignore``)."""
        picked: dict[str, Any] = {}
        for key, value in values.items():
            if key in ignore or value is None:
                continue
            if key not in SELECTION_KEYS:
                raise ValueError(f"unknown selection key {key!r}{key_hint(key, SELECTION_KEYS)}")
            picked[key] = value
        for key in ("neighbors", *PATH_KEYS):
            if key in picked:
                picked[key] = _flag(picked[key])
        if picked.get("neighbors") and picked.get("grow"):
            raise ValueError("choose neighbors (whole spans) or grow (tokens), not both")
        return cls(**picked)

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Selection":
        """The given keys (None = keep) over this selection. ``neighbors`` and ``grow`` exclude each other,
        so asking for one switches the stored other off.

        >>> s = Selection.parse("l2:layers=3 +grow=2")
        >>> s.with_overrides({"neighbors": True}).describe(), s.with_overrides({"grow": None}).grow
        ('l2:layers=3 +neighbors', 2)
        """
        changes = {k: v for k, v in overrides.items() if k in SELECTION_KEYS and v is not None}
        if "scorer" in changes:
            changes["scorer"] = ScorerSettings.parse(changes["scorer"])
        if changes.get("neighbors") and "grow" not in changes:
            changes["grow"] = 0
        if changes.get("grow") and "neighbors" not in changes:
            changes["neighbors"] = False
        return replace(self, **changes)


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"expected yes/no, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class LengthBands:
    """One selection per band of context lengths: ``bands[i] = (up_to, selection)`` in increasing
    ``up_to`` (context tokens, inclusive); the last band's ``up_to`` is None (every longer context)."""

    bands: tuple[tuple[int | None, Selection], ...]

    def __post_init__(self) -> None:
        if not self.bands:
            raise ValueError("length bands need at least one selection")
        limits = [up for up, _ in self.bands]
        if limits[-1] is not None or any(up is None for up in limits[:-1]):
            raise ValueError("only the last length band is open-ended (up_to: null); every other names its "
                             "longest context in tokens")
        if any(a >= b for a, b in zip(limits[:-2], limits[1:-1])):
            raise ValueError(f"length bands must increase, got {limits}")

    def pick(self, num_tokens: int) -> Selection:
        """The selection for a context of ``num_tokens`` tokens."""
        for up_to, selection in self.bands:
            if up_to is None or num_tokens <= up_to:
                return selection
        raise AssertionError("unreachable: the last band is open-ended")

    def describe(self) -> list[str]:
        """``["4096: l2:layers=3 +grow=1", "l2:layers=3 +grow=3,densest"]``: what :meth:`parse` reads."""
        return [(f"{up}: " if up is not None else "") + s.describe() for up, s in self.bands]

    @classmethod
    def parse(cls, items: Iterable[Any]) -> "LengthBands":
        """From :meth:`describe`'s list, or mappings ``{"up_to": N | None, "selection": spec}``."""
        bands = []
        for item in items:
            if isinstance(item, Mapping):
                unknown = set(item) - {"up_to", "selection"}
                if unknown:
                    key = sorted(unknown)[0]
                    raise ValueError(f"unknown length-band key {key!r}{key_hint(key, ('up_to', 'selection'))}")
                up, spec = item.get("up_to"), item.get("selection", "")
            else:
                m = re.fullmatch(r"\s*(\d+)\s*:\s+(.*)", str(item))
                up, spec = (int(m.group(1)), m.group(2)) if m else (None, str(item))
            bands.append((None if up is None else int(up), Selection.parse(spec)))
        return cls(tuple(bands))

    @classmethod
    def single(cls, selection: Selection) -> "LengthBands":
        return cls(((None, selection),))

    def __len__(self) -> int:
        return len(self.bands)


def stored_selection(section: Mapping[str, Any]) -> tuple[Selection, LengthBands | None]:
    """An export's ``acre.inference`` section -> (its selection, its length bands or None). The section's
    own ``max_refill`` is the geometry's η, not a selection's."""
    selection = Selection.from_mapping({k: section.get(k) for k in SELECTION_KEYS if k in section and k != "max_refill"})
    bands = section.get("bands")
    return selection, (LengthBands.parse(bands) if bands else None)
