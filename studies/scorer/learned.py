"""The learned scorer on the real 0.5B base: train it over the fixed stage-1+2 adapter, calibrate, evaluate.

Not part of the installed package. Run from a checkout, after ``studies/scorer/run.py`` made its root
(the adapter export and the SQuAD article split)::

    python studies/scorer/learned.py --root checkpoints/scorer-study

Steps (each skipped when its output exists; training resumes from its latest checkpoint):

1. training conversations: half SQuAD (training articles), half needles, 2K-4K context tokens, at
   seeds 5000+ (the dev split calibrates at 1000, the evaluation uses 777-779);
2. ``acre-train train recipes/qwen2.5-0.5b/stage2-scorer.yaml`` from the stage-1+2 adapter
   (scorer_only: the L1 weights stay as they are; a rank-8 query map at layer 7 trains);
3. export it (adapter-only, the study's geometry: W0 1024, S 512, l 32, eta 192) and calibrate on the
   dev split with the learned scorer beside the training-free ones on one grid (l2, layer 7);
4. evaluate the held-out 2K SQuAD cell (the same 120 questions as run.py) with the chosen scorer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import BASE, DEV_SEED, REPO, log  # noqa: E402

RECIPE = REPO / "recipes/qwen2.5-0.5b/stage2-scorer.yaml"
TRAIN_SEED = 5000
CONVERSATIONS = 192
LENGTHS = (2048, 3072, 4096)
GEOMETRY = ["--first-chunk", "1024", "--stride", "512", "--interval", "32", "--max-refill", "192"]


def conversations(root: Path) -> Path:
    from acre_train.data.tokenizer import auto_tokenizer
    from acre_train.base.fetch import resolve_source
    from studies.real.streams import stage2_conversations, write_jsonl

    out = root / "learned" / "stage2.jsonl"
    if out.is_file():
        return out
    tok = auto_tokenizer(resolve_source(BASE))
    rows = stage2_conversations(tok, root / "squad-train.json", CONVERSATIONS, LENGTHS, seed=TRAIN_SEED)
    log(f"conversations: {len(rows)} ({sum(1 for r in rows if r['evidence'])} with evidence) -> {out}")
    return write_jsonl(rows, out)


def train(root: Path, data: Path, steps: int | None) -> Path:
    runs = root / "learned" / "runs"
    cmd = ["acre-train", "train", str(RECIPE), f"output_root={runs}", f"model.init_from={root / 'exports' / 'stage2-long'}",
           f"data.path={root / 'learned' / 'data'}", f"data.prepare.inputs=[{data}]",
           "checkpoint.resume_from_checkpoint=latest", "logging.progress_bar=false"]
    if steps:
        cmd.append(f"train.max_steps={steps}")
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    return runs / "qwen2.5-0.5b-stage2-scorer"


def export_and_calibrate(root: Path, run_dir: Path) -> Path:
    out = root / "exports" / "learned-2048-squad"
    if (out / "calibration.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["acre-train", "export", str(run_dir), str(tmp), "--adapter-only", *GEOMETRY], check=True)
    subprocess.run(["acre-train", "calibrate", str(tmp), "--data", "squad", "--squad", str(root / "squad-train.json"),
                    "--context-tokens", "2048", "--num-examples", "100", "--seed", str(DEV_SEED), "--scorers", "l2",
                    "--layers", "7", "--no-progress"], check=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def evaluate(root: Path, export: Path, docs: Path) -> None:
    import run as study

    study.CELLS[(2048, "squad")] = (493, 16, "acre", 100)
    out = root / "eval" / "learned-2048" / "squad"
    study.evaluate(export, 2048, "squad", root / "squad-heldout.json", out)
    shutil.rmtree(docs, ignore_errors=True)
    shutil.copytree(out, docs)
    log(f"learned cell done -> {docs}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--steps", type=int, default=None, help="cap the training steps (default: the recipe's epochs)")
    parser.add_argument("--docs", default=str(REPO / "docs/real-base/scorer/learned-2048/squad"))
    parser.add_argument("--skip-eval", action="store_true", help="stop after calibration")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not (root / "exports" / "stage2-long" / "config.json").is_file():
        raise SystemExit(f"{root} has no stage2-long export: run studies/scorer/run.py --root {root} first")
    data = conversations(root)
    run_dir = train(root, data, args.steps)
    export = export_and_calibrate(root, run_dir)
    calibration = json.loads((export / "calibration.json").read_text())
    log(f"calibrated: chosen {calibration['chosen']}")
    if not args.skip_eval:
        evaluate(root, export, Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
