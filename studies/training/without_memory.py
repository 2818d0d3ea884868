"""Ablation: a ladder row answering without its L1 memory, to see whether the memory is what makes a
refilled needle lose to another refilled needle nearer the question.

Not part of the installed package (it patches the engine in this process only). The row's weights,
cell, questions, scorer, selection and regions are the ladder's; the only change is that the refilled
cache keeps the refilled raw tokens (and the pending ones) but drops the L1 entries of the finished
chunks, rotated contiguously from 0 as before. The scoring pass still reads the L1 memory, so the same
spans are refilled and the rows pair question by question::

    python studies/training/without_memory.py --squad ../shared/data/squad-v2-dev.json \\
        --cell 4096/niah_multikey@centered --row stage2-sim-long

It writes docs/real-base/training/ladder/SWEEP/LENGTH/TASK/ROW.no-memory/ with ``paired.json`` against
the row's own cell.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scorer"))
sys.path.insert(0, str(HERE))

import ladder  # noqa: E402
import run as scorer_study  # noqa: E402
from acre_train.infer import engine as engine_module  # noqa: E402
from acre_train.infer.refill import Assembled  # noqa: E402
from acre_train.modeling.bilayer import refill_layout  # noqa: E402
from acre_train.modeling.rope import Rope  # noqa: E402


def assemble_without_memory(model, cache, selected, positions: str = "compact") -> Assembled:
    """The refilled raw tokens (spans in text order, pending last) without the L1 entries, at 0..P-1."""
    if positions != "compact":
        raise ValueError("the ablation keeps the compact layout")
    l2_index, _, _ = refill_layout(cache, selected)
    index = torch.as_tensor(l2_index)
    device = cache.l1_keys.device
    keys = cache.l2_keys.index_select(2, index).to(device, cache.l1_keys.dtype)
    values = cache.l2_values.index_select(2, index).to(device, cache.l1_values.dtype)
    return Assembled(keys=Rope.of(model).rotate(keys, torch.arange(len(l2_index))), values=values,
                     num_refilled=len(l2_index))


def main(argv: list[str] | None = None) -> int:
    args = ladder.row_parser(__doc__).parse_args(argv)
    length, task, sweep, setting, export, held = ladder.row_setup(args)
    root = Path(args.root)
    name = f"{args.row}.no-memory"
    out = ladder.ladder_dir(root / "eval" / "ladder", length, task, sweep) / name
    docs = ladder.ladder_dir(ladder.DOCS / "training/ladder", length, task, sweep) / name
    own = ladder.ladder_dir(ladder.DOCS / "training/ladder", length, task, sweep) / args.row
    engine_module.assemble = assemble_without_memory  # the engine calls assemble by this module-level name
    scorer_study.evaluate(export, length, task, held, out, rows=setting, adapter=f"{args.row}, without the L1 memory")
    comparison = scorer_study.publish(out, docs, own, setting, setting)
    ladder.log(f"cell {args.cell} {name}: {comparison['other_minus_base']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
