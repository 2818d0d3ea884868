"""Grown refills (``refill.grow``) on the real 0.5B base: the held-out cells with the best trained row of each.

Not part of the installed package. Run from a checkout (``--squad ../shared/data/squad-v2-dev.json`` builds
the root's exports and SQuAD splits on a fresh machine)::

    python studies/scorer/grow.py --root checkpoints/scorer-study --cells 4096/niah_multikey,2048/squad
    python studies/scorer/grow.py --name centered --grow-shapes attention,centered --cells 4096/niah_multikey
    python studies/scorer/grow.py --name centered --grow-shapes attention,centered --cells 8192/niah_multikey
    python studies/scorer/grow.py --name densest --grow-shapes centered,densest --layers 7,9,7+9 --cells 2048/squad
    python studies/scorer/grow.py --name sink-tokens --grow-shapes densest --layers 9,7+9 --keep-sinks spans,tokens --cells 2048/squad
    python studies/scorer/grow.py --name question --grow-shapes densest,sentences --layers 7+9 --cells 2048/squad
    python studies/scorer/grow.py --name unscored-kept --grow-shapes sentences --layers 7+9 --keep-sinks spans,tokens \
        --unscored 0,8,16,32 --queries question --cells 2048/squad

Per cell it copies the best trained row's adapter-only export (4K multikey: stage 1, 120 steps; 2K SQuAD:
stage 1+2 refill-simulated), lets ``acre-train calibrate`` choose scorer and selection on the *dev* split
(the same dev questions as every other calibration: needles at seed 1000, SQuAD training articles;
``--grow`` swept beside whole spans and neighbours), evaluates the 120 held-out questions (seeds 777-779)
with the chosen setting, and pairs every question with that row's committed cell (the same export and
questions, whole-span selection). Where the docs already hold the cell's calibration, a fresh
machine writes that choice into its copy of the export instead of calibrating again. ``--grow-shapes`` is swept by calibrate (``attention``: regions grow
toward the most-attended token; ``centered``: an even share of the budget centred on each seed); ``--name``
keeps each sweep's export, evaluation and docs apart (docs/real-base/scorer/NAME/); calibrate sweeps
``query=all`` and ``query=question`` by default, so sweeps choose between them. ``--full`` adds full attention on the seeds whose committed cell
lacks it, so the answer-when-refilled can be set against full attention on the same questions.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as study  # noqa: E402
from run import DEV_SEED, REPO, log  # noqa: E402

DOCS = REPO / "docs/real-base"
# cell -> (export it starts from, its committed cell, that cell's method, calibration layer, dev questions).
# A cell with no committed cell (8K) is evaluated with full attention beside ACRE and paired against it.
CELLS = {
    "4096/niah_multikey": ("stage1-long", DOCS / "training/ladder/4096/niah_multikey/stage1-long",
                           "acre:scorer=l2:layers=3:heads=max:sinks=0:keep_sinks=0:neighbors=1", 3, 60),
    "2048/squad": ("stage2-sim-long", DOCS / "training/2048/squad",
                   "acre:scorer=l2:layers=7:heads=max:sinks=4:keep_sinks=1:neighbors=1", 7, 100),
    "8192/niah_multikey": ("stage1-long", None, None, 3, 60),
}


def calibrated_export(root: Path, cell: str, name: str = "grow", shapes: str = "attention",
                      layers: str | None = None, keep_sinks: str | None = None, unscored: str | None = None,
                      queries: str | None = None) -> Path:
    length, task = cell.split("/")
    start, _, _, layer, count = CELLS[cell]
    layer = layers or layer
    export = root / "exports" / f"{name}-{length}-{task}"
    if (export / "calibration.json").is_file():
        return export
    committed = DOCS / "scorer" / name / cell / "calibration.json"
    if committed.is_file():  # a fresh machine: write the committed choice into the copy instead of re-calibrating
        return study.with_calibration(root / "exports" / start, export, committed)
    tmp = export.with_name(export.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(root / "exports" / start, tmp)
    cmd = ["acre-train", "calibrate", str(tmp), "--data", task, "--squad", str(root / "squad-train.json"),
           "--context-tokens", length, "--num-examples", str(count), "--seed", str(DEV_SEED), "--scorers", "l2",
           "--layers", str(layer), "--heads", "max", "--sinks", "0,4", "--grow-shapes", shapes, "--no-progress",
           *(["--keep-sinks", keep_sinks] if keep_sinks else []), *(["--unscored", unscored] if unscored else []),
           *(["--queries", queries] if queries else [])]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    shutil.rmtree(export, ignore_errors=True)
    tmp.replace(export)
    return export


def main(argv: list[str] | None = None) -> int:
    parser = study.cell_parser(__doc__, CELLS)
    parser.add_argument("--full", action="store_true", help="add full attention (4K multikey: its cell has none)")
    parser.add_argument("--name", default="grow", help="names this sweep's export, evaluation and docs folder")
    parser.add_argument("--grow-shapes", default="attention", help="calibrate's --grow-shapes (attention,centered,densest)")
    parser.add_argument("--layers", default=None, help="calibrate's --layers, e.g. 7,9,7+9 (default: the cell's one layer)")
    parser.add_argument("--keep-sinks", default=None, help="calibrate's --keep-sinks, e.g. spans,tokens (default: spans)")
    parser.add_argument("--unscored", default=None, help="calibrate's --unscored, e.g. 0,8,16,32 (default: 0)")
    parser.add_argument("--queries", default=None, help="calibrate's --queries, e.g. question (default: all,question)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    study.prepare(root, args.squad)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    for cell in args.cells.split(","):
        length, task = int(cell.split("/")[0]), cell.split("/")[1]
        start, committed, method, _, _ = CELLS[cell]
        export = calibrated_export(root, cell, args.name, args.grow_shapes, args.layers, args.keep_sinks,
                                   args.unscored, args.queries)
        chosen = json.loads((export / "calibration.json").read_text())["rows"][0]
        if not chosen.get("grow") and committed:
            log(f"cell {cell}: calibration kept whole spans ({chosen['setting']}); {committed} measures that setting")
            continue
        out = root / "eval" / args.name / str(length) / task
        rows = "acre,full" if args.full or committed is None else "acre"
        docs = DOCS / "scorer" / args.name / str(length) / task
        study.evaluate(export, length, task, root / "squad-heldout.json", out, seeds=seeds, rows=rows, adapter=start,
                       published=docs)
        base_dir, base_row = (committed, method) if committed else (out, "full")
        comparison = study.publish(out, docs, base_dir, base_row, "acre")
        log(f"cell {cell}: grown - {base_row} {comparison['other_minus_base']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
