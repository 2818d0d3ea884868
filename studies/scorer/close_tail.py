"""close_tail on the real 0.5B base: the same held-out questions with the raw tail closed at build time.

Not part of the installed package. Run from a checkout, after ``studies/scorer/run.py`` made its root::

    python studies/scorer/close_tail.py --root checkpoints/scorer-study

``AcreEngine(close_tail=True)`` runs the context's unfinished raw tail once when the cache is built (it
then attends to the L1 memory, not to the refilled spans), so a question runs only its own tokens. This
evaluates the 2K SQuAD cell's 120 held-out questions with the same export and calibrated scorer as its
``acre`` row, only ``close_tail=1`` added, and writes the paired difference beside the cell.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as study  # noqa: E402
from run import REPO, log  # noqa: E402

CELLS = ("2048/squad", "4096/niah_multikey")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--cells", default=CELLS[0], help=f"LENGTH/TASK,... (of {', '.join(CELLS)})")
    parser.add_argument("--docs", default=str(REPO / "docs/real-base/scorer/close-tail"))
    args = parser.parse_args(argv)
    root = Path(args.root)
    for spec in args.cells.split(","):
        length, task = int(spec.split("/")[0]), spec.split("/")[1]
        export = root / "exports" / f"stage2-long-{length}-{task}"
        if not (export / "calibration.json").is_file():
            raise SystemExit(f"{export} is missing: run studies/scorer/run.py --root {root} --cells {spec} first")
        out = root / "eval" / "close-tail" / str(length) / task
        study.evaluate(export, length, task, root / "squad-heldout.json", out, rows="acre:close_tail=1")
        comparison = study.publish(out, Path(args.docs) / str(length) / task, root / "eval" / str(length) / task,
                                   "acre", "acre:close_tail=1")
        log(f"cell {spec}: close_tail - plain {comparison['other_minus_base']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
