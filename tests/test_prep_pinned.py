"""Prepared data is pinned: a change to the preparation code (speed, structure) must not change a value
of what stage 1 and stage 2 write. The digests were taken from the pipeline as it stood before the
preparation skeleton and the Arrow-direct span fetch (commit abedcf2). The built-in text and the tiny
tokenizer trained on it depend on the Python and ``tokenizers`` versions, so the digests hold for the
versions recorded beside them (elsewhere the test skips). Regenerate only for a deliberate format
change (and bump ``data.output.FORMAT_VERSION``):

    python tests/test_prep_pinned.py
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import datasets
import pytest
import tokenizers

from acre_train.data import Stage1Settings, Stage2Settings, builtin_text, prepare_stage1, prepare_stage2

datasets.disable_progress_bars()

PINNED = Path(__file__).resolve().parent / "data" / "prep_digests.json"
PLAN = dict(first_chunk=64, stride=32, intervals=(4, 8, 16), seed=3)
# Manifest parts that depend on nothing but the data (paths, hashes of temp files and the key are left out).
MANIFEST_KEYS = ("format_version", "stage", "plan", "columns", "dtypes", "counts", "skipped", "histograms")


def digest(out: Path) -> str:
    """sha256 over every row's values, the columns' Arrow types and the data-only part of the manifest
    (values, not file bytes: a ``datasets`` release may write other metadata into the same data)."""
    h = hashlib.sha256()
    table = datasets.load_from_disk(str(out)).data.table
    h.update(json.dumps([f"{f.name}:{f.type}" for f in table.schema]).encode())
    h.update(json.dumps(table.to_pylist(), sort_keys=True).encode())
    manifest = json.loads((out / "manifest.json").read_text())
    h.update(json.dumps({k: manifest[k] for k in MANIFEST_KEYS}, sort_keys=True).encode())
    return h.hexdigest()


def stage1_output(tmp: Path) -> Path:
    """Stage 1 of 40 built-in documents, read through a relative path (rows record where they came from)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in builtin_text()[:40]), encoding="utf-8")
    here = os.getcwd()
    os.chdir(tmp)
    try:
        return tmp / prepare_stage1(Stage1Settings(inputs=("text.jsonl",), output=Path("s1"), cache_dir=tmp / "cache",
                                                   min_length=100, max_length=400, token_budget=30_000, **PLAN),
                                    log=lambda *_: None)
    finally:
        os.chdir(here)


def stage2_output(tmp: Path) -> Path:
    return prepare_stage2(Stage2Settings(builtin=True, output=tmp / "s2", cache_dir=tmp / "cache", max_length=600,
                                         max_samples=24, **PLAN), log=lambda *_: None)


def versions() -> dict[str, str]:
    return {"python": "%d.%d" % sys.version_info[:2], "tokenizers": tokenizers.__version__}


def pinned() -> dict[str, str]:
    data = json.loads(PINNED.read_text())
    if data["versions"] != versions():
        pytest.skip(f"digests pinned under {data['versions']}, this is {versions()}: python tests/test_prep_pinned.py")
    return data


def test_stage1_output_is_identical_to_the_pinned_pipeline(tmp_path):
    assert digest(stage1_output(tmp_path)) == pinned()["stage1"]


def test_stage2_output_is_identical_to_the_pinned_pipeline(tmp_path):
    assert digest(stage2_output(tmp_path)) == pinned()["stage2"]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        found = {"versions": versions(), "stage1": digest(stage1_output(Path(tmp) / "1")),
                 "stage2": digest(stage2_output(Path(tmp) / "2"))}
    PINNED.write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps(found, indent=1))
