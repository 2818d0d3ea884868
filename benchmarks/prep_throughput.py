"""Stage-1 preparation throughput (raw tokens per second) with 1 and 2 processes, beside the tokenizer's.

Each run gets a fresh output and a fresh cache directory, so tokenization is measured, not reused.
The input is the built-in text repeated ``--copies`` times (so there is enough work to split). In
the same run, the raw batched fast tokenizer encodes the same documents (one process, and the same
documents split over N processes): the pipeline's floor. The pipeline's seconds include its start-up
(reading, hashing, writing Arrow and the manifest) but not loading the tokenizer, which neither side is
charged for (it is loaded once per process and printed apart). Two floors: ``tokenizer(texts)``, the
transformers call a user would write (the performance issue's "raw batched tokenizer"), and the Rust
backend's ``encode_batch_fast``, the fastest call the tokenizer has (no character offsets; the pipeline
uses it); each ratio column is pipeline / that floor, and the floor's own speed-up over one process is
printed beside the pipeline's (what this machine's cores give the tokenizer alone). Each side runs ``--repeat`` times, alternated with
the others, and the fastest run of each is reported.

    python benchmarks/prep_throughput.py --tokenizer base:qwen2.5-coder-0.5b-instruct --copies 30
    python benchmarks/prep_throughput.py            # the built-in tiny tokenizer: a smoke figure only
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _write_corpus(path: Path, copies: int) -> int:
    from acre_train.data.builtin import builtin_text

    records = builtin_text()
    with path.open("w", encoding="utf-8") as f:
        for copy in range(copies):
            for r in records:
                f.write(json.dumps({"text": r["text"], "meta": {**r["meta"], "copy": copy}}) + "\n")
    return copies * len(records)


def _raw_rate(tokenizer_spec: str, texts: list[str], procs: int, fast: bool = False) -> tuple[float, int]:
    """Tokens/s of the fast tokenizer's batched encode on ``texts`` split over ``procs`` processes
    (``fast``: the Rust backend's ``encode_batch_fast``; else the transformers call)."""
    from concurrent.futures import ProcessPoolExecutor

    parts = [texts[i::procs] for i in range(procs)]
    start = time.perf_counter()
    if procs == 1:
        counts = [_encode(tokenizer_spec, parts[0], fast)]
    else:
        with ProcessPoolExecutor(procs) as pool:
            counts = list(pool.map(_encode, [tokenizer_spec] * procs, parts, [fast] * procs))
    seconds = time.perf_counter() - start
    return sum(counts) / seconds, sum(counts)


_TOKENIZERS: dict[str, object] = {}


def _encode(tokenizer_spec: str, texts: list[str], fast: bool = False) -> int:
    from acre_train.data.tokenizer import load_tokenizer

    if tokenizer_spec not in _TOKENIZERS:  # loaded before the clock in the parent; once per worker
        _TOKENIZERS[tokenizer_spec] = load_tokenizer(tokenizer_spec)
    tok = _TOKENIZERS[tokenizer_spec]
    total = 0
    for i in range(0, len(texts), 256):
        if fast:
            total += sum(len(e.ids) for e in tok._tokenizer.encode_batch_fast(texts[i : i + 256], add_special_tokens=False))
        else:
            total += sum(len(ids) for ids in tok(texts[i : i + 256], add_special_tokens=False)["input_ids"])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=4, help="how many times the built-in text is repeated")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each side, alternated; the fastest of each is reported (this machine is noisy)")
    parser.add_argument("--tokenizer", default="tiny",
                        help="PATH or base:NAME of a real tokenizer (default: the built-in tiny one, a smoke figure)")
    args = parser.parse_args()

    import datasets

    from acre_train.data import Stage1Settings, load_prepared, prepare_stage1
    from acre_train.data.builtin import builtin_text

    datasets.disable_progress_bars()  # keep the table readable
    tic = time.perf_counter()
    _encode(args.tokenizer, ["warm-up"])  # load (or train) the tokenizer outside the timed region: the pipeline
    load_s = time.perf_counter() - tic    # reuses this process's loaded tokenizer, as a training run does
    texts = [r["text"] for r in builtin_text()] * args.copies
    label = "the built-in tiny tokenizer (SMOKE FIGURE: says nothing about real use)" if args.tokenizer == "tiny" \
        else f"tokenizer {args.tokenizer}"
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        docs = _write_corpus(corpus, args.copies)
        print(f"input: {docs} documents ({corpus.stat().st_size / 1e6:.1f} MB JSONL), {label} (loaded once in "
              f"{load_s:.1f} s, outside every timed region), spans 1024-4096 tokens, W0=1024, S=512; best of {args.repeat} runs per side\n")
        print(f"{'procs':>5} | {'seconds':>8} {'raw tokens':>11} {'tokens/s':>10} {'speed-up':>8} | "
              f"{'tokenizer() tok/s':>17} {'ratio':>5} {'speed-up':>8} | {'encode_batch_fast':>17} {'ratio':>5}")
        base = raw_base = None
        for procs in (int(p) for p in args.procs.split(",")):
            seconds, raw_rate, fast_rate = float("inf"), 0.0, 0.0
            for attempt in range(args.repeat):  # alternated, so a slow spell of the machine hits both sides
                run = Path(tmp) / f"run{procs}-{attempt}"
                settings = Stage1Settings(inputs=(str(corpus),), output=run / "out", cache_dir=run / "cache",
                                          tokenizer=args.tokenizer, min_length=1024, max_length=4096,
                                          first_chunk=1024, stride=512, token_budget=None, num_proc=procs)
                start = time.perf_counter()
                prepare_stage1(settings, log=lambda *_: None)
                seconds = min(seconds, time.perf_counter() - start)
                tokens = load_prepared(run / "out")[1]["counts"]["raw_tokens"]
                raw_rate = max(raw_rate, _raw_rate(args.tokenizer, texts, procs)[0])
                fast_rate = max(fast_rate, _raw_rate(args.tokenizer, texts, procs, fast=True)[0])
            rate = tokens / seconds
            base, raw_base = base or rate, raw_base or raw_rate
            print(f"{procs:>5} | {seconds:>8.2f} {tokens:>11,} {rate:>10,.0f} {rate / base:>8.2f} | "
                  f"{raw_rate:>17,.0f} {rate / raw_rate:>5.2f} {raw_rate / raw_base:>8.2f} | "
                  f"{fast_rate:>17,.0f} {rate / fast_rate:>5.2f}")


if __name__ == "__main__":
    main()
