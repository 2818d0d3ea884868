"""The refill scorer's spec: which kind ranks the spans of a bi-layer cache, at which layers, pooled how
(``refill.scorer``), and the registry of kinds.

The scoring is split by job: this spec and the kinds' registry (here), the kernels that turn queries
and keys into scores (``modeling/scoring.py``), the rules that turn scores into refilled spans or
tokens (``modeling/span_choice.py``), and ranking on a cache with the concrete kinds
(``modeling/ranking.py``).

Three scorers, one score per L1 entry (per span), higher = refill first:

* ``l1`` (the paper's): the question's attention over the **L1 keys** (softmax over the ``m``
  entries), at the queries' memory positions.
* ``l2``: the question's attention over the **raw keys** of the context (softmax over every L2
  token, the query placed after the context and each key at its text position), summed per span.
  It reads one layer's L2 keys per scoring layer (CPU memory; on a GPU node they are gathered to
  the device per question: ``layers × N2 × H_kv × D`` elements).
* ``bounds`` (Quest-style): per span, per KV head and channel, the min and max of the raw keys
  rotated at their text positions; the span's logit is the upper bound ``Σ_c max(q_c·min_c,
  q_c·max_c) / sqrt(D)`` and the softmax runs over spans. Two vectors per span per layer, built
  once per cache (and saved in it); nothing else is read per question.

Each scorer pools the query heads (``heads: mean | max``), averages over the question's tokens and
then over the scoring layers. Raw-key attention is pulled to *attention sinks*, the first tokens of
the context and of every chunk; ``sinks: N`` leaves the first ``N`` tokens of each out of the
ranking (out of the softmax for ``l2``, out of the box for ``bounds``), and ``keep_sinks`` refills
the spans holding them anyway (they then count against ``k``). ``keep_sinks=tokens`` (token-granular
refill only) keeps the context's first span whole, where the prompt's instruction lies, but only the
sink tokens themselves of every later chunk: a chunk's first tokens matter as sinks, not as text, and
whole spans spend much of a small budget on them (at 2K, three spans of a 6-span budget). The
tokens after the first few still draw mass, so calibrate it with ``sinks`` (docs/real-base.md).
``spans`` and ``tokens`` cost budget with every chunk: with ``S = 512`` a 15K context has ~30 chunks,
and their sink spans alone spend a 12-span budget before the question places anything.
``keep_sinks=first`` keeps only the context's first span (the prompt's start, the global sink): one
span at every length, so the rest of the budget always goes where the question points.
``unscored: N`` (``l2`` only) is the gentler rule for them: the first ``N`` tokens of the context and
of every chunk stay in the softmax, as they are in the model's own attention, but the mass they draw
counts for no span or region, so they never place a refill (they are still refilled when a chosen
region covers them). A chunk's first tokens were encoded with almost no local context and draw mass
whatever is asked; taking them out of the softmax instead (``sinks``) renormalises the heads that
park nearly all their mass there, and with ``heads=max`` those heads' leftovers can then decide the
ranking (measured in docs/real-base.md). Since no
region is ever placed on them, ``unscored`` needs ``sinks`` and ``keep_sinks``: a refill without the
context's first tokens (the attention sinks, the prompt's start) answers almost nothing even when the
evidence is back.

``query=question`` pools over the question's own words only. By default (``all``) every token
after the context counts: the template's lead-in ("Answer the question using the context above"),
the end of turn and the generation prompt too. Those tokens are the same for every question and
attend mostly to the context's last sentences, so with a mean over tokens they pull a refill toward
the context's end whatever was asked (measured in docs/real-base.md). The engine
finds the question's words in the ids :class:`~acre_train.data.prompt.PromptFormat` writes.

``learned=1`` ranks with the export's learned scorer (``modeling/learned_scorer.py``, trained with
``train.refill_loss.params: scorer``): the question's queries pass through its low-rank map before
any of the three scorers; nothing else changes, decoding never sees it.

Every score is computed in fp32 whatever the model dtype. The tests keep a per-token, per-head
loop as the reference for each scorer.

>>> ScorerSettings.parse("l2:layers=7+9,heads=max,sinks=4").describe()
'l2:layers=7+9,heads=max,sinks=4'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, Sequence

import torch

from ..errors import key_hint
from .selection_words import KEEP_SINKS, POOLS, QUERIES

if TYPE_CHECKING:
    from .ranking import QuestionQueries


@dataclass(frozen=True)
class ScorerSettings:
    """Which scorer ranks the spans, at which layers, pooled how (see the module docstring)."""

    kind: str = "l1"
    layers: tuple[int, ...] = (-1,)
    heads: str = "mean"
    sinks: int = 0
    keep_sinks: str = ""  # "": off; "spans": the spans holding the sinks; "tokens": see the module docstring
    learned: bool = False  # rank with the learned query map (modeling/learned_scorer.py) of the export
    query: str = "all"  # "all": every token after the context; "question": the question's own words
    unscored: int = 0  # l2: the first N tokens of the context and of every chunk win no refill (see the docstring)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "keep_sinks", _keep(self.keep_sinks))
        if self.kind not in scorer_kinds():
            raise ValueError(f"unknown scorer {self.kind!r}; choose one of {', '.join(scorer_kinds())}")
        if self.heads not in POOLS:
            raise ValueError(f"scorer heads must be one of {', '.join(POOLS)}, got {self.heads!r}")
        if not self.layers:
            raise ValueError("a scorer needs at least one layer")
        if self.sinks < 0:
            raise ValueError(f"scorer sinks must be >= 0, got {self.sinks}")
        if self.query not in QUERIES:
            raise ValueError(f"scorer query must be one of {', '.join(QUERIES)}, got {self.query!r}")
        if not self.spec.reads_raw_keys and (self.sinks or self.keep_sinks):
            raise ValueError(f"sinks/keep_sinks apply to the raw-key scorers, not to {self.kind}")
        if self.unscored < 0:
            raise ValueError(f"scorer unscored must be >= 0, got {self.unscored}")
        if self.unscored and not self.spec.ranks_tokens:
            raise ValueError(f"unscored applies to the l2 scorer's per-token mass (a kind that ranks tokens), "
                             f"not to {self.kind}")
        if self.unscored and not (self.keep_sinks and self.sinks):
            # Without the sinks no grown region ever covers the context's first tokens, and answers collapse
            # even where the evidence came back (docs/real-base/record.md, "unscored").
            raise ValueError("unscored=N stops the context's first tokens from placing a refill, so the attention "
                             "sinks decoding needs would never come back: add sinks=N and keep_sinks=tokens (or 1)")

    @property
    def spec(self) -> "ScorerKind":
        """What this scorer's kind computes and reads (:data:`SCORER_KINDS`)."""
        return scorer_kinds()[self.kind]

    # ------------------------------------------------------------------------------ spellings

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ScorerSettings":
        """From an export's ``inference.scorer`` section (unknown keys fail with a suggestion)."""
        known = [f.name for f in fields(cls)]
        picked = {}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown scorer setting {key!r}{key_hint(key, known)}")
            picked[key] = value
        if "layers" in picked:
            picked["layers"] = _layers(picked["layers"])
        if "learned" in picked:
            picked["learned"] = _flag(picked["learned"])
        for key in ("sinks", "unscored"):
            if key in picked:
                picked[key] = int(picked[key])
        return cls(**picked)

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any] | "ScorerSettings") -> "ScorerSettings":
        """``"l2:layers=7+9,heads=max,sinks=4"`` (kind, then comma-separated options) -> settings."""
        if isinstance(spec, ScorerSettings):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_mapping(spec)
        kind, _, rest = str(spec).strip().partition(":")
        values: dict[str, Any] = {"kind": kind.strip()}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"scorer option {part!r} is not key=value (in {spec!r})")
            values[key.strip()] = value.strip()
        return cls.from_mapping(values)

    def describe(self) -> str:
        """The spec string ``parse`` reads back (defaults left out)."""
        opts = [f"layers={'+'.join(str(x) for x in self.layers)}"]
        if self.heads != "mean":
            opts.append(f"heads={self.heads}")
        if self.sinks:
            opts.append(f"sinks={self.sinks}")
        if self.keep_sinks:
            opts.append("keep_sinks=" + ("1" if self.keep_sinks == "spans" else self.keep_sinks))
        if self.unscored:
            opts.append(f"unscored={self.unscored}")
        if self.learned:
            opts.append("learned=1")
        if self.query != "all":
            opts.append(f"query={self.query}")
        return f"{self.kind}:{','.join(opts)}"

    def resolved_layers(self, num_layers: int) -> list[int]:
        """The scoring layers as indices ``0..L-1`` (sorted, unique); out of range is an error."""
        if any(not -num_layers <= x < num_layers for x in self.layers):
            raise ValueError(f"scoring layers {self.layers} out of range for a {num_layers}-layer model")
        return sorted({x % num_layers for x in self.layers})


def _layers(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        return tuple(int(x) for x in value.replace("+", " ").replace(",", " ").split())
    if isinstance(value, int):
        return (value,)
    return tuple(int(x) for x in value)


def _keep(value: Any) -> str:
    """``keep_sinks``: yes/no (yes = ``spans``, the old boolean) or ``spans`` / ``tokens`` / ``first``."""
    if isinstance(value, str) and value.strip().lower() in KEEP_SINKS:
        return value.strip().lower()
    if value == "":
        return ""
    try:
        return "spans" if _flag(value) else ""
    except ValueError:
        raise ValueError(f"keep_sinks must be yes/no, spans, tokens or first, got {value!r}") from None


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a yes/no value, got {value!r}")
    return bool(value)


# ------------------------------------------------------------------------------ the scorer kinds

class ScoringCache(Protocol):
    """What a scorer may read from a cache (``modeling/bilayer.py:BiLayerCache`` is one)."""

    span_bounds: torch.Tensor  # [m + 1] token offsets of the spans
    l1_keys_rot: Sequence[torch.Tensor]  # per layer [H_kv, m, D], rotated at their memory positions
    num_l1: int
    sentence_ends: torch.Tensor | None

    def sink_tokens(self, sinks: int) -> torch.Tensor: ...  # [N] bool: the first tokens of the context and chunks

    def l2_keys_rotated(self, model, layer: int) -> torch.Tensor: ...  # [H_kv, N, D] at text positions

    def key_box(self, model, layer: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # per span min, max


class ScorerKind:
    """One kind of scorer (``ScorerSettings.kind``). A new one is a subclass with a ``name`` and
    :meth:`rank` (inference, over a cache) and :meth:`score` (training, over the captured keys), and one
    ``@scorer_kind`` line; the reference it must equal goes in ``tests/test_infer_scorers.py``.

    ``frame``: where the question's queries are rotated for it (``memory``: after the L1 entries, for L1
    keys; ``text``: after the whole context, for raw keys). ``reads_raw_keys``: its score reads the raw
    (L2) keys, so attention sinks (``sinks``, ``keep_sinks``) apply. ``ranks_tokens``: it has a per-token
    mass (:func:`question_mass`), so it can refill grown token regions and leave tokens ``unscored``.
    """

    name: ClassVar[str] = ""
    frame: ClassVar[str] = "text"
    reads_raw_keys: ClassVar[bool] = True
    ranks_tokens: ClassVar[bool] = False

    def rank(self, model, cache: ScoringCache, queries: QuestionQueries, scorer: ScorerSettings,
             layers: list[int], qmap) -> torch.Tensor:
        """One score per span of ``cache`` (``[m]``)."""
        raise NotImplementedError

    def score(self, queries: list[torch.Tensor], keys: list[torch.Tensor], bounds: torch.Tensor, heads: str,
              ignore: torch.Tensor | None) -> torch.Tensor:
        """Training's score per span (``train/refill_loss.py``): ``queries``/``keys`` per layer in the
        kind's frame (L1 keys for ``memory``, the context's raw keys for ``text``, ``bounds`` their spans)."""
        raise NotImplementedError

    def prepare_cache(self, model, cache: ScoringCache, scorer: ScorerSettings) -> None:
        """What the cache keeps for this scorer, made once at build time (and saved with it)."""

    def _text_queries(self, model, queries: QuestionQueries, layers: list[int], qmap) -> list[torch.Tensor]:
        return [queries.learned(model, qmap, x, "text") if qmap else queries.at_text(model, x) for x in layers]


SCORER_KINDS: dict[str, ScorerKind] = {}


def scorer_kind(cls: type[ScorerKind]) -> type[ScorerKind]:
    """Register a :class:`ScorerKind` under its ``name``."""
    SCORER_KINDS[cls.name] = cls()
    return cls


def scorer_kinds() -> dict[str, ScorerKind]:
    """Every registered kind. The package's own (``l1``, ``l2``, ``bounds``, in ``modeling/ranking.py``)
    register when ``acre_train.modeling`` is imported, which any import of this module does first."""
    return SCORER_KINDS
