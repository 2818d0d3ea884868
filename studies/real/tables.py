"""The real-base report's summary table (docs/real-base.md), written from the committed predictions.

    python -m studies.real.tables            # rewrite the table between its markers
    python -m studies.real.tables --check    # exit 1 if the page differs from what the data gives

Each row names the cell's predictions file and the row's method label in it; the score, its 95 %
bootstrap interval, the KV share, the share of questions whose evidence came back whole and the score
on those are computed here, as the harness computes them (``acre_train/eval/metrics.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CELLS = REPO / "docs" / "real-base"
PAGE = REPO / "docs" / "real-base.md"
BEGIN, END = "<!-- summary table: studies/real/tables.py -->", "<!-- end of summary table -->"

PAIRED_L2 = "acre:scorer=l2:layers=7:heads=max:sinks=4:keep_sinks=1:neighbors=1"

# (cell, row, predictions folder under docs/real-base, method label); the adapter is read from the cell
ROWS: list[tuple[str, str, str, str]] = [
    ("2K SQuAD", "full attention", "scorer/2048/squad", "full"),
    ("2K SQuAD", "truncated to ACRE's budget", "scorer/2048/squad", "truncated:budget=493"),
    ("2K SQuAD", "CacheFocus, two paragraphs", "scorer/baselines/2048/squad", "cachefocus:k_finish=2"),
    ("2K SQuAD", "ACRE, the paper's L1-key scorer", "scorer/2048/squad", "acre:scorer=l1:layers=-1"),
    ("2K SQuAD", "ACRE, calibrated raw-key scorer", "scorer/2048/squad", "acre"),
    ("2K SQuAD", "ACRE, learned scorer", "scorer/learned-2048/squad", "acre"),
    ("2K SQuAD", "ACRE trained in the refilled layout, calibrated", "training/2048/squad", PAIRED_L2),
    ("2K SQuAD", "the same, one densest region, layers 7+9", "scorer/densest/2048/squad", "acre"),
    ("2K SQuAD", "the same, one region on whole sentences", "scorer/sentences/2048/squad", "acre"),
    ("2K SQuAD", "the same, scored by the question's own words", "scorer/question/2048/squad", "acre"),
    ("2K SQuAD", "the same, chunk-start tokens unscored, sinks kept", "scorer/unscored-kept/2048/squad", "acre"),
    ("2K SQuAD", "the same without kept sinks", "scorer/unscored-no-sinks/2048/squad", "acre"),
    ("2K SQuAD", "refilled layout, 4 questions per sample", "training/ladder/2048/squad/stage2-sim-packed",
     PAIRED_L2),
    ("4K multikey", "full attention", "scorer/grow/4096/niah_multikey", "full"),
    ("4K multikey", "truncated to ACRE's budget", "scorer/baselines/4096/niah_multikey", "truncated:budget=758"),
    ("4K multikey", "CacheFocus, one document", "scorer/baselines/4096/niah_multikey", "cachefocus:k_finish=1"),
    ("4K multikey", "ACRE, the paper's L1-key scorer", "scorer/4096/niah_multikey", "acre:scorer=l1:layers=-1"),
    ("4K multikey", "ACRE, calibrated raw-key scorer", "scorer/4096/niah_multikey", "acre"),
    ("4K multikey", "refilled layout, 4 questions per sample", "training/ladder/4096/niah_multikey/stage2-sim-packed",
     "acre:scorer=l2:layers=3:heads=max:sinks=0:keep_sinks=0:neighbors=1"),
    ("4K multikey", "ACRE stage 1, calibrated, 3 centred regions", "scorer/centered/4096/niah_multikey", "acre"),
    ("8K multikey", "full attention", "scorer/centered/8192/niah_multikey", "full"),
    ("8K multikey", "ACRE stage 1, calibrated, 3 centred regions", "scorer/centered/8192/niah_multikey", "acre"),
]


def _rows(folder: str, method: str) -> list[dict]:
    path = CELLS / folder / "predictions.jsonl"
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    mine = [r for r in rows if r["method"] == method]
    if not mine:
        raise SystemExit(f"{path} has no row {method!r}")
    return mine


# A cell names its adapter by run or file; the files (studies/adapters/, hashed in its README) and the one
# that ships (acre_train/resources/adapters/, the same weights as stage2-sim-lora-step120+120).
ADAPTERS = {
    "stage2-sim-long": "shipped: qwen2.5-0.5b-stage2-sim-lora-120",
    "qwen2.5-0.5b-stage2-sim-lora-120": "shipped: qwen2.5-0.5b-stage2-sim-lora-120",
    "stage1-long": "study: stage1-lora-step120",
    "stage2-lora-step120+120": "study: stage2-lora-step120+120",
    "stage2-sim-packed": "study: stage2-sim-packed-lora-step120+120",
}


def adapter_of(folder: str) -> str:
    """The adapter a cell's ACRE rows used: its cell.json record, else (the training ladder) its folder."""
    record = CELLS / folder / "cell.json"
    name = folder.rsplit("/", 1)[-1]
    if record.is_file():
        name = str(json.loads(record.read_text(encoding="utf-8")).get("adapter", "?")).removesuffix(".safetensors")
    return ADAPTERS.get(name, name)


def table() -> str:
    from acre_train.eval.metrics import bootstrap_ci, refill_split

    lines = ["| cell | row | L1 adapter | KV % | score (95 % CI) | answer contained % | evidence back whole | "
             "score when back (n) | predictions |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for cell, row, folder, method in ROWS:
        mine = _rows(folder, method)
        mean, low, high = bootstrap_ci([100.0 * r["score"] for r in mine])
        kv = 100.0 * sum(r["kv_attended"] / r["prompt_tokens"] for r in mine) / len(mine)
        contained = 100.0 * sum(r["substring"] for r in mine) / len(mine)
        split = refill_split(mine)
        whole = f"{split['refill_covered']:.1f} %" if split["refill_covered"] is not None else "–"
        back = (f"{split['score_when_refilled']:.1f} ({split['score_when_refilled_n']})"
                if split["score_when_refilled"] is not None else "–")
        shown = "– (the base)" if not method.startswith("acre") else f"`{adapter_of(folder)}`"
        lines.append(f"| {cell} | {row} | {shown} | {kv:.1f} | {mean:.1f} ({low:.1f}–{high:.1f}) | {contained:.1f} | "
                     f"{whole} | {back} | [{folder}](real-base/{folder}/predictions.jsonl) |")
    return "\n".join(lines) + "\n"


def splice(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{PAGE} needs the lines '{BEGIN}' and '{END}' around its summary table")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + BEGIN + "\n" + table() + END + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.real.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the page with the data; write nothing")
    args = parser.parse_args(argv)
    text = PAGE.read_text(encoding="utf-8")
    want = splice(text)
    if args.check:
        if text != want:
            print(f"out of date (run python -m studies.real.tables): {PAGE}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(want, encoding="utf-8")
    print(f"wrote the summary table of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
