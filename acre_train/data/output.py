"""Output directories: atomic writes, the manifest, the cache fingerprint, and loading back.

Layout of a prepared dataset directory::

    <output>/                  written by datasets.Dataset.save_to_disk
        data-*.arrow, dataset_info.json, state.json
        manifest.json          written last; "complete": true

Everything is first written to a hidden sibling ``.<name>.partial-<random>`` that is renamed into
place only when complete, so an interrupted run never leaves a directory that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from ..files import FolderLock, atomic_dir
from .errors import DataError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# Per-token columns (exactly InterleavePlan.as_dict()) and per-sample columns of every output row.
PLAN_COLUMNS = ("input_ids", "is_l1", "chunk_ids", "positions", "memory_positions", "labels", "raw_index")
SAMPLE_COLUMNS = ("num_raw_tokens", "intervals", "sample_index")


def dataset_from_generator(generate, work: Path, features, problems: Any = None,
                           fingerprint: str | None = None) -> "datasets.Dataset":  # noqa: F821
    """``Dataset.from_generator`` in a private cache dir, re-raising our own :class:`DataError`
    (``datasets`` wraps generator errors in ``DatasetGenerationError``, hiding file and line).

    No record at all is our own error too (``datasets`` would say 'Instruction "train" corresponds to
    no data'), with what was skipped and why when ``problems`` (an ``InputProblems``) is given.
    """
    import datasets

    yielded = 0

    def counted():
        nonlocal yielded
        for item in generate():
            yielded += 1
            yield item

    try:
        # A known ``fingerprint`` spares datasets from hashing the generator (and its closure) with dill.
        data = datasets.Dataset.from_generator(counted, cache_dir=str(work), features=features, fingerprint=fingerprint)
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__
        if isinstance(cause, (DataError, KeyboardInterrupt)):
            raise cause from None
        raise
    except ValueError as exc:
        if yielded:
            raise
        raise DataError(no_usable_record(problems)) from exc
    if len(data) == 0:
        raise DataError(no_usable_record(problems))
    return data


def no_usable_record(problems: Any = None) -> str:
    """The message for inputs that gave nothing to prepare."""
    message = "no usable document in the inputs (empty, binary, or every record invalid)"
    if problems is not None and problems.total:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(problems.counts.items()))
        first = problems.examples[0]
        message += f": skipped {reasons}; first at {first['source']}:{first['line']}"
    return message


def fingerprint(*parts: Any) -> str:
    """Stable hex digest of JSON-serialisable parts (key order does not matter)."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a *complete* output directory, else None."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("complete") is True else None


def reusable(path: Path, key: str) -> dict[str, Any] | None:
    """The manifest of ``path`` if it is complete and was made with the same fingerprint."""
    manifest = read_manifest(path)
    return manifest if manifest and manifest.get("fingerprint") == key else None


@contextlib.contextmanager
def atomic_output(path: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces ``path``, on error it is removed.

    The preparation owns ``path`` for its whole life (:class:`FolderLock`): a second one is refused.
    """
    path = Path(path)
    with FolderLock(path, "preparation"):
        yield from _atomic_output(path, overwrite)


def _atomic_output(path: Path, overwrite: bool) -> Iterator[Path]:
    if path.exists() and not overwrite:
        raise DataError(
            f"{path} exists and was made with other settings or inputs (or is incomplete); "
            "pass --overwrite (in a recipe: data.prepare.overwrite=true) to replace it, or choose another "
            "output (data.path)"
        )
    if path.exists() and not is_prepared_dataset(path):
        raise DataError(f"{path} exists and is not a prepared dataset (no manifest.json): --overwrite only "
                        "replaces what acre-train prepared; choose another output (data.path)")
    foreign = foreign_files(path)
    if foreign:  # a user's own file kept inside a dataset folder goes with --overwrite: refuse instead
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise DataError(f"{path} holds files acre-train did not write ({shown}); --overwrite would delete them: "
                        "move them out, or choose another output (data.path)")
    with atomic_dir(path, f"the prepared dataset {path}") as tmp:  # clears what a killed preparation left
        yield tmp
        if read_manifest(tmp) is None:
            raise DataError(f"internal error: {tmp} has no complete manifest; not publishing it")


TOOL = "acre-train"


_OURS = re.compile(r"data-\d+-of-\d+\.arrow|dataset_info\.json|state\.json|cache-[\w.-]+\.arrow")


def foreign_files(path: Path) -> list[str]:
    """Names in a prepared dataset's folder that no preparation writes (sorted)."""
    if not Path(path).is_dir():
        return []
    return sorted(p.name for p in Path(path).iterdir() if p.name != MANIFEST and not _OURS.fullmatch(p.name))


def is_prepared_dataset(path: Path) -> bool:
    """A folder acre-train prepared, or an empty one. Any other folder -- even one with a file named
    ``manifest.json`` (a web app's, say) -- is not, so ``--overwrite`` never deletes it."""
    path = Path(path)
    if not path.is_dir():
        return False
    if not any(path.iterdir()):
        return True
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    # Older preparations carry no tool marker; their own keys identify them.
    return data.get("tool") == TOOL or {"format_version", "fingerprint", "stage", "counts"} <= set(data)


# The one data file of a prepared dataset, under the name ``save_to_disk`` gives a single shard.
ROWS_FILE = "data-00000-of-00001.arrow"


def save_rows(rows, out: Path, fingerprint: str) -> None:
    """Write ``rows`` into ``out`` as ``datasets.load_from_disk`` reads them.

    When the row builder already wrote them as one Arrow file at ``out / ROWS_FILE`` (stage 1 in one
    process: ``datasets.map`` writes its output there), only the two small files ``save_to_disk`` puts
    beside it are added; otherwise ``save_to_disk`` writes them. The first way skips a second copy of
    every token column (a tenth of stage 1's time with a fast tokenizer); ``load_prepared`` reads both
    alike, and the pinned digests (tests/test_prep_pinned.py) check that the rows are the same.
    """
    out = Path(out)
    if [Path(f["filename"]).resolve() for f in rows.cache_files] != [(out / ROWS_FILE).resolve()]:
        rows.save_to_disk(str(out))
        return
    # What save_to_disk writes beside its shards (datasets.Dataset.save_to_disk: state and info).
    state = {"_data_files": [{"filename": ROWS_FILE}], "_fingerprint": fingerprint[:16], "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (out / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
    rows.info.write_to_directory(str(out))


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` (marked complete) into ``directory``; call it last."""
    data = {"tool": TOOL, **manifest, "complete": True}
    (Path(directory) / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def load_prepared(path: str | os.PathLike) -> tuple["datasets.Dataset", dict[str, Any]]:  # noqa: F821
    """Load a prepared dataset and its manifest; refuses incomplete or foreign directories."""
    import datasets

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: no such prepared dataset (run 'acre-train preprocess stage1|stage2')")
    manifest = read_manifest(path)
    if manifest is None:
        raise DataError(f"{path}: no complete {MANIFEST}; the preparation did not finish, run it again")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version {manifest.get('format_version')} but this acre-train reads "
            f"{FORMAT_VERSION}; prepare the data again"
        )
    return datasets.load_from_disk(str(path)), manifest


def length_histogram(lengths: list[int]) -> dict[str, int]:
    """Counts per power-of-two bucket, keyed ``"<=N"`` in increasing order."""
    counts: Counter = Counter()
    for n in lengths:
        counts[1 << max(int(n) - 1, 0).bit_length()] += 1
    return {f"<={k}": counts[k] for k in sorted(counts)}


def interval_histogram(intervals: list[list[int]]) -> dict[str, int]:
    """How many chunks used each interval."""
    counts = Counter(v for row in intervals for v in row)
    return {str(k): counts[k] for k in sorted(counts)}
