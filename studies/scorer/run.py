"""The scorer study on the real 0.5B base: calibrate on dev questions, then compare scorers on held-out ones.

Not part of the installed package. Run from a checkout after ``acre-train base fetch
qwen2.5-coder-0.5b-instruct``::

    python studies/scorer/run.py --squad ../shared/data/squad-v2-dev.json --root checkpoints/scorer-study

Steps (each skipped when its output exists, so a killed run resumes at the step it was in):

1. export the stage-1+2 (120 + 120 steps) LoRA adapter kept in studies/adapters onto the base,
   one copy per (length, task) so each carries its own calibrated scorer;
2. ``acre-train calibrate`` on the dev split: SQuAD *training* articles (even index) and needles at
   seed 1000 (the evaluation uses 777-779);
3. evaluate the held-out cell (SQuAD odd-index articles, needles at seeds 777-779; 3 × 40 = 120
   questions) with full attention, truncation to ACRE's budget, today's ``l1`` scorer and the
   calibrated one, one seed at a time (a finished seed is kept: ``--seeds 777`` runs one and merges
   what is done; a later run adds the others); the cell folder (predictions, summary, table, and
   ``cell.json`` naming its seeds) is copied into docs/real-base/scorer/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # the studies package of this checkout (not installed)
ADAPTER = REPO / "studies/adapters/stage2-lora-step120+120.safetensors"
BASE = "base:qwen2.5-coder-0.5b-instruct"
# (length, task) -> (truncation budget = ACRE's attended KV, max new tokens, rows, dev questions).
# At 4K multikey full attention (100.0) and truncation to ACRE's budget (22.5) were measured on the
# earlier 40-question cell (docs/real-base/cells/4096/niah_multikey/base); they are left out here to
# fit the session's CPU time.
CELLS = {
    (2048, "squad"): (493, 16, "full,truncated:budget={budget},acre:scorer=l1:layers=-1,acre", 100),
    (4096, "niah_multikey"): (760, 48, "acre:scorer=l1:layers=-1,acre", 60),
    (8192, "niah_multikey"): (None, 48, "acre,full", 60),  # (grow.py's 8K cell; truncation's budget comes after)
}
LAYERS = "2,3,5,7,9,12,16,20,23"
EVAL_SEEDS = (777, 778, 779)
DEV_SEED = 1000


def cell_parser(doc: str, cells) -> argparse.ArgumentParser:
    """The options every held-out cell script shares: its study root, the cells and the seeds."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--cells", default=",".join(cells), help=f"comma-separated, of {', '.join(cells)}")
    parser.add_argument("--seeds", default=",".join(str(s) for s in EVAL_SEEDS))
    parser.add_argument("--squad", help="SQuAD v2 dev JSON: on a fresh machine, builds the root's exports of the "
                        "committed adapters and its SQuAD splits first (kept when present)")
    return parser


def offline_main(doc: str, folder: str, dump, compare, argv: list[str] | None = None) -> int:
    """``dump`` / ``compare`` of an offline dev replay (sentences.py, regions.py): ``dump(root, path)`` runs the
    product on the dev questions and saves what its selection was given to ``ROOT/<folder>/2048-squad.npy``;
    ``compare(root, path)`` replays rules on it."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("what", choices=("dump", "compare"))
    parser.add_argument("--root", default="checkpoints/scorer-study")
    args = parser.parse_args(argv)
    root = Path(args.root)
    (dump if args.what == "dump" else compare)(root, root / folder / "2048-squad.npy")
    return 0


def prepare(root: Path, squad: str | None) -> None:
    """What a held-out cell script needs in its root on a fresh machine: adapter-only exports of every
    committed adapter (studies/adapters) and the dev / held-out SQuAD splits. Each is skipped when present."""
    if squad is None:
        return
    sys.path.insert(0, str(HERE.parent / "training"))
    from ladder import exports

    root.mkdir(parents=True, exist_ok=True)
    exports(root)
    squad_splits(root, Path(squad))


def with_calibration(source: Path, dest: Path, committed: Path) -> Path:
    """A copy of the export ``source`` at ``dest`` that answers with the choice of a committed calibration
    table (a published cell's ``calibration.json``) without calibrating again; an existing copy is kept."""
    from acre_train.eval.calibrate import write_choice

    if (dest / "calibration.json").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    table = json.loads(committed.read_text())
    write_choice(tmp, table["rows"], {k: v for k, v in table.items() if k not in ("chosen", "rows")})
    log(f"{dest.name}: calibration taken from {committed} ({table['chosen']})")
    tmp.replace(dest)
    return dest


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def export(root: Path) -> Path:
    from studies.real.study import RealConfig, RealStudy

    study = RealStudy(root, None, RealConfig(adapters={"stage2-long": str(ADAPTER)}), log=log)
    out = study.export_dir("stage2-long")
    if not (out / "config.json").is_file():
        study.step_export()
    return out


def squad_splits(root: Path, squad: Path) -> tuple[Path, Path]:
    from acre_train.data.squad import split_articles, subset_squad

    train, held = split_articles(squad)
    dev, evals = root / "squad-train.json", root / "squad-heldout.json"
    if not dev.is_file():
        subset_squad(squad, train, dev)
    if not evals.is_file():
        subset_squad(squad, held, evals)
    return dev, evals


def calibrate(exported: Path, cell_export: Path, length: int, task: str, dev_squad: Path) -> None:
    if (cell_export / "calibration.json").is_file():
        return
    tmp = cell_export.with_name(cell_export.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(exported, tmp)
    cmd = ["acre-train", "calibrate", str(tmp), "--data", task, "--squad", str(dev_squad),
           "--context-tokens", str(length), "--num-examples", str(CELLS[(length, task)][3]), "--seed", str(DEV_SEED),
           "--layers", LAYERS]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    shutil.rmtree(cell_export, ignore_errors=True)
    tmp.replace(cell_export)


def _seed_from_published(published: Path, task: str, seed: int, part: Path, labels: list[str]) -> bool:
    """Rebuild one seed's part from a committed cell that holds it with exactly the rows ``labels``, so a
    fresh machine (whose study root has no parts) only runs the seeds the committed cell lacks. Its seconds
    are the cell's mean per seed."""
    from acre_train.eval.harness import EvalReport, summarize, write_outputs

    cell = published / "cell.json"
    if not cell.is_file() or seed not in json.loads(cell.read_text()).get("seeds", []):
        return False
    info = json.loads(cell.read_text())
    rows = [r for r in map(json.loads, (published / "predictions.jsonl").read_text().splitlines())
            if r["id"].startswith(f"{task}-{seed}-")]
    if sorted(set(r["method"] for r in rows)) != sorted(labels):
        return False  # (other rows than this run asks for: run the seed)
    tmp = part.with_name(part.name + ".rebuilt")
    shutil.rmtree(tmp, ignore_errors=True)
    write_outputs(EvalReport(rows, summarize(rows, list(dict.fromkeys(r["method"] for r in rows)))), tmp)
    (tmp / "cell.json").write_text(json.dumps({"seconds": round(info["seconds"] / len(info["seeds"]), 1), "seed": seed,
                                               "from": str(published)}) + "\n")
    tmp.replace(part)
    return True


def evaluate(cell_export: Path, length: int, task: str, held_squad: Path, out: Path,
             seeds: tuple[int, ...] = EVAL_SEEDS, rows: str | None = None, adapter: str = ADAPTER.name,
             published: Path | None = None) -> None:
    """Evaluate the cell one seed (40 questions) at a time: each seed's part is kept when it finishes, so a
    session that ends mid-cell resumes at the next seed; the parts are merged into ``out`` at the end.
    A seed that the committed cell ``published`` already holds is taken from it instead of re-run."""
    import torch

    from acre_train.data.tokenizer import auto_tokenizer
    from acre_train.base.fetch import resolve_source
    from acre_train.eval.harness import EvalConfig, EvalReport, evaluate as run_eval, summarize, write_outputs
    from acre_train.eval.methods import parse_methods
    from acre_train.eval.tasks import build_task
    from acre_train.infer.load import load_export

    done = out / "cell.json"
    if (out / "summary.json").is_file() and done.is_file() and json.loads(done.read_text()).get("seeds") == list(seeds):
        return  # (a cell merged from fewer seeds is merged again with the new ones; finished seeds are kept)
    budget, new_tokens, cell_rows, _ = CELLS[(length, task)]
    methods = parse_methods((rows or cell_rows).format(budget=budget))
    model, _, _ = load_export(cell_export, dtype=torch.float32)
    tok = auto_tokenizer(resolve_source(BASE))
    parts = out.with_name(out.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        part = parts / str(seed)
        if (part / "summary.json").is_file():
            log(f"eval {length}/{task} seed {seed}: done earlier ({part})")
            continue
        if published is not None and _seed_from_published(published, task, seed, part, [m.label() for m in methods]):
            log(f"eval {length}/{task} seed {seed}: taken from the committed cell {published}")
            continue
        examples = build_task(task, tok, length, 40, seed, squad_path=held_squad, questions_per_context=4)
        log(f"eval {length}/{task} seed {seed}: {len(examples)} questions, rows {[m.label() for m in methods]}")
        tmp = part.with_name(part.name + ".partial")  # (kept: the harness resumes a seed cut short)
        tic = time.time()
        run_eval(model, tok, examples, methods, config=EvalConfig(new_tokens, progress=False), out_dir=tmp)
        (tmp / "cell.json").write_text(json.dumps({"seconds": round(time.time() - tic, 1), "seed": seed}) + "\n")
        tmp.replace(part)
    all_rows = []
    for seed in seeds:  # each seed numbers its contexts from 0: renumber so the cell counts each context once
        rows_of_seed = [json.loads(line) for line in (parts / str(seed) / "predictions.jsonl").open()]
        offset = 1 + max((r.get("context_index", -1) for r in all_rows), default=-1)
        all_rows += [{**r, "context_index": r.get("context_index", 0) + offset} for r in rows_of_seed]
    seconds = sum(json.loads((parts / str(seed) / "cell.json").read_text())["seconds"] for seed in seeds)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_outputs(EvalReport(all_rows, summarize(all_rows, [m.label() for m in methods])), tmp)
    (tmp / "cell.json").write_text(json.dumps({"seconds": round(seconds, 1), "length": length, "task": task,
                                               "seeds": list(seeds), "adapter": adapter}, indent=2) + "\n")
    for name in ("calibration.json", "calibration.md"):
        if (cell_export / name).is_file():
            shutil.copy(cell_export / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def paired(base_dir: Path, base_row: str, other_dir: Path, other_row: str) -> dict:
    """Per-question difference (other - base) of two rows on the same questions, each row's split into
    refilled / missed, and full attention's score on the questions each row refilled (when either cell
    has a ``full`` row): the comparison every study table reads."""
    from acre_train.eval.metrics import bootstrap_ci, refill_split

    def rows(folder: Path, method: str) -> dict[tuple[str, int], dict]:
        out, seen = {}, {}
        for line in (folder / "predictions.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["method"] == method:
                n = seen[r["id"]] = seen.get(r["id"], -1) + 1  # ids repeat per context: pair by occurrence
                out[(r["id"], n)] = r
        return out

    a, b = rows(base_dir, base_row), rows(other_dir, other_row)
    full = {**rows(other_dir, "full"), **rows(base_dir, "full")}  # either cell's full row (the base's first)
    keys = sorted(set(a) & set(b))
    summary = {"n": len(keys), "base": base_row, "other": other_row,
               "other_minus_base": bootstrap_ci([100.0 * (b[k]["score"] - a[k]["score"]) for k in keys])}
    for name, got in (("base", a), ("other", b)):
        mine = [got[k] for k in keys]
        summary[name + "_row"] = {"score": bootstrap_ci([100.0 * r["score"] for r in mine]), **refill_split(mine),
                                  "kv_percent": 100.0 * sum(r["kv_attended"] / r["prompt_tokens"] for r in mine) / len(mine)}
        hit = [k for k in keys if (got[k].get("refill_coverage") or 0) >= 1.0 and k in full]
        if full and hit:
            summary[name + "_row"]["full_when_refilled"] = bootstrap_ci([100.0 * full[k]["score"] for k in hit])
    return summary


def publish(out: Path, docs: Path, base_dir: Path, base_row: str, other_row: str) -> dict:
    """Copy a finished cell ``out`` to ``docs`` with ``paired.json``: its ``other_row`` against ``base_row``
    of the cell in ``base_dir``, question by question (see :func:`paired`)."""
    comparison = paired(base_dir, base_row, out, other_row)
    shutil.rmtree(docs, ignore_errors=True)
    docs.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(out, docs)
    (docs / "paired.json").write_text(json.dumps(comparison, indent=2) + "\n")
    return comparison


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--squad", required=True, help="SQuAD v2 dev JSON (split by article here)")
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--cells", default=",".join(f"{n}/{t}" for n, t in CELLS), help="LENGTH/TASK,...")
    parser.add_argument("--seeds", default=",".join(map(str, EVAL_SEEDS)),
                        help="evaluation seeds, 40 questions each (default: 777,778,779)")
    parser.add_argument("--docs", default=str(REPO / "docs/real-base/scorer"), help="where finished cells are copied")

    args = parser.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    exported = export(root)
    dev, held = squad_splits(root, Path(args.squad))
    for spec in args.cells.split(","):
        length, task = int(spec.split("/")[0]), spec.split("/")[1]
        cell_export = root / "exports" / f"stage2-long-{length}-{task}"
        calibrate(exported, cell_export, length, task, dev)
        out = root / "eval" / str(length) / task
        evaluate(cell_export, length, task, held, out, tuple(int(x) for x in args.seeds.split(",")))
        docs = Path(args.docs) / str(length) / task
        docs.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(docs, ignore_errors=True)
        shutil.copytree(out, docs)
        log(f"cell {spec} done -> {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
