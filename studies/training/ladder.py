"""The training study's ladder on the real 0.5B base: stage 0, stage 1 (CE and distilled), stage 1+2 plain,
refill-simulated and refill-simulated + distilled, each answering the same held-out cells with the same
inference setting, paired by question.

Not part of the installed package. Run from a checkout after ``acre-train base fetch
qwen2.5-coder-0.5b-instruct``; it needs no training and no earlier study root, only the adapters
committed in studies/adapters and the reference cells in docs/real-base/scorer::

    python studies/training/ladder.py --squad ../shared/data/squad-v2-dev.json --root checkpoints/scorer-study \\
        --cells 2048/squad:stage0+stage1-long,4096/niah_multikey:stage2-sim-long
    python studies/training/ladder.py --squad ../shared/data/squad-v2-dev.json \\
        --cells 8192/niah_multikey@centered:stage2-sim-long+stage2-sim-distill

Each ``LENGTH/TASK:ROW+ROW`` evaluates those rows (``stage0``: untrained L1, copies of the base's
projections; ``stage1-long``: stage 1, 120 steps; ``stage1-distill``: stage 1 distilled, 60 steps; ``stage2-long``: plain stage 1+2, 120 + 120 steps (a
sweep's cell only: elsewhere it is the reference row); ``stage2-sim-long``: stage 1+2 in the refilled layout, 120 + 120 steps; ``stage2-sim-distill``: the same
plus half the loss a KL to the frozen base; ``stage1-corpus``: stage 1, one epoch of the 1M-token corpus; ``stage2-sim-packed``: stage2-sim-long with
up to 4 questions per context in one sample) seed by seed (a finished seed is kept, so a session that ends
mid-cell resumes) with the plain stage 1+2 row's calibrated scorer, and writes, per row, the cell and its
paired comparison with that row to docs/real-base/training/ladder/LENGTH/TASK/ROW/. ``ROW.text`` answers with the row's weights and
setting but the refilled cache rotated at text positions (``positions=text``); ``ROW.eta2`` with twice the
refill budget (``max_refill=384``, a diagnostic: it attends more KV than the cell's other rows). ``LENGTH/TASK@SWEEP``
answers instead with a grown-refill sweep's committed calibration (``@centered``: the calibrated centred
regions of docs/real-base/scorer/centered/, the best setting at 4K and 8K multikey), pairs with that sweep's
own cell and writes to docs/real-base/training/ladder/SWEEP/LENGTH/TASK/ROW/. Where the reference cell has
no full-attention row on every question (4K multikey ran it on seed 777 only), ``--full`` adds it to the
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

ADAPTERS = {"stage1-long": STAGE1,
            # plain stage 1+2: the reference row of a cell without a sweep; a row of its own in a sweep's cell
            "stage2-long": REPO / "studies/adapters/stage2-lora-step120+120.safetensors",
            "stage2-sim-long": REPO / "studies/adapters/stage2-sim-lora-step120+120.safetensors",
            # stage 1 distilled from the frozen base, half the CE row's steps (acre-train reproduce real --steps
            # stage1-distill, then --steps export; the export's adapter file is copied here when it finishes)
            "stage1-distill": REPO / "studies/adapters/stage1-distill-lora-step60.safetensors",
            # stage2-sim-long plus half the loss a KL to the frozen base (sim.py --row stage2-sim-distill copies it here)
            "stage2-sim-distill": REPO / "studies/adapters/stage2-sim-distill-lora-step120+120.safetensors",
            # stage 1, one epoch of the 1M-token corpus (spans of 2K-8K tokens, 116 steps; acre-train reproduce
            # real --steps stage1-corpus, then --steps export; the export's adapter file is copied here)
            "stage1-corpus": REPO / "studies/adapters/stage1-corpus-lora-step116.safetensors",
            # stage2-sim-long with up to 4 questions per context packed in one sample (sim.py --row
            # stage2-sim-packed copies it here)
            "stage2-sim-packed": REPO / "studies/adapters/stage2-sim-packed-lora-step120+120.safetensors"}
ROWS = ("stage0", *ADAPTERS)
# ``ROW.VARIANT``: the row's weights answering with one inference option changed (same setting otherwise).
VARIANTS = {"text": ("positions=text", "text positions"),
            "eta2": ("max_refill=384", "twice the refill budget (eta 384: not at the cell's KV)")}
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


def parse_cells(spec: str) -> list[tuple[int, str, str | None, list[str]]]:
    """``LENGTH/TASK[@SWEEP][:ROW+ROW]`` -> (length, task, sweep or None, rows)."""
    cells = []
    for part in spec.split(","):
        where, _, rows = part.partition(":")
        where, _, sweep = where.partition("@")
        length, task = where.split("/")
        chosen = rows.split("+") if rows else [r for r in ROWS if sweep or r != "stage2-long"]
        if not sweep and "stage2-long" in chosen:
            raise SystemExit(f"cell {part!r}: stage2-long is the reference row of a cell without a sweep (already run)")
        unknown = [r for r in chosen if split_row(r)[0] not in ROWS or split_row(r)[1] not in ("", *VARIANTS)]
        if unknown:
            raise SystemExit(f"cell {part!r}: unknown row(s) {unknown}; rows are {list(ROWS)}")
        if sweep and not (DOCS / "scorer" / sweep / where / "calibration.json").is_file():
            raise SystemExit(f"cell {part!r}: docs/real-base/scorer/{sweep}/{where} has no calibration.json")
        cells.append((int(length), task, sweep or None, chosen))
    return cells


DOCS = REPO / "docs/real-base"
LABELS = {"stage0": "stage 0 (untrained L1)", "stage1-long": "stage 1 (120 steps)",
          "stage1-distill": "stage 1 distilled (60 steps)", "stage2-long": "stage 1+2 plain (120 + 120)",
          "stage2-sim-long": "stage 1+2 refill-simulated (120 + 120)",
          "stage2-sim-distill": "stage 1+2 refill-simulated + distilled (120 + 120)",
          "stage1-corpus": "stage 1, 1M-token corpus (1 epoch, 116 steps)",
          "stage2-sim-packed": "stage 1+2 refill-simulated, 4 questions per sample (120 + 120)"}
LABELS.update({f"{row}.{v}": f"{label}, {text}" for v, (_, text) in VARIANTS.items() for row, label in list(LABELS.items())})


def split_row(row: str) -> tuple[str, str]:
    """``stage2-sim-long.text`` -> (``stage2-sim-long``, ``text``); a plain row has no variant."""
    name, _, variant = row.partition(".")
    return name, variant


def row_method(method: str, row: str) -> str:
    """The harness method a (variant) row answers with: the cell's setting plus the variant's option."""
    variant = split_row(row)[1]
    return f"{method}:{VARIANTS[variant][0]}" if variant else method


def reference(root: Path, length: int, task: str, sweep: str | None) -> tuple[str, Path, str]:
    """(the method every row answers with, the reference cell, the reference row's name).

    Without a sweep the rows answer with the plain stage 1+2 row's calibrated setting and are paired with
    that row's cell. With one (``@centered``) they answer with that sweep's committed calibration, written
    into a copy of each row's export, and are paired with the sweep's own cell (grow.py's trained row)."""
    if sweep is None:
        calibration, plain = plain_cell(root, length, task)
        return plain_setting(calibration), plain, "stage2-long"
    from grow import CELLS as GROWN

    return "acre", DOCS / "scorer" / sweep / f"{length}/{task}", GROWN[f"{length}/{task}"][0]


def row_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a script that re-answers one ladder row's cell (without_memory.py, sparse_full.py)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--squad", required=True)
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--cell", default="4096/niah_multikey@centered", help="LENGTH/TASK[@SWEEP]")
    parser.add_argument("--row", default="stage2-sim-long", choices=ROWS)
    return parser


def row_setup(args: argparse.Namespace) -> tuple[int, str, str | None, str, Path, Path]:
    """``(length, task, sweep, setting, export, held-out SQuAD)`` of ``row_parser``'s cell and row, as the
    ladder answers it (a sweep's committed calibration written into a copy of the row's export)."""
    ((length, task, sweep, _),) = parse_cells(f"{args.cell}:{args.row}")
    root = Path(args.root)
    setting, _, _ = reference(root, length, task, sweep)
    export = exports(root)[args.row]
    if sweep:
        export = scorer_study.with_calibration(export, root / "exports" / f"ladder-{sweep}-{length}-{task}-{args.row}",
                                               DOCS / "scorer" / sweep / f"{length}/{task}" / "calibration.json")
    _, held = scorer_study.squad_splits(root, Path(args.squad))
    return length, task, sweep, setting, export, held


def ladder_dir(base: Path, length: int, task: str, sweep: str | None) -> Path:
    return (base / sweep if sweep else base) / str(length) / task


def committed_rows(length: int, task: str, sweep: str | None = None) -> list[tuple[str, Path, str]]:
    """Each row's committed cell for (length, task[, sweep]): (label, folder, the row's method in it)."""
    method, ref_folder, ref_row = reference(Path("/nonexistent"), length, task, sweep)
    cell = ladder_dir(DOCS / "training/ladder", length, task, sweep)
    candidates = []
    for row, label in LABELS.items():
        if row == ref_row:
            candidates.append((label, ref_folder, "acre"))
        if sweep is None and row == "stage2-sim-long":  # the row's first cell, from sim.py
            candidates.append((label, DOCS / "training" / f"{length}/{task}", method))
        candidates.append((label, cell / row, row_method(method, row)))
    seen, out = set(), []
    for label, folder, answered_with in candidates:
        if label not in seen and (folder / "predictions.jsonl").is_file():
            seen.add(label)
            out.append((label, folder, answered_with))
    return out


def _full_scores(folder: Path) -> list[float]:
    return [100.0 * r["score"] for r in map(json.loads, (folder / "predictions.jsonl").read_text().splitlines())
            if r["method"] == "full"]


def _full_cell(length: int, task: str, folders: list[Path]) -> Path | None:
    """The committed cell with the most full-attention answers to these held-out questions (the scorer
    study's cells share the seeds, so their question ids pair)."""
    cell = f"{length}/{task}"
    candidates = [*folders, DOCS / "scorer" / cell, *sorted(DOCS.glob(f"scorer/*/{cell}"))]
    counted = [(len(_full_scores(f)), f) for f in candidates if (f / "predictions.jsonl").is_file()]
    best = max(counted, key=lambda x: x[0], default=(0, None))
    return best[1] if best[0] else None


def _full_line(folder: Path | None) -> str:
    from acre_train.eval.metrics import bootstrap_ci

    if folder is None:
        return "No full-attention row on these questions."
    scores = _full_scores(folder)
    mean, low, high = bootstrap_ci(scores)
    return (f"Full attention (the untrained base): {mean:.1f} ({low:.1f}–{high:.1f}), n={len(scores)} "
            f"({folder.relative_to(DOCS)}).")


def report(cells: list[tuple[int, str, str | None]], spec: str) -> str:
    """The ladder's table per cell, every row paired with the cell's reference row on the same questions."""
    lines = ["# The training ladder on the real 0.5B base", "",
             "Every row of a table answers the same held-out questions with the same inference setting, so a",
             "difference is the L1 weights' alone: the plain stage 1+2 row's calibrated scorer, or, for a cell",
             "named `@SWEEP`, that sweep's committed calibration (docs/real-base/scorer/SWEEP/). Generated by",
             f"`python studies/training/ladder.py --report-only --cells {spec}` from the committed cells.", ""]
    for length, task, sweep in cells:
        setting, ref_folder, ref_row = reference(Path("/nonexistent"), length, task, sweep)
        if setting == "acre":
            setting = json.loads((ref_folder / "calibration.json").read_text())["chosen"]
        rows = committed_rows(length, task, sweep)
        lines += [f"## {length} tokens, {task}" + (f", {sweep}" if sweep else ""), "",
                  f"Setting: `{setting}`. Reference row: {LABELS[ref_row]}.", "",
                  "| row | score (95 % CI) | whole evidence % | when refilled (n) | when missed (n) | full when refilled | "
                  "paired − reference (95 % CI) | paired − stage 0 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        stage0 = next(((f, m) for label, f, m in rows if label.startswith("stage 0")), None)

        def diff(base: tuple[Path, str] | None, folder: Path, method: str) -> str:
            if base is None or base[0] == folder:
                return "–"
            d = scorer_study.paired(base[0], base[1], folder, method)["other_minus_base"]
            return f"{d[0]:+.1f} ({d[1]:+.1f} … {d[2]:+.1f})"

        full_cell = _full_cell(length, task, [ref_folder, *(f for _, f, _ in rows)])
        for label, folder, method in rows:
            c = scorer_study.paired(ref_folder, "acre", folder, method)
            r = c["other_row"]
            # full attention on the questions this row refilled, wherever the cell's full row lives
            full = scorer_study.paired(full_cell, "full", folder, method)["other_row"].get("full_when_refilled") \
                if full_cell else None
            lines.append(
                f"| {label} | {r['score'][0]:.1f} ({r['score'][1]:.1f}–{r['score'][2]:.1f}) | {r['refill_covered']:.1f} | "
                f"{r['score_when_refilled']:.1f} ({r['score_when_refilled_n']}) | {r['score_when_missed']:.1f} "
                f"({r['score_when_missed_n']}) | {f'{full[0]:.1f}' if full else '–'} | {diff((ref_folder, 'acre'), folder, method)} | "
                f"{diff(stage0, folder, method)} |")
        lines.append(f"\n{c['n']} questions in every pairing. {_full_line(full_cell)}")
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
        cells = [(length, task, sweep) for length, task, sweep, _ in parse_cells(args.cells)]
        out = Path(args.docs) / "README.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report(cells, args.cells) + "\n")
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
    for length, task, sweep, rows in cells:
        setting, ref_folder, _ = reference(root, length, task, sweep)
        for row in rows:
            weights = split_row(row)[0]
            if weights not in exported:
                raise SystemExit(f"row {row}: its adapter {ADAPTERS[weights]} is not here yet (see ADAPTERS)")
            export = exported[weights]
            if sweep:  # the sweep's committed choice, written into a copy of the row's export
                export = scorer_study.with_calibration(export, root / "exports" / f"ladder-{sweep}-{length}-{task}-{weights}",
                                                       ref_folder / "calibration.json")
            out = ladder_dir(root / "eval" / "ladder", length, task, sweep) / row
            docs = ladder_dir(Path(args.docs), length, task, sweep) / row
            method = row_method(setting, row)
            methods = ("full," if args.full else "") + method
            scorer_study.evaluate(export, length, task, held, out, seeds, rows=methods, adapter=weights, published=docs)
            publish_cell(out, docs, ref_folder, method, f"{length}/{task} {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
