"""Record readers: JSONL, JSONL.gz, JSONL.zst, Parquet files, or a ``datasets`` name.

Every record comes with where it came from (file and 1-based line, or row for Parquet/hub data) so
bad input can be reported precisely. Readers never guess silently: an unknown extension, a missing
file or an empty glob is a :class:`DataError`.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import DataError, InputProblems

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES + (".json",)


@dataclass(frozen=True)
class Record:
    """One input record and where it came from."""

    data: dict[str, Any]
    source: str
    line: int  # 1-based line (JSONL) or row (Parquet, hub datasets)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower()


def expand_inputs(specs: Iterable[str | os.PathLike]) -> list[Path]:
    """Files named by ``specs`` (files, directories searched recursively, or glob patterns), sorted.

    Sorting makes the sample order (and so the output) independent of directory listing order.
    """
    files: list[Path] = []
    for spec in specs:
        spec = str(spec)
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p) in SUPPORTED_SUFFIXES)
            if not found:
                raise DataError(f"{spec}: directory holds no {', '.join(SUPPORTED_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif glob.has_magic(spec):
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not found:
                raise DataError(f"{spec}: pattern matches no file")
            files.extend(found)
        else:
            raise DataError(f"{spec}: no such file or directory")
    for path in files:
        if _suffix(path) not in SUPPORTED_SUFFIXES:
            raise DataError(f"{path}: unsupported file type; expected one of {', '.join(SUPPORTED_SUFFIXES)}")
    return files


def file_sha256(path: Path, block: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (recorded in the manifest; also the cache key)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


class DamagedStream(Exception):
    """A compressed stream that ends early or cannot be decompressed."""


def _zstd_blocks(path: Path, block: int = 1 << 20) -> Iterator[bytes]:
    """Decompressed bytes of a (multi-frame) .zst file; a frame cut short raises :class:`DamagedStream`
    (zstandard's stream reader returns EOF quietly there, which made truncated shards vanish)."""
    from ..errors import require

    zstandard = require("zstandard", "data")
    dctx = zstandard.ZstdDecompressor()
    dobj, in_frame = dctx.decompressobj(), False
    with open(path, "rb") as f:
        while data := f.read(block):
            while data:
                in_frame = True
                try:
                    out = dobj.decompress(data)
                except zstandard.ZstdError as exc:
                    raise DamagedStream(f"corrupt zstd data ({exc})") from exc
                if out:
                    yield out
                if dobj.eof:  # a frame ended; the rest starts the next one
                    data, dobj, in_frame = dobj.unused_data, dctx.decompressobj(), False
                else:
                    data = b""
    if in_frame:
        raise DamagedStream("the last zstd frame is cut short (truncated file)")


def _gzip_blocks(path: Path) -> Iterator[bytes]:
    # Line by line: a big read() that hits the damage would take the lines before it down too.
    with gzip.open(path, "rb") as f:
        while True:
            try:
                data = f.readline()
            except (OSError, EOFError, zlib.error) as exc:
                raise DamagedStream(f"truncated or corrupt gzip stream ({exc})") from exc
            if not data:
                return
            yield data


def _plain_blocks(path: Path, block: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while data := f.read(block):
            yield data


MAX_LINE_BYTES = 64 << 20  # a longer line is one bad record: it is skipped unread, never held in memory


class LineTooLong(bytes):
    """Stands in for a line over :data:`MAX_LINE_BYTES`; its value is the line's length in bytes, as text."""


def _binary_lines(path: Path, max_bytes: int | None = None) -> Iterator[bytes]:
    """Lines of a file as bytes (decompressing .gz/.zst); decoding is per line, so one bad byte
    costs one line. Linear in the file's size: each block is searched for newlines once, and a line
    longer than ``max_bytes`` (default :data:`MAX_LINE_BYTES`) comes out as a :class:`LineTooLong`
    without being kept."""
    limit = MAX_LINE_BYTES if max_bytes is None else max_bytes
    suffix = _suffix(path)
    blocks = _zstd_blocks(path) if suffix.endswith(".zst") else _gzip_blocks(path) if suffix.endswith(".gz") \
        else _plain_blocks(path)
    parts: list[bytes] = []  # the current line's pieces so far
    size, dropped = 0, False  # its length; dropped: over the limit, pieces no longer kept
    for data in blocks:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            size += end - start
            if dropped or size > limit:
                yield LineTooLong(str(size).encode())
            else:
                parts.append(data[start:end])
                yield b"".join(parts)
            parts, size, dropped, start = [], 0, False, end + 1
        size += len(data) - start
        if size > limit:
            dropped, parts = True, []
        elif start < len(data):
            parts.append(data[start:])
    if size:
        yield LineTooLong(str(size).encode()) if dropped or size > limit else b"".join(parts)


def _read_jsonl(path: Path, problems: InputProblems) -> Iterator[Record]:
    source = str(path)
    lineno = 0
    lines = _binary_lines(path)
    while True:
        try:
            raw = next(lines)
        except StopIteration:
            return
        except DamagedStream as exc:
            # Nothing after this point can be read; say so (strict: stop) and count it in the manifest.
            problems.report(source, lineno + 1, "truncated or corrupt compressed stream",
                            f"{exc}; the records after line {lineno} are lost")
            return
        lineno += 1
        if isinstance(raw, LineTooLong):
            problems.report(source, lineno, "line too long",
                            f"{int(raw):,} bytes, over the {MAX_LINE_BYTES >> 20} MiB a record may hold; split the document")
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.report(source, lineno, "not valid UTF-8", str(exc))
            continue
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not records
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.report(source, lineno, "malformed JSON", exc.msg + f" at column {exc.colno}")
            continue
        except RecursionError:
            problems.report(source, lineno, "malformed JSON", "nested too deeply to read")
            continue
        if not isinstance(data, dict):
            problems.report(source, lineno, "not a JSON object", type(data).__name__)
            continue
        if b"\\u" in raw and _has_lone_surrogate(data):  # "\ud800" escapes decode to text no tokenizer takes
            problems.report(source, lineno, "not valid Unicode", "a lone surrogate escape (\\ud800-\\udfff)")
            continue
        yield Record(data, source, lineno)


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_jsonl_strict(path: str | os.PathLike) -> Iterator[Record]:
    """Records of one JSONL file (plain, .gz or .zst); the first bad line raises :class:`DataError`
    naming the file and line (for inputs where skipping a row would silently change a result)."""
    return _read_jsonl(Path(path), InputProblems(strict=True, strict_hint=""))


def _read_json_lines_or_array(path: Path, problems: InputProblems) -> Iterator[Record]:
    """``.json``: a JSON array of objects, or JSON lines under a ``.json`` name."""
    with open(path, "rb") as handle:
        head = handle.read(1024).lstrip()
    if not head.startswith(b"["):
        yield from _read_jsonl(path, problems)  # (its lines are decoded one by one: a bad one is reported)
        return
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}); is it a JSON file?") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg})") from exc
    for index, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            problems.report(str(path), index, "not a JSON object", f"array item {index}")
            continue
        yield Record(item, str(path), index)


def _read_parquet(path: Path, problems: InputProblems, batch_size: int = 1024) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a non-Parquet file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from exc
    row = 0
    batches = parquet.iter_batches(batch_size=batch_size)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # damaged pages: pyarrow's OSError/ArrowInvalid
            problems.report(str(path), row + 1, "corrupt Parquet data", f"{exc}; the rows from here on are lost")
            return
        for data in batch.to_pylist():
            row += 1
            yield Record(data, str(path), row)


def read_files(paths: Iterable[Path], problems: InputProblems) -> Iterator[Record]:
    """Records of every file in order."""
    for path in paths:
        suffix = _suffix(path)
        if suffix in PARQUET_SUFFIXES:
            yield from _read_parquet(path, problems)
        elif suffix == ".json":
            yield from _read_json_lines_or_array(path, problems)
        else:
            yield from _read_jsonl(path, problems)


def read_hub_dataset(name: str, config: str | None = None, split: str = "train") -> Iterator[Record]:
    """Records of a ``datasets`` dataset (hub name or local loading script/dir), streamed."""
    import datasets

    try:
        data = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as exc:  # offline, unknown name, bad split: say which dataset failed
        raise DataError(f"could not load dataset {name!r} (config={config!r}, split={split!r}): {exc}") from exc
    source = f"{name}[{config or 'default'}:{split}]"
    for row, data in enumerate(data, start=1):
        yield Record(dict(data), source, row)


def describe_inputs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Path, size and SHA-256 of each input file (for the manifest and the cache key)."""
    return [{"path": str(p), "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in paths]
