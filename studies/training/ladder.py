"""The training study's ladder on the real 0.5B base: stage 0, stage 1, stage 1+2 plain and refill-simulated,
each answering the same held-out cells with the same (plain row's calibrated) scorer, paired by question.

Not part of the installed package. Run from a checkout after ``acre-train base fetch
qwen2.5-coder-0.5b-instruct``; it needs no training and no earlier study root, only the adapters
committed in studies/adapters and the plain row's cells in docs/real-base/scorer::

    python studies/training/ladder.py --squad ../shared/data/squad-v2-dev.json --root checkpoints/scorer-study \\
        --cells 2048/squad:stage0+stage1-long,4096/niah_multikey:stage2-sim-long

Each ``LENGTH/TASK:ROW+ROW`` evaluates those rows (``stage0``: untrained L1, copies of the base's
projections; ``stage1-long``: stage 1, 120 steps; ``stage2-sim-long``: stage 1+2 in the refilled layout,
120 + 120 steps; ``stage1-distill``: stage 1 distilled, 60 steps) seed by seed (a finished seed is kept,
so a session that ends mid-cell resumes) and writes, per row, the cell and its paired comparison with
the plain stage 1+2 row to docs/real-base/training/ladder/LENGTH/TASK/ROW/. Where the plain cell has no
full-attention row on every question (4K multikey ran it on seed 777 only), ``--full`` adds it to the
row's own cell, so the answer-when-refilled can be set against full attention on the same questions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scorer"))
sys.path.insert(0, str(HERE))

import run as scorer_study  # noqa: E402
from run import EVAL_SEEDS, REPO, log  # noqa: E402
from sim import STAGE1, plain_cell, plain_setting, publish_cell  # noqa: E402

ADAPTERS = {"stage1-long": STAGE1, "stage2-sim-long": REPO / "studies/adapters/stage2-sim-lora-step120+120.safetensors",
            # stage 1 distilled from the frozen base, half the CE row's steps (acre-train reproduce real --steps
            # stage1-distill, then --steps export; the export's adapter file is copied here when it finishes)
            "stage1-distill": REPO / "studies/adapters/stage1-distill-lora-step60.safetensors",
            # stage2-sim-long plus half the loss a KL to the frozen base (sim.py --row stage2-sim-distill copies it here)
            "stage2-sim-distill": REPO / "studies/adapters/stage2-sim-distill-lora-step120+120.safetensors"}
ROWS = ("stage0", *ADAPTERS)
DEFAULT_CELLS = "2048/squad:stage0+stage1-long,4096/niah_multikey:stage2-sim-long"


def exports(root: Path) -> dict[str, Path]:
    """Adapter-only exports of every ladder row onto the base, at the study's inference geometry."""
    from studies.real.study import RealConfig, RealStudy

    kept = {k: str(v) for k, v in ADAPTERS.items() if v.is_file()}
    study = RealStudy(root, None, RealConfig(adapters=kept), log=log)
    rows = ("stage0", *kept)
    if not all((study.export_dir(row) / "config.json").is_file() for row in rows):
        study.step_export()
    return {row: study.export_dir(row) for row in rows}


def parse_cells(spec: str) -> list[tuple[int, str, list[str]]]:
    cells = []
    for part in spec.split(","):
        where, _, rows = part.partition(":")
        length, task = where.split("/")
        chosen = rows.split("+") if rows else list(ROWS)
        unknown = [r for r in chosen if r not in ROWS]
        if unknown:
            raise SystemExit(f"cell {part!r}: unknown row(s) {unknown}; rows are {list(ROWS)}")
        cells.append((int(length), task, chosen))
    return cells


# Where each row's committed cell lives, per (length, task): (label, folder, the row's method in it).
DOCS = REPO / "docs/real-base"


def committed_rows(length: int, task: str, setting: str) -> list[tuple[str, Path, str]]:
    cell = f"{length}/{task}"
    rows = [("stage 0 (untrained L1)", DOCS / "training/ladder" / cell / "stage0", setting),
            ("stage 1 (120 steps)", DOCS / "training/ladder" / cell / "stage1-long", setting),
            ("stage 1 distilled (60 steps)", DOCS / "training/ladder" / cell / "stage1-distill", setting),
            ("stage 1+2 plain (120 + 120)", DOCS / "scorer" / cell, "acre"),
            ("stage 1+2 refill-simulated (120 + 120)", DOCS / "training" / cell, setting),
            ("stage 1+2 refill-simulated (120 + 120)", DOCS / "training/ladder" / cell / "stage2-sim-long", setting),
            ("stage 1+2 refill-simulated + distilled (120 + 120)", DOCS / "training/ladder" / cell / "stage2-sim-distill",
             setting)]
    seen, out = set(), []
    for label, folder, method in rows:
        if label not in seen and (folder / "predictions.jsonl").is_file():
            seen.add(label)
            out.append((label, folder, method))
    return out


def _full_scores(folder: Path) -> list[float]:
    return [100.0 * r["score"] for r in map(json.loads, (folder / "predictions.jsonl").read_text().splitlines())
            if r["method"] == "full"]


def _full_line(folders: list[Path]) -> str:
    """Full attention's score on the cell's questions, from the first folder that has a ``full`` row."""
    from acre_train.eval.metrics import bootstrap_ci

    for folder in folders:
        scores = _full_scores(folder)
        if scores:
            mean, low, high = bootstrap_ci(scores)
            return f"Full attention (the untrained base): {mean:.1f} ({low:.1f}–{high:.1f}), n={len(scores)}."
    return "No full-attention row on these questions."


def report(cells: list[tuple[int, str]]) -> str:
    """The ladder's table per cell, every row paired with the plain stage 1+2 row on the same questions."""
    lines = ["# The training ladder on the real 0.5B base", "",
             "Every row answers the same held-out questions with the same inference setting (the plain row's",
             "calibrated scorer for the cell), so a difference is the L1 weights' alone. Generated by",
             "`python studies/training/ladder.py --report-only --cells 2048/squad,4096/niah_multikey` from the committed cells.", ""]
    for length, task in cells:
        calibration, plain = plain_cell(Path("/nonexistent"), length, task)
        setting = plain_setting(calibration)
        rows = committed_rows(length, task, setting)
        lines += [f"## {length} tokens, {task}", "", f"Scorer: `{setting}`.", "",
                  "| row | score (95 % CI) | whole evidence % | when refilled (n) | when missed (n) | full when refilled | "
                  "paired − plain (95 % CI) | paired − stage 0 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        stage0 = next(((f, m) for label, f, m in rows if label.startswith("stage 0")), None)

        def diff(base: tuple[Path, str] | None, folder: Path, method: str) -> str:
            if base is None or base[0] == folder:
                return "–"
            d = scorer_study.paired(base[0], base[1], folder, method)["other_minus_base"]
            return f"{d[0]:+.1f} ({d[1]:+.1f} … {d[2]:+.1f})"

        full_cell = next((f for f in [plain, *(f for _, f, _ in rows)] if _full_scores(f)), None)
        for label, folder, method in rows:
            c = scorer_study.paired(plain, "acre", folder, method)
            r = c["other_row"]
            # full attention on the questions this row refilled, wherever the cell's full row lives
            full = scorer_study.paired(full_cell, "full", folder, method)["other_row"].get("full_when_refilled") \
                if full_cell else None
            lines.append(
                f"| {label} | {r['score'][0]:.1f} ({r['score'][1]:.1f}–{r['score'][2]:.1f}) | {r['refill_covered']:.1f} | "
                f"{r['score_when_refilled']:.1f} ({r['score_when_refilled_n']}) | {r['score_when_missed']:.1f} "
                f"({r['score_when_missed_n']}) | {f'{full[0]:.1f}' if full else '–'} | {diff((plain, 'acre'), folder, method)} | "
                f"{diff(stage0, folder, method)} |")
        lines.append(f"\n{c['n']} questions in every pairing. {_full_line([plain, *(f for _, f, _ in rows)])}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--squad", help="SQuAD v2 dev JSON (split by article; needed unless --report-only)")
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="LENGTH/TASK:ROW+ROW,... (default: %(default)s)")
    parser.add_argument("--seeds", default=",".join(map(str, EVAL_SEEDS)))
    parser.add_argument("--full", action="store_true", help="also answer with full attention in each row's cell")
    parser.add_argument("--docs", default=str(REPO / "docs/real-base/training/ladder"))
    parser.add_argument("--report-only", action="store_true", help="only rewrite the table from the committed cells")
    args = parser.parse_args(argv)
    if args.report_only:
        cells = [(length, task) for length, task, _ in parse_cells(args.cells)]
        out = Path(args.docs) / "README.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report(cells) + "\n")
        print(out.read_text())
        return 0
    if not args.squad:
        parser.error("--squad is required to evaluate (or pass --report-only)")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    cells = parse_cells(args.cells)
    exported = exports(root)
    _, held = scorer_study.squad_splits(root, Path(args.squad))
    seeds = tuple(int(x) for x in args.seeds.split(","))
    for length, task, rows in cells:
        calibration, plain = plain_cell(root, length, task)
        setting = plain_setting(calibration)
        for row in rows:
            if row not in exported:
                raise SystemExit(f"row {row}: its adapter {ADAPTERS[row]} is not here yet (see ADAPTERS)")
            out = root / "eval" / "ladder" / row / str(length) / task
            methods = ("full," if args.full else "") + setting
            scorer_study.evaluate(exported[row], length, task, held, out, seeds, rows=methods, adapter=row)
            publish_cell(out, Path(args.docs) / str(length) / task / row, plain, setting, f"{length}/{task} {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
