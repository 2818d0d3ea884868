"""Broken input files: every lost record is reported (file and line) and counted; nothing vanishes silently."""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

import pytest

from acre_train.data import DataError, Stage1Settings, load_prepared, prepare_stage1
from acre_train.data.errors import InputProblems
from acre_train.data.readers import read_files

zstandard = pytest.importorskip("zstandard")
N = 600


def _lines() -> list[bytes]:
    return [json.dumps({"text": f"record {i} " + "word " * (5 + i % 7), "meta": {"i": i}}).encode() for i in range(N)]


def _write(path: Path, payload: bytes) -> Path:
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(payload))
    elif path.name.endswith(".zst"):  # two frames, as concatenated shards often are
        half = payload.index(b"\n", len(payload) // 2) + 1
        c = zstandard.ZstdCompressor(write_checksum=True)
        path.write_bytes(c.compress(payload[:half]) + c.compress(payload[half:]))
    else:
        path.write_bytes(payload)
    return path


def _read(path: Path, strict: bool = False) -> tuple[int, InputProblems]:
    problems = InputProblems(strict=strict, max_logged=0)
    return sum(1 for _ in read_files([path], problems)), problems


def test_one_bad_byte_costs_one_line_and_is_reported_there(tmp_path):
    lines = _lines()
    lines[499] = lines[499][:20] + b"\xff\xfe" + lines[499][22:]
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst"):
        count, problems = _read(_write(tmp_path / name, b"\n".join(lines) + b"\n"))
        assert count == N - 1, name
        assert problems.total == 1 and problems.examples[0]["line"] == 500 and problems.examples[0]["reason"] == "not valid UTF-8"


@pytest.mark.parametrize("name", ["t.jsonl.zst", "t.jsonl.gz"])
def test_a_truncated_compressed_shard_is_an_error_or_a_counted_loss(tmp_path, name):
    path = _write(tmp_path / name, b"\n".join(_lines()) + b"\n")
    path.write_bytes(path.read_bytes()[: 3 * len(path.read_bytes()) // 4])  # cut inside the second half
    with pytest.raises(DataError, match=rf"{path}:\d+: truncated or corrupt compressed stream"):
        _read(path, strict=True)
    count, problems = _read(path)
    assert 0 <= count < N and problems.counts["truncated or corrupt compressed stream"] == 1
    out = tmp_path / "prep"
    settings = Stage1Settings(inputs=(str(path),), output=out, tokenizer="tiny", min_length=16, max_length=64,
                              token_budget=None, first_chunk=32, stride=16, intervals=(4,), cache_dir=tmp_path / "c")
    manifest = load_prepared(prepare_stage1(settings, log=lambda *_: None))[1]
    assert manifest["skipped"]["by_reason"] == {"truncated or corrupt compressed stream": 1}
    path.write_bytes(path.read_bytes()[:40])  # nothing readable left: our error, not a datasets traceback
    with pytest.raises(DataError, match="no usable document.*truncated or corrupt compressed stream"):
        prepare_stage1(Stage1Settings(**{**settings.__dict__, "output": tmp_path / "prep2"}), log=lambda *_: None)


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_fuzz_truncations_and_byte_flips_never_lose_records_silently(tmp_path, suffix):
    rng = random.Random(suffix)
    payload = b"\n".join(_lines()) + b"\n"
    if suffix == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [json.loads(line) for line in _lines()]
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        clean = buffer.getvalue()
    else:
        clean = _write(tmp_path / f"clean.{suffix}", payload).read_bytes()
    for trial in range(12):
        data = bytearray(clean)
        if trial % 2:
            data = data[: rng.randrange(1, len(data))]
        else:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path = tmp_path / f"fuzz{trial}.{suffix}"
        path.write_bytes(bytes(data))
        try:
            count, problems = _read(path)
        except DataError:
            continue  # refused as a whole (e.g. an unreadable Parquet footer), with the file named
        if problems.total == 0:
            assert count == N, (trial, count)  # no report means nothing was lost
        else:
            assert count < N or any(e["reason"] != "truncated or corrupt compressed stream" for e in problems.examples)


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst"])
def test_a_hostile_line_is_one_bad_record_named_by_file_and_line(tmp_path, name, monkeypatch):
    """A line over the size cap (skipped unread), JSON nested past the parser's depth, and a lone
    surrogate escape (text no tokenizer takes) each cost their own line, reported there."""
    from acre_train.data import readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 4096)
    lines = _lines()
    lines[10] = b'{"text": "' + b"x" * 10_000 + b'"}'
    lines[20] = b'{"text": "a", "meta": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    lines[30] = b'{"text": "abc \\ud800 def"}'
    count, problems = _read(_write(tmp_path / name, b"\n".join(lines) + b"\n"))
    assert count == N - 3
    assert [(e["line"], e["reason"]) for e in problems.examples] == [
        (11, "line too long"), (21, "malformed JSON"), (31, "not valid Unicode")]


def test_line_splitting_is_linear_and_keeps_every_byte(tmp_path):
    """Lines come out whole across block boundaries; a newline-less file is one line, read in one pass."""
    from acre_train.data.readers import _binary_lines

    payload = b"".join(b"%d:" % i + b"y" * (i * 37 % 3000) + b"\n" for i in range(2000)) + b"tail"
    path = tmp_path / "lines.jsonl"
    path.write_bytes(payload)
    assert list(_binary_lines(path)) == payload.split(b"\n")
    path.write_bytes(b"z" * (8 << 20))
    (only,) = list(_binary_lines(path))
    assert only == b"z" * (8 << 20)


def test_a_long_document_is_tokenized_in_pieces_to_the_same_ids(tmp_path):
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.data.tokenizer import BatchEncoder

    text = "\n".join(f"line {i} holds some words, and more\n" + ("  indented\n" if i % 5 == 0 else "") for i in range(400))
    whole = BatchEncoder(tiny_tokenizer(), piece_chars=1 << 30)([text, "short"])
    pieces = BatchEncoder(tiny_tokenizer(), piece_chars=500)([text, "short"])
    assert pieces == whole and len(whole[0]) > 1000
