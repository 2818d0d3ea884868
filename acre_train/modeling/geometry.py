"""The window geometry, one type from data preparation to inference (DESIGN.md §1-§5).

Training interleaves L1 tokens into chunks (``first_chunk`` W0, then ``stride`` S raw tokens each)
every ``l`` raw tokens, ``l`` drawn per chunk from ``intervals``; inference chunks a context the same
way with one interval and lets a question refill at most ``max_refill`` (eta) raw tokens inside a
working window of ``working_window`` (W) tokens. A data manifest records the training part, a
recipe's ``data.prepare`` sets it, an export stores the inference part under ``config.acre.inference``,
and ``infer.settings.inference_settings`` turns that (plus command-line overrides) into what the engine runs.

>>> g = WindowGeometry(first_chunk=1024, stride=512, intervals=(8, 16, 32))
>>> g.interval, g.inference_dict()["working_window"]
(16, 32768)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from ..errors import key_hint

# The official recipe: W0 = 4096, S = 2048, l from {8, ..., 128} in training and 16 at inference,
# W = 32K, eta = 4096.
PAPER_INTERVALS = (8, 16, 32, 64, 128)
INFERENCE_INTERVAL = 16
INFERENCE_KEYS = ("first_chunk", "stride", "interval", "working_window", "max_refill")


# Each geometry key's command-line flag, the paper's symbol and what it is: one spelling in every verb.
FLAGS = {
    "first_chunk": ("W0", "raw tokens in the first chunk"),
    "stride": ("S", "raw tokens in every later chunk"),
    "intervals": ("L,L,...", "L1 intervals drawn per chunk"),
    "interval": ("l", "raw tokens per L1 token"),
    "working_window": ("W", "max L1 entries + refilled tokens"),
    "max_refill": ("eta", "max refilled raw tokens"),
}


def add_geometry_flags(group, keys: tuple[str, ...], defaults: Mapping[str, Any] | None = None,
                       default_help: Mapping[str, str] | None = None) -> None:
    """``--first-chunk W0 ...`` for the given geometry keys on an argparse parser or group.

    ``defaults``: the value each flag takes when not given (missing: ``None``, i.e. the caller's source
    decides: the run, the export); ``default_help`` says in words where that default comes from.
    ``intervals`` takes comma-separated integers. The values land under the keys' own names
    (``args.first_chunk`` ...), ready for :meth:`WindowGeometry.with_overrides`.
    """
    defaults, default_help = dict(defaults or {}), dict(default_help or {})
    for key in keys:
        symbol, what = FLAGS[key]
        default = defaults.get(key)
        said = default_help.get(key) or (",".join(map(str, default)) if key == "intervals" and default else default)
        tail = f" (default: {said})" if said is not None else ""
        group.add_argument("--" + key.replace("_", "-"), type=_intervals_flag if key == "intervals" else int,
                           default=default, metavar=symbol,
                           help=f"{what if key == 'intervals' else symbol + ', ' + what}{tail}")


def _intervals_flag(text: str) -> tuple[int, ...]:
    import argparse

    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"intervals must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"intervals must be positive integers, got {text!r}")
    return values


@dataclass(frozen=True)
class WindowGeometry:
    """Chunking, L1 intervals and refill budget (paper defaults). ``interval``: the one inference uses."""

    first_chunk: int = 4096
    stride: int = 2048
    intervals: tuple[int, ...] = PAPER_INTERVALS
    working_window: int = 32768
    max_refill: int = 4096

    def __post_init__(self) -> None:
        object.__setattr__(self, "intervals", tuple(int(v) for v in self.intervals))
        if not self.intervals or min(self.intervals) < 1:
            raise ValueError(f"intervals must be one or more integers >= 1, got {list(self.intervals)}")
        for name in ("first_chunk", "stride", "working_window"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_refill < 0:
            raise ValueError(f"max_refill must be >= 0, got {self.max_refill}")

    @property
    def interval(self) -> int:
        """The inference interval: 16 when training drew it (the paper's), else the middle one."""
        if INFERENCE_INTERVAL in self.intervals:
            return INFERENCE_INTERVAL
        ordered = sorted(self.intervals)
        return ordered[len(ordered) // 2]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, ignore: tuple[str, ...] = ()) -> "WindowGeometry":
        """From a manifest / recipe / export section; ``interval`` (one) stands for ``intervals``.

        Keys named in ``ignore`` are skipped (the other settings of a section); any other unknown key
        is an error with a suggestion.
        """
        known = {f.name for f in fields(cls)} | {"interval"}
        picked: dict[str, Any] = {}
        for key, value in values.items():
            if key in ignore or value is None:
                continue
            if key not in known:
                raise ValueError(f"unknown window setting {key!r}{key_hint(key, known)}")
            picked[key] = value
        if "interval" in picked:
            one = picked.pop("interval")
            picked.setdefault("intervals", (one,))
        if isinstance(picked.get("intervals"), int):
            picked["intervals"] = (picked["intervals"],)
        return cls(**{k: (tuple(v) if k == "intervals" else int(v)) for k, v in picked.items()})

    def inference_dict(self) -> dict[str, int]:
        """What an export stores under ``config.acre.inference``."""
        return {"first_chunk": self.first_chunk, "stride": self.stride, "interval": self.interval,
                "working_window": self.working_window, "max_refill": self.max_refill}

    def training_dict(self) -> dict[str, Any]:
        return {"first_chunk": self.first_chunk, "stride": self.stride, "intervals": list(self.intervals)}

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> "WindowGeometry":
        """This geometry with the given inference keys replaced (None values are ignored)."""
        changes = {k: v for k, v in (overrides or {}).items() if k in INFERENCE_KEYS and v is not None}
        if "interval" in changes:
            changes["intervals"] = (int(changes.pop("interval")),)
        return replace(self, **{k: (v if k == "intervals" else int(v)) for k, v in changes.items()})

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["intervals"] = list(self.intervals)
        return out


def export_geometry(config: Mapping[str, Any] | Any) -> WindowGeometry:
    """The geometry an export stores (``config.acre.inference``); the paper's for what it lacks."""
    stored = inference_section(config)
    return WindowGeometry.from_mapping({k: v for k, v in stored.items() if k in INFERENCE_KEYS})


def inference_section(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    acre = config.get("acre") if isinstance(config, Mapping) else getattr(config, "acre", None)
    return dict(((acre or {}).get("inference") or {}) if isinstance(acre, Mapping) else {})
