"""The training study's ladder on the real 0.5B base: stage 0, stage 1, stage 1+2 plain and refill-simulated,
each answering the same held-out cells with the same (plain row's calibrated) scorer, paired by question.

Not part of the installed package. Run from a checkout after ``acre-train base fetch
qwen2.5-coder-0.5b-instruct``; it needs no training and no earlier study root, only the adapters
committed in docs/real-base/adapters and the plain row's cells in docs/real-base/scorer::

    python studies/training/ladder.py --squad ../shared/data/squad-v2-dev.json --root checkpoints/scorer-study \\
        --cells 2048/squad:stage0+stage1-long,4096/niah_multikey:stage2-sim-long

Each ``LENGTH/TASK:ROW+ROW`` evaluates those rows (``stage0``: untrained L1, copies of the base's
projections; ``stage1-long``: stage 1, 120 steps; ``stage2-sim-long``: stage 1+2 in the refilled
layout, 120 + 120 steps) seed by seed (a finished seed is kept, so a session that ends mid-cell resumes)
and writes, per row, the cell and its paired comparison with the plain stage 1+2 row to
docs/real-base/training/ladder/LENGTH/TASK/ROW/. Where the plain cell has no full-attention row on
every question (4K multikey ran it on seed 777 only), ``--full`` adds it to the row's own cell, so the
answer-when-refilled can be set against full attention on the same questions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scorer"))
sys.path.insert(0, str(HERE))

import run as scorer_study  # noqa: E402
from run import EVAL_SEEDS, REPO, log  # noqa: E402
from sim import STAGE1, plain_cell, plain_setting  # noqa: E402

ADAPTERS = {"stage1-long": STAGE1, "stage2-sim-long": REPO / "docs/real-base/adapters/stage2-sim-lora-step120+120.safetensors"}
ROWS = ("stage0", *ADAPTERS)
DEFAULT_CELLS = "2048/squad:stage0+stage1-long,4096/niah_multikey:stage2-sim-long"


def exports(root: Path) -> dict[str, Path]:
    """Adapter-only exports of every ladder row onto the base, at the study's inference geometry."""
    from studies.real.study import RealConfig, RealStudy

    study = RealStudy(root, None, RealConfig(adapters={k: str(v) for k, v in ADAPTERS.items()}), log=log)
    if not all((study.export_dir(row) / "config.json").is_file() for row in ROWS):
        study.step_export()
    return {row: study.export_dir(row) for row in ROWS}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--squad", required=True, help="SQuAD v2 dev JSON (split by article)")
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="LENGTH/TASK:ROW+ROW,... (default: %(default)s)")
    parser.add_argument("--seeds", default=",".join(map(str, EVAL_SEEDS)))
    parser.add_argument("--full", action="store_true", help="also answer with full attention in each row's cell")
    parser.add_argument("--docs", default=str(REPO / "docs/real-base/training/ladder"))
    args = parser.parse_args(argv)
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
            out = root / "eval" / "ladder" / row / str(length) / task
            methods = ("full," if args.full else "") + setting
            scorer_study.evaluate(exported[row], length, task, held, out, seeds, rows=methods, adapter=row)
            docs = Path(args.docs) / str(length) / task / row
            shutil.rmtree(docs, ignore_errors=True)
            docs.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(out, docs)
            comparison = scorer_study.paired(plain, "acre", out, setting)
            (docs / "paired.json").write_text(json.dumps(comparison, indent=2) + "\n")
            log(f"cell {length}/{task} {row}: {json.dumps(comparison)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
