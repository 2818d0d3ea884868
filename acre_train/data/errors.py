"""Errors and bad-input bookkeeping shared by the data-preparation pipeline."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """Bad input or settings; the message says what and where (file and line when known)."""


@dataclass
class InputProblems:
    """Malformed records seen while reading: reported with file and line, skipped or fatal.

    With ``strict`` the first problem raises :class:`DataError`; otherwise it is logged to stderr
    (the first ``max_logged``), counted by reason and kept (the first ``max_kept``) for the manifest.
    """

    strict: bool = False
    strict_hint: str = " [--strict: stopping at the first bad record]"  # appended to the raised message
    max_logged: int = 20
    max_kept: int = 100
    counts: Counter = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def report(self, source: str, line: int | None, reason: str, detail: str = "") -> None:
        """Record one bad record; ``line`` is 1-based (a row number for Parquet/hub data)."""
        where = f"{source}:{line}" if line is not None else source
        message = f"{where}: {reason}" + (f" ({detail})" if detail else "")
        if self.strict:
            raise DataError(message + self.strict_hint)
        total = sum(self.counts.values())
        self.counts[reason] += 1
        if len(self.examples) < self.max_kept:
            self.examples.append({"source": source, "line": line, "reason": reason, "detail": detail})
        if total < self.max_logged:
            print(f"warning: skipped {message}", file=sys.stderr)
        elif total == self.max_logged:
            print("warning: more bad records; see 'skipped' in manifest.json", file=sys.stderr)

    @property
    def total(self) -> int:
        return int(sum(self.counts.values()))

    def as_dict(self) -> dict[str, Any]:
        """Summary for the manifest."""
        return {"total": self.total, "by_reason": dict(sorted(self.counts.items())), "examples": self.examples}
