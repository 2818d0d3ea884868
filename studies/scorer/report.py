"""The scorer study's table, from the cells ``run.py`` copied into docs/real-base/scorer/.

    python studies/scorer/report.py            # writes docs/real-base/scorer/report.md and prints it

Every ACRE row reads as recall × answered-when-found: the share of questions whose whole evidence was
visible after refilling, the score over those and over the rest (95 % bootstrap intervals).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from acre_train.eval.metrics import bootstrap_ci

DOCS = Path(__file__).resolve().parents[2] / "docs/real-base/scorer"
NAMES = {"acre:scorer=l1:layers=-1": "acre, l1 scorer (today)", "acre": "acre, calibrated scorer"}


def _cell(folder: Path) -> list[str]:
    summary = json.loads((folder / "summary.json").read_text())["overall"]
    rows = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines() if line]
    calibration = json.loads((folder / "calibration.json").read_text())
    out = [f"### {folder.parent.name} tokens, {folder.name} ({summary[next(iter(summary))]['n']} questions)", "",
           f"Calibrated on the dev split: `{calibration['chosen']}` ({calibration['rows'][0]['n']} dev questions, "
           f"k = {calibration['k']} of {calibration['num_l1']} spans).", "",
           "| row | score (95 % CI) | KV % | whole evidence % | coverage % | overlap recall % | median rank | "
           "score when refilled | score when missed | answer s/question |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, e in summary.items():
        mine = [r for r in rows if r["method"] == label]
        mean, low, high = bootstrap_ci([100.0 * r["score"] for r in mine])
        kv = 100.0 * sum(r["kv_attended"] / r["prompt_tokens"] for r in mine) / len(mine)

        def part(name: str) -> str:
            if e.get(f"score_when_{name}") is None:
                return "–"
            lo, hi = e[f"score_when_{name}_ci"]
            return f"{e[f'score_when_{name}']:.1f} ({lo:.0f}–{hi:.0f}), n={e[f'score_when_{name}_n']}"

        refill = e.get("refill_coverage") is not None
        fmt = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
        out.append(f"| {NAMES.get(label, label)} | {mean:.1f} ({low:.1f}–{high:.1f}) | {kv:.1f} | "
                   f"{fmt(e.get('refill_covered')) if refill else '–'} | {fmt(e.get('refill_coverage'))} | "
                   f"{fmt(e.get('refill_recall'))} | {e.get('refill_rank_median') or '–'} | {part('refilled') if refill else '–'} | "
                   f"{part('missed') if refill else '–'} | {e['answer_s']:.2f} |")
    return out + [""]


def main() -> int:
    cells = sorted(p.parent for p in DOCS.glob("*/*/summary.json"))
    if not cells:
        print(f"no cells under {DOCS}", file=sys.stderr)
        return 1
    text = "\n".join(["# Refill scorers on the real 0.5B base (stage 1+2, 120 + 120 steps)", ""]
                     + [line for cell in cells for line in _cell(cell)])
    (DOCS / "report.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
