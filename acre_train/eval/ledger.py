"""The test split is used once: every test run's fingerprint goes into a ledger, and a repeat is refused.

A fingerprint covers what decides a test figure: the model's weights and stored settings (the hash of
its ``config.json`` and weight files), the rows and their options, the tasks, lengths, question
counts, seeds and the decoding budget. ``acre-train eval --split test`` checks the ledger before any
model loads; a repeat needs ``--rerun`` and its report names every earlier run beside the new one.

The ledger is a JSONL file (default ``$ACRE_TRAIN_CACHE/test-ledger.jsonl``; a project keeps its own
with ``--ledger``), one line per finished test run.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Mapping

from ..files import cache_root, write_text_atomic


class TestSplitReused(ValueError):
    """A test cell that has been run already (a user error: one line, exit code 2)."""

    __test__ = False  # not a pytest class


def model_hash(model: str | Path) -> str:
    """SHA-256 over a model folder's ``config.json`` and weight files (names and contents, in name order);
    for something that is not a folder (a hub id), over its name."""
    folder = Path(model)
    digest = hashlib.sha256()
    if not folder.is_dir():
        digest.update(f"name:{model}".encode())
        return digest.hexdigest()
    files = sorted(p for p in folder.iterdir()
                   if p.is_file() and (p.name == "config.json" or p.suffix in (".safetensors", ".bin")))
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def fingerprint(settings: Mapping[str, Any]) -> str:
    """A short stable hash of a run's settings (JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Ledger:
    """The test runs recorded so far (see the module docstring)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else cache_root() / "test-ledger.jsonl"

    def runs(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{self.path}:{number}: not a ledger line ({exc.msg})") from None
        return out

    def previous(self, key: str) -> list[dict[str, Any]]:
        return [r for r in self.runs() if r.get("fingerprint") == key]

    def check(self, key: str, *, rerun: bool) -> list[dict[str, Any]]:
        """The earlier runs of ``key``; with none, or with ``rerun``, the run may go on."""
        before = self.previous(key)
        if before and not rerun:
            first = before[0]
            raise TestSplitReused(
                f"this test cell ran already ({first.get('when')}, out {first.get('out')}, fingerprint {key}; "
                f"{self.path}): a test cell is scored once per model and setting. Choose on --split dev; "
                "--rerun runs it again and reports both")
        return before

    def record(self, key: str, entry: Mapping[str, Any]) -> dict[str, Any]:
        """Append one finished run (the file is rewritten atomically: a crash leaves the old ledger)."""
        line = {"fingerprint": key, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry}
        old = self.path.read_text(encoding="utf-8") if self.path.is_file() else ""
        if old and not old.endswith("\n"):
            old += "\n"
        write_text_atomic(self.path, old + json.dumps(line, sort_keys=True) + "\n")
        return line
