"""Training study on the real 0.5B base: stage 2 in the refilled layout against plain stage 2.

Not part of the installed package. Run from a checkout, after ``studies/scorer/run.py`` made its root
(the plain row's exports, calibrations and held-out cells)::

    python studies/training/sim.py --squad ../shared/data/squad-v2-dev.json --root checkpoints/scorer-study

The plain row is the scorer study's ``stage2-long`` adapter: stage 2 for 120 steps (batch 2) from the
kept stage-1 (120 steps) adapter, on the study's 96 stage-2 conversations. The refill-simulated row
(``recipes/qwen2.5-0.5b/stage2-sim.yaml``) starts from the same stage-1 adapter, with the same data,
order, seed, lr schedule and steps; only ``train.refill_sim`` differs. Both rows then answer each
held-out cell with the same inference setting (the plain row's calibrated scorer for that cell), so
a difference is the L1 weights' alone; questions are paired.

Steps (each skipped when its output exists; training resumes from its latest checkpoint, saved every
4 steps, so a session that ends mid-run continues in the next; on a fresh machine, from the checkpoint
that ``--keep`` copied to ``studies/training/resume/`` and the session committed, with the same ``--root``):

1. the study's training streams (``acre-train reproduce real --steps streams``) and the stage-1 export;
2. ``acre-train train recipes/qwen2.5-0.5b/stage2-sim.yaml`` (120 steps, ~50 s each here);
3. export (adapter-only, the study's geometry; it stores the refill it trained with);
4. evaluate the held-out cells seed by seed and write the paired comparison to docs/real-base/training/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scorer"))

import run as scorer_study  # noqa: E402
from run import EVAL_SEEDS, REPO, log  # noqa: E402

RECIPE = REPO / "recipes/qwen2.5-0.5b/stage2-sim.yaml"
STAGE1 = REPO / "studies/adapters/stage1-lora-step120.safetensors"
STEPS = 120
# --row: the run's name and what it adds to the recipe. Both rows share start, data, order, lr and steps,
# so they differ only in the KL to the frozen base (studies/real/study.py defines the same two runs).
ROWS = {"stage2-sim-long": ("qwen2.5-0.5b-stage2-sim-lora-120", ()),
        "stage2-sim-distill": ("qwen2.5-0.5b-stage2-sim-distill-lora-120", ("train.distill.weight=0.5",)),
        # The same run with several questions per context in one sample (the training issue's item 3): the
        # same 96 training seeds, lengths and kinds, each SQuAD and multi-key context asked up to 4 questions
        # (streams.stage2_conversations(questions_per_context=4)), packed so that one context forward and
        # backward trains them all; same start, lr, seed and steps, so it sees up to 4x the answers.
        "stage2-sim-packed": ("qwen2.5-0.5b-stage2-sim-packed-lora-120", ("data.prepare.pack_questions=4",))}
PACKED = 4  # questions per context of the packed row's stream
RUN_NAME = ROWS["stage2-sim-long"][0]
GEOMETRY = ["--first-chunk", "1024", "--stride", "512", "--interval", "32", "--max-refill", "192"]
CELLS = ("2048/squad", "4096/niah_multikey")


def inputs(root: Path, squad: Path, row: str = "stage2-sim-long") -> tuple[Path, Path]:
    """The row's stage-2 conversations and the stage-1 adapter's export (the run starts from it)."""
    from studies.real.study import RealConfig, RealStudy

    study = RealStudy(root, squad, RealConfig(adapters={"stage1-long": str(STAGE1)}), log=log)
    study.step_streams()
    start = study.export_dir("stage1-long")
    if not (start / "config.json").is_file():
        study.step_export()
    if row != "stage2-sim-packed":
        return study.streams / "stage2.jsonl", start
    return packed_stream(study), start


def packed_stream(study) -> Path:
    """The packed row's conversations (written once, beside the study's other streams)."""
    from acre_train.data.tokenizer import auto_tokenizer
    from studies.real.streams import stage2_conversations, write_jsonl

    out = study.streams / "stage2-packed.jsonl"
    if not out.is_file():
        c = study.config
        rows = stage2_conversations(auto_tokenizer(c.base), study.streams / "squad-train.json", c.stage2_conversations,
                                    c.stage2_lengths, questions_per_context=PACKED)
        write_jsonl(rows, out)
        log(f"{out}: {len(rows)} questions on {c.stage2_conversations} contexts")
    return out


RESUME = HERE / "resume"  # a session's last checkpoint of each run, committed when it ended mid-run


def seed_run(run_dir: Path) -> None:
    """Continue from the committed checkpoint (``RESUME/<run>``) when this machine's run is behind it, so a
    run cut by a session's end resumes on a fresh machine; the run's metrics come with it."""
    from acre_train.train import latest_checkpoint

    kept_dir = RESUME / run_dir.name
    kept = latest_checkpoint(kept_dir) if kept_dir.is_dir() else None
    mine = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    step = lambda ckpt: int(ckpt.name.split("-")[-1]) if ckpt else -1  # noqa: E731
    if kept is None or step(mine) >= step(kept):
        return
    log(f"resuming from the committed {kept} (this machine's run is at step {max(step(mine), 0)})")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(kept, run_dir / kept.name, dirs_exist_ok=True)
    shutil.copy2(kept_dir / "metrics.jsonl", run_dir / "metrics.jsonl")
    (run_dir / "latest").write_text(kept.name + "\n")


def keep_checkpoint(run_dir: Path) -> None:
    """Copy the run's latest checkpoint and metrics to ``RESUME/<run>`` (commit it when a session ends mid-run)."""
    from acre_train.train import latest_checkpoint

    kept_dir = RESUME / run_dir.name
    ckpt = latest_checkpoint(run_dir)
    shutil.rmtree(kept_dir, ignore_errors=True)
    kept_dir.mkdir(parents=True)
    shutil.copytree(ckpt, kept_dir / ckpt.name)
    shutil.copy2(run_dir / "metrics.jsonl", kept_dir / "metrics.jsonl")
    (kept_dir / "latest").write_text(ckpt.name + "\n")
    log(f"kept {ckpt.name} in {kept_dir}")


def train(root: Path, data: Path, start: Path, steps: int, row: str = "stage2-sim-long") -> Path:
    run_name, extra = ROWS[row]
    runs = root / "runs"
    seed_run(runs / run_name)
    cmd = ["acre-train", "train", str(RECIPE), f"output_root={runs}", f"run_name={run_name}",
           f"model.init_from={start}", f"data.path={root / 'data' / data.stem}", f"data.prepare.inputs=[{data}]",
           f"train.max_steps={steps}", "checkpoint.every_steps=4", "checkpoint.resume_from_checkpoint=latest",
           "logging.progress_bar=false", *extra]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    return runs / run_name


def export(root: Path, run_dir: Path, row: str = "stage2-sim-long") -> Path:
    out = root / "exports" / row
    if not (out / "config.json").is_file():
        subprocess.run(["acre-train", "export", str(run_dir), str(out), "--adapter-only", "--overwrite", *GEOMETRY],
                       check=True)
    return out


def plain_cell(root: Path, length: int, task: str) -> tuple[Path, Path]:
    """The plain row's calibration and held-out cell: the study root's when it has them, else the copies
    committed under docs/real-base/scorer (a fresh machine need not rebuild the scorer study to compare)."""
    calibration = root / "exports" / f"stage2-long-{length}-{task}" / "calibration.json"
    cell = root / "eval" / str(length) / task
    committed = REPO / "docs/real-base/scorer" / str(length) / task
    if not calibration.is_file():
        calibration = committed / "calibration.json"
    if not (cell / "predictions.jsonl").is_file():
        cell = committed
    return calibration, cell


def plain_setting(calibration: Path) -> str:
    """The plain row's calibrated setting for the cell, as an ``acre:`` row of the harness."""
    chosen = json.loads(calibration.read_text())["rows"][0]
    s = chosen["scorer"]
    layers = "+".join(str(x) for x in s["layers"])
    return (f"acre:scorer={s['kind']}:layers={layers}:heads={s['heads']}:sinks={s['sinks']}:"
            f"keep_sinks={int(s['keep_sinks'])}:neighbors={int(chosen['neighbors'])}")


def publish_cell(out: Path, docs: Path, plain: Path, row: str, name: str) -> None:
    """Copy a finished cell to ``docs`` with its paired comparison against the plain row's cell."""
    comparison = scorer_study.publish(out, docs, plain, "acre", row)
    log(f"cell {name}: {json.dumps(comparison)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--squad", required=True, help="SQuAD v2 dev JSON (split by article)")
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--row", choices=list(ROWS), default="stage2-sim-long",
                        help="stage2-sim-distill: the same run plus half the loss a KL to the frozen base; "
                             "stage2-sim-packed: the same run with up to 4 questions per context in one sample")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--cells", default=",".join(CELLS), help="LENGTH/TASK,... to evaluate")
    parser.add_argument("--seeds", default=",".join(map(str, EVAL_SEEDS)))
    parser.add_argument("--docs", default=str(REPO / "docs/real-base/training"))
    parser.add_argument("--train-only", action="store_true")
    parser.add_argument("--keep", action="store_true",
                        help="copy the run's latest checkpoint to studies/training/resume/ and stop (at a session's end)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.keep:
        keep_checkpoint(root / "runs" / ROWS[args.row][0])
        return 0
    data, start = inputs(root, Path(args.squad), args.row)
    run_dir = train(root, data, start, args.steps, args.row)
    if args.train_only:
        return 0
    exported = export(root, run_dir, args.row)
    # The curve goes to docs with the adapter: the run folder stays on this machine, and a fresh one
    # would have the adapter but not how it trained (a distilled row's was once lost so).
    shutil.copy2(run_dir / "metrics.jsonl", Path(args.docs) / f"{args.row}_metrics.jsonl")
    if args.row != "stage2-sim-long":  # the ladder answers every other row from its committed adapter
        from ladder import ADAPTERS

        shutil.copy2(exported / "acre_adapter.safetensors", ADAPTERS[args.row])
        log(f"adapter -> {ADAPTERS[args.row]}; evaluate it with studies/training/ladder.py --cells "
            f"{','.join(c + ':' + args.row for c in args.cells.split(','))}")
        return 0
    seeds = tuple(int(x) for x in args.seeds.split(","))
    for spec in args.cells.split(","):
        length, task = int(spec.split("/")[0]), spec.split("/")[1]
        calibration, plain = plain_cell(root, length, task)
        row = plain_setting(calibration)
        out = root / "eval" / "sim" / str(length) / task
        scorer_study.evaluate(exported, length, task, root / "streams" / "squad-heldout.json", out, seeds, rows=row,
                              adapter=ROWS[args.row][0])
        publish_cell(out, Path(args.docs) / str(length) / task, plain, row, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
