"""Stage-1 preparation throughput (raw tokens per second) with 1 and 2 processes, side by side.

Each run gets a fresh output and a fresh cache directory, so tokenization is measured, not reused.
The input is the built-in text repeated ``--copies`` times (so there is enough work to split).

    python benchmarks/prep_throughput.py
    python benchmarks/prep_throughput.py --copies 8 --procs 1,2
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=4, help="how many times the built-in text is repeated")
    parser.add_argument("--procs", default="1,2")
    args = parser.parse_args()

    import datasets

    from acre_train.data import Stage1Settings, load_prepared, prepare_stage1
    from acre_train.data.tiny_tokenizer import tiny_tokenizer

    datasets.disable_progress_bars()  # keep the table readable
    tiny_tokenizer()  # train/cache the tokenizer outside the timed region
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        docs = _write_corpus(corpus, args.copies)
        print(f"input: {docs} documents ({corpus.stat().st_size / 1e6:.1f} MB JSONL), tiny tokenizer, "
              f"spans 1024-4096 tokens, W0=1024, S=512\n")
        print(f"{'procs':>5} | {'seconds':>8} {'raw tokens':>11} {'tokens/s':>10} {'speed-up':>8}")
        base = None
        for procs in (int(p) for p in args.procs.split(",")):
            run = Path(tmp) / f"run{procs}"
            settings = Stage1Settings(inputs=(str(corpus),), output=run / "out", cache_dir=run / "cache",
                                      min_length=1024, max_length=4096, first_chunk=1024, stride=512,
                                      token_budget=None, num_proc=procs)
            start = time.perf_counter()
            prepare_stage1(settings, log=lambda *_: None)
            seconds = time.perf_counter() - start
            tokens = load_prepared(run / "out")[1]["counts"]["raw_tokens"]
            rate = tokens / seconds
            base = base or rate
            print(f"{procs:>5} | {seconds:>8.2f} {tokens:>11,} {rate:>10,.0f} {rate / base:>8.2f}")


if __name__ == "__main__":
    main()
