"""Method registry: name -> class. Every row of the evaluation table is one of these.

A method is a dataclass subclass of ``EvalMethod`` whose fields are its options; it implements
``prepare(model, tokenizer, example) -> state`` (query-independent work, may return None) and
``answer(model, tokenizer, example, state, generation) -> MethodResult`` (prediction + ``CostRecord``).
To add a row, write such a class and add it to ``METHODS``. ``acre``/``acre-l1`` need an ACRE model
(an ``acre-train export`` folder); every other row runs on any supported model, that one included
(an ACRE model without ACRE inputs is its base model).

Specs on the command line: ``name`` or ``name:key=value:key=value``, e.g. ``truncated:budget=2048``,
``infoflow:ratio=0.3:reorder=true``, ``cachefocus:allocation=sort``. Rows are separated by commas; a
comma that does not start a row's name belongs to the option before it, so the ``acre`` row takes a
selection in its one spelling: ``full,acre:scorer=l2:layers=3,heads=max``, ``acre:selection=l2:layers=3
+grow=2,sentences eta=512`` (docs/selection.md).
"""

from __future__ import annotations

import dataclasses
import re
import typing

from .acre import Acre, AcreL1
from .base import CostRecord, EvalMethod, GenerationConfig, MethodResult
from .cachefocus import CacheFocus
from .full import Full, Truncated
from .infoflow import CacheBlend, Epic, InfoFlow, NoRecompute

METHODS: dict[str, type[EvalMethod]] = {
    cls.name: cls for cls in (Full, Truncated, Acre, AcreL1, CacheFocus, InfoFlow, NoRecompute, CacheBlend, Epic)
}

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _convert(raw: str, kind: type, where: str):
    if kind is bool:
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"{where}: expected true/false, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{where}: expected {kind.__name__}, got {raw!r}") from None


def parse_method(spec: str) -> EvalMethod:
    """Build a method from ``name[:key=value...]``; unknown names and options are errors that list the valid ones."""
    name, *opts = [x.strip() for x in spec.strip().split(":")]
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    cls = METHODS[name]
    opts = cls.join_options(opts)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for opt in opts:
        if "=" not in opt:
            raise ValueError(f"method {spec!r}: option {opt!r} is not key=value")
        key, raw = opt.split("=", 1)
        if key not in fields:
            raise ValueError(f"method {name!r} has no option {key!r}; options: {', '.join(sorted(fields)) or 'none'}")
        kwargs[key] = _convert(raw, hints[key], f"method {name!r} option {key!r}")
    method = cls(**kwargs)
    try:
        method.check()
    except ValueError as exc:
        raise ValueError(f"method {spec!r}: {exc}") from None
    return method


def parse_methods(specs: str) -> list[EvalMethod]:
    """Comma-separated specs -> methods (labels must be distinct). A comma splits rows only where a
    method's name follows it; elsewhere it belongs to an option's value (a scorer's options)."""
    names = "|".join(re.escape(n) for n in sorted(METHODS, key=len, reverse=True))
    methods = [parse_method(s) for s in re.split(rf",\s*(?=(?:{names})\s*(?::|,|$))", specs.strip().strip(",")) if s.strip()]
    if not methods:
        raise ValueError("no methods given")
    labels = [m.label() for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate method rows: {labels}")
    return methods


__all__ = ["METHODS", "EvalMethod", "MethodResult", "CostRecord", "GenerationConfig", "parse_method", "parse_methods"]
