"""The training-free baselines on the 120 held-out questions of the scorer cells, paired with ACRE's row.

Not part of the installed package. Run from a checkout; it needs ACRE's committed centred cells only, and
answers through the untrained (stage 0) export, since the baselines ignore the L1 weights and the export
only supplies the base (``--squad`` builds that export and the SQuAD splits on a fresh machine)::

    python studies/scorer/baselines.py --squad ../shared/data/squad-v2-dev.json --cells 4096/niah_multikey,2048/squad

Each baseline gets at most the KV that ACRE's row attended in the same cell:

* ``truncated``: the last ``budget`` tokens of the context (budget = ACRE's attended KV);
* ``cachefocus:k_finish=K``: layer-adaptive document pruning down to ``K`` documents, ``K`` the largest
  whose kept KV stays at or under ACRE's (4K multikey: 1 of ~8 haystack documents; 2K SQuAD: 2 of ~10
  paragraphs);
* ``infoflow`` (``--infoflow``): attends the whole context (it recomputes 15 % of it instead of dropping
  any), so it is not at ACRE's budget; it says what a KV-preserving method gets (at 4K multikey it scored
  100.0 on the 40-question cell, docs/real-base/cells/4096/niah_multikey/base).

Questions, seeds (777-779) and generation settings are the centred cells' (docs/real-base/scorer/centered),
so every question pairs with ACRE's answer to it; the cell and ``paired-<row>.json`` per baseline go to
docs/real-base/scorer/baselines/LENGTH/TASK/ (``--infoflow``: baselines-infoflow/).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as study  # noqa: E402
from run import REPO, log  # noqa: E402

DOCS = REPO / "docs/real-base/scorer"
# cell -> the baseline rows, each at or under ACRE's attended KV in that cell
CELLS = {
    "4096/niah_multikey": "truncated:budget=758,cachefocus:k_finish=1",
    "2048/squad": "cachefocus:k_finish=2",
}


def main(argv: list[str] | None = None) -> int:
    parser = study.cell_parser(__doc__, CELLS)
    parser.add_argument("--infoflow", action="store_true", help="add infoflow (whole KV; its own folder)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    study.prepare(root, args.squad)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    for cell in args.cells.split(","):
        length, task = int(cell.split("/")[0]), cell.split("/")[1]
        acre_cell = DOCS / "centered" / cell
        if not (acre_cell / "predictions.jsonl").is_file():
            raise SystemExit(f"{acre_cell}: ACRE's centred cell is missing; run studies/scorer/grow.py --name centered")
        rows, name = ("infoflow", "baselines-infoflow") if args.infoflow else (CELLS[cell], "baselines")
        out, docs = root / "eval" / name / cell, DOCS / name / cell
        study.evaluate(root / "exports" / "stage0", length, task, root / "squad-heldout.json", out,
                       seeds=seeds, rows=rows, adapter="none (training-free baselines)", published=docs)
        shutil.rmtree(docs, ignore_errors=True)
        docs.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out, docs, ignore=shutil.ignore_patterns("calibration.*"))  # (ACRE's, not theirs)
        for row in rows.split(","):
            comparison = study.paired(acre_cell, "acre", out, row)
            (docs / f"paired-{row.split(':')[0]}.json").write_text(json.dumps(comparison, indent=2) + "\n")
            log(f"cell {cell}: {row} - acre {comparison['other_minus_base']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
