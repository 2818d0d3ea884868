"""The long suite's test cells on the real base: one command per cell, one report from their predictions.

    python -m studies.long.cells list                     # every cell and the command it runs
    python -m studies.long.cells run needles-16k          # one test cell (refused a second time: --rerun)
    python -m studies.long.cells run chain-16k qa-16k     # several, one after another (a finished one is skipped)
    python -m studies.long.cells report [--check]         # docs/long/README.md and the README's table

Every cell answers with the adapter that ships with acre-train (``acre_train/resources/adapters``) and
the selection its card stores (one per band of context lengths, chosen on the dev split:
docs/long/dev/). A cell's predictions, summary and ledger line are committed under docs/long/; the
report reads nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "long"
EXPORT = REPO / "checkpoints" / "long" / "shipped-export"
SQUAD = REPO.parent / "shared" / "data" / "squad-v2-dev.json"
LEDGER = DOCS / "test-ledger.jsonl"
MARK = "<!-- long-context table: studies/long/cells.py -->"

# name: (task, context tokens, questions, rows, max new tokens)
CELLS: dict[str, tuple[str, int, int, str, int]] = {
    "needles-16k": ("long_needles", 16384, 64, "full,truncated:budget=1536,acre", 32),
    "needles-32k": ("long_needles", 32768, 64, "full,truncated:budget=1536,cachefocus,acre", 32),
    "chain-16k": ("long_chain", 16384, 64, "full,truncated:budget=1536,cachefocus,acre", 32),
    "qa-16k": ("long_qa", 16384, 64, "full,truncated:budget=1536,cachefocus,acre", 48),
    "needles-64k": ("long_needles", 65536, 40, "full,cachefocus,acre", 32),
    "needles-128k": ("long_needles", 131072, 40, "full,cachefocus,acre", 32),
    # A row added to a cell after its first run: the same questions, its own test run (and ledger line),
    # reported inside the cell it extends and marked there as added later.
    "needles-16k+cachefocus": ("long_needles", 16384, 64, "cachefocus", 32),
    # The SFT-vanilla control: the base with a LoRA on its own q/k/v trained on the ACRE adapter's stage-2
    # conversations, order, steps and learning rate with plain attention (recipes/qwen2.5-0.5b/
    # stage2-vanilla-lora.yaml); its `full` row is reported as `sft-vanilla`.
    "qa-16k+sft-vanilla": ("long_qa", 16384, 64, "full", 48),
}

# Rows that answer with another model than the shipped ACRE export: (export folder, what it is made from).
VANILLA = REPO / "studies" / "adapters" / "sft-vanilla-lora-step120"
MODELS: dict[str, tuple[Path, Path]] = {
    "qa-16k+sft-vanilla": (REPO / "checkpoints" / "long" / "sft-vanilla-export", VANILLA),
}
# What a run's method is reported as, where its name would collide with another row of the cell.
LABELS: dict[str, dict[str, str]] = {"qa-16k+sft-vanilla": {"full": "sft-vanilla"}}


def cells() -> list[str]:
    """The cells as reported (a ``CELL+row`` run is part of ``CELL``)."""
    return [name for name in CELLS if "+" not in name]


def added_rows(name: str) -> list[str]:
    """The runs that added rows to cell ``name`` after its first run."""
    return [other for other in CELLS if other.startswith(name + "+")]


def has_run(name: str) -> bool:
    return (DOCS / "cells" / name / "predictions.jsonl").is_file()


def command(name: str, rerun: bool = False) -> list[str]:
    task, length, questions, rows, new_tokens = CELLS[name]
    model = MODELS[name][0] if name in MODELS else EXPORT
    argv = ["acre-train", "eval", "--model", str(model.relative_to(REPO)), "--tasks", task, "--split", "test",
            "--context-tokens", str(length), "--num-examples", str(questions), "--methods", rows,
            "--max-new-tokens", str(new_tokens), "--device", "cpu", "--dtype", "float32", "--no-progress",
            "--ledger", str(LEDGER.relative_to(REPO)), "--out", str((DOCS / "cells" / name).relative_to(REPO))]
    if task == "long_qa":
        # relative to the repository (the command runs there), so the published command is the same on every clone
        argv += ["--squad", os.path.relpath(SQUAD, REPO)]
    return argv + (["--rerun"] if rerun else [])


def make_export(name: str | None = None) -> Path:
    """The model folder cell ``name`` answers with: the shipped adapter's export, or a control's."""
    if name in MODELS:
        out, source = MODELS[name]
        if not (out / "acre_vanilla.json").is_file():
            from acre_train.export.run import export_vanilla_run

            export_vanilla_run(source, out, overwrite=True)
        return out
    from acre_train.quickstart import shipped_adapter_export

    return shipped_adapter_export(EXPORT)


# ------------------------------------------------------------------------------------------ report

def _interval(values: list[float]) -> tuple[float, float, float]:
    from acre_train.eval.metrics import bootstrap_ci

    return bootstrap_ci(values)


def cell_rows(name: str) -> list[dict]:
    """The cell's predictions, with those of the rows added to it later (``added_later`` set on those)."""
    rows = []
    for run in [name, *(x for x in added_rows(name) if has_run(x))]:
        path = DOCS / "cells" / run / "predictions.jsonl"
        label = LABELS.get(run, {})
        for x in path.read_text(encoding="utf-8").splitlines():
            if x.strip():
                row = json.loads(x)
                rows.append({**row, "method": label.get(row["method"], row["method"]),
                             **({"added_later": True} if run != name else {})})
    return rows


def table() -> str:
    """One line per (cell, row): score with its 95 % interval, answer contained, KV share, times, memory."""
    lines = ["| cell | row | score (95 % CI) | F1 | answer contained % | answer words | KV share % | "
             "build s / context | s / question | memory added GiB | n |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in cells():
        if not has_run(name):
            continue
        rows = cell_rows(name)
        task, length, *_ = CELLS[name]
        metric = "F1" if task == "long_qa" else "answer contained"
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            mean, lo, hi = _interval([100.0 * r["score"] for r in mine])
            contained = 100.0 * sum(r["substring"] for r in mine) / len(mine)
            f1 = 100.0 * sum(r["qa_f1"] for r in mine) / len(mine)
            words = sorted(len(r["prediction"].split()) for r in mine)[len(mine) // 2]
            share = 100.0 * sum(r["kv_attended"] / r["prompt_tokens"] for r in mine) / len(mine)
            builds = {r.get("context_index"): r.get("prepare_s") or 0.0 for r in mine}
            build = sum(builds.values()) / max(1, len(builds))
            answer = sum(r.get("answer_s") or 0.0 for r in mine) / len(mine)
            memory = max((r.get("memory_added_bytes") or 0) for r in mine) / 2**30
            later = " (added later)" if mine[0].get("added_later") else ""
            lines.append(f"| {name} | `{method}`{later} | {metric} {mean:.1f} ({lo:.1f}–{hi:.1f}) | {f1:.1f} | {contained:.1f} | {words} | "
                         f"{share:.1f} | {build:.0f} | {answer:.1f} | {memory:.2f} | {len(mine)} |")
    return "\n".join(lines) + "\n"


def findings() -> str:
    """Per cell, where the ACRE row's score goes: the evidence back whole (recall), the score when it is
    back and when it is not, the evidence's median rank, and the row against full attention."""
    import statistics

    lines = ["| cell | ACRE / full attention | evidence back whole % | score when back (n) | score when missed (n) | "
             "median rank of the evidence | wrong when back: another question's answer |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in cells():
        if not has_run(name):
            continue
        rows = cell_rows(name)
        acre = [r for r in rows if r["method"] == "acre"]
        full = [r for r in rows if r["method"] == "full"]
        if not acre:
            continue
        back = [r for r in acre if (r.get("refill_coverage") or 0.0) >= 0.999]
        missed = [r for r in acre if (r.get("refill_coverage") or 0.0) < 0.999]
        mean = lambda rs: 100.0 * sum(r["score"] for r in rs) / len(rs) if rs else float("nan")  # noqa: E731
        ranks = [r["refill_rank"] for r in acre if r.get("refill_rank") is not None]
        ratio = f"{mean(acre) / mean(full):.2f}×" if full and mean(full) else "–"
        golds: dict = {}
        for r in rows:
            golds.setdefault(r.get("context_index"), set()).update(r["answers"])
        wrong = [r for r in back if not r["substring"]]
        other = sum(1 for r in wrong if any(a in r["prediction"] for a in golds[r.get("context_index")] - set(r["answers"])))
        confusion = f"{other} of {len(wrong)}" if CELLS[name][0] != "long_qa" else "–"  # (codes, not free text)
        lines.append(f"| {name} | {ratio} | {100.0 * len(back) / len(acre):.1f} | {mean(back):.1f} ({len(back)}) | "
                     f"{mean(missed):.1f} ({len(missed)}) | {statistics.median(ranks) if ranks else '–'} | "
                     f"{confusion} |")
    return "\n".join(lines) + "\n"


def compact_table() -> str:
    """The README's table: one line per cell, each row's score (95 % interval) side by side, then ACRE's
    KV share, build, time per question and memory (docs/long/README.md has every row's)."""
    columns = {"full": "full attention", "truncated:budget=1536": "truncated to 1,536", "cachefocus": "CacheFocus",
               "acre": "ACRE", "sft-vanilla": "SFT-vanilla"}
    present = {r["method"] for name in cells() if has_run(name) for r in cell_rows(name)}
    columns = {k: v for k, v in columns.items() if k in present or k != "sft-vanilla"}  # a control once it exists
    lines = ["| cell | metric | " + " | ".join(columns.values()) + " | ACRE KV share % | ACRE build s | "
             "ACRE s / question | ACRE memory GiB | questions |",
             "|---|---|" + "---:|" * (len(columns) + 5)]
    for name in cells():
        if not has_run(name):
            continue
        rows = cell_rows(name)
        metric = "F1" if CELLS[name][0] == "long_qa" else "contained"
        scores = []
        for method in columns:
            mine = [100.0 * r["score"] for r in rows if r["method"] == method]
            later = " †" if any(r.get("added_later") for r in rows if r["method"] == method) else ""
            scores.append("{:.1f} ({:.0f}–{:.0f})".format(*_interval(mine)) + later if mine else "–")
        acre = [r for r in rows if r["method"] == "acre"]
        share = 100.0 * sum(r["kv_attended"] / r["prompt_tokens"] for r in acre) / len(acre)
        builds = {r.get("context_index"): r.get("prepare_s") or 0.0 for r in acre}
        build = sum(builds.values()) / max(1, len(builds))
        answer = sum(r.get("answer_s") or 0.0 for r in acre) / len(acre)
        memory = max((r.get("memory_added_bytes") or 0) for r in acre) / 2**30
        lines.append(f"| {name} | {metric} | " + " | ".join(scores) +
                     f" | {share:.1f} | {build:.0f} | {answer:.1f} | {memory:.2f} | {len(acre)} |")
    if any(r.get("added_later") for name in cells() if has_run(name) for r in cell_rows(name)):
        lines.append("\n† a row added after the cell's first run: the same questions, its own single test run.")
    return "\n".join(lines) + "\n"


def ledger_lines() -> str:
    if not LEDGER.is_file():
        return "(no test run yet)\n"
    out = []
    for line in LEDGER.read_text(encoding="utf-8").splitlines():
        run = json.loads(line)
        rerun = " (a rerun)" if run.get("rerun") else ""
        out.append(f"- `{run['out']}`, {run['when']}, fingerprint `{run['fingerprint']}`{rerun}")
    return "\n".join(out) + "\n"


def page() -> str:
    head = (REPO / "studies" / "long" / "page.md").read_text(encoding="utf-8")
    commands = "\n".join(f"    {' '.join(command(n))}" for n in CELLS if has_run(n))
    return (head.replace("{table}", table()).replace("{findings}", findings()).replace("{ledger}", ledger_lines())
            .replace("{commands}", commands or "    (none yet)"))


SQUAD_2K = DOCS.parent / "real-base" / "scorer"  # the 2K SQuAD comparison the README used to lead with


def format_check() -> dict[str, float]:
    """The 2K SQuAD headline re-read from its committed predictions: F1 and answer contained of the shipped
    setting's row and of full attention on the same 120 questions, and their answers' median length."""
    import statistics

    acre = [json.loads(x) for x in (SQUAD_2K / "question/2048/squad/predictions.jsonl").read_text().splitlines()]
    ids = {r["id"] for r in acre}
    full = [r for r in (json.loads(x) for x in (SQUAD_2K / "2048/squad/predictions.jsonl").read_text().splitlines())
            if r["method"] == "full" and r["id"] in ids]
    out = {}
    for name, rows in (("acre", acre), ("full", full)):
        out[f"{name}_f1"] = 100.0 * sum(r["score"] for r in rows) / len(rows)
        out[f"{name}_contained"] = 100.0 * sum(r["substring"] for r in rows) / len(rows)
        out[f"{name}_words"] = statistics.median(len(r["prediction"].split()) for r in rows)
        out[f"{name}_n"] = len(rows)
    return out


def cautions() -> str:
    f = format_check()
    return (f"Earlier figures, at 2K-8K tokens where full attention fits easily, are in "
            f"[`docs/real-base.md`](docs/real-base.md). Read them with three cautions: the 4K and 8K needle "
            f"haystacks are the Python Language Reference, about half of the stage-1 training text; the 2K SQuAD "
            f"comparison ({f['acre_n']} questions: shipped adapter {f['acre_f1']:.1f} F1, full attention "
            f"{f['full_f1']:.1f}) is answer format: the adapter was trained on that prompt and answers in "
            f"{f['acre_words']:.0f} words (median) where the untrained base answers in {f['full_words']:.0f}, and on "
            f"\"the gold answer is contained in the reply\" the same rows score {f['acre_contained']:.1f} against full "
            f"attention's {f['full_contained']:.1f}; and the 82.5 % (4K) and 80.8 % (8K) needle rows use a study "
            f"adapter (`studies/adapters/stage1-lora-step120`), not a shipped one. Their test questions were also "
            f"reused across many configurations.\n")


def readme_block() -> str:
    return f"{MARK}\n{compact_table()}\n{cautions()}{MARK}\n"


def write_report(check: bool = False) -> int:
    from acre_train.files import write_text_atomic

    target = DOCS / "README.md"
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    if text.count(MARK) != 2:
        raise SystemExit(f"README.md needs two '{MARK}' lines around the long-context table")
    a, b = text.index(MARK), text.rindex(MARK) + len(MARK) + 1
    new_readme = text[:a] + readme_block() + text[b:]
    if check:
        stale = [str(p) for p, want in ((target, page()), (readme, new_readme))
                 if not p.is_file() or p.read_text(encoding="utf-8") != want]
        if stale:
            print("out of date (run python -m studies.long.cells report): " + ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    write_text_atomic(target, page())
    write_text_atomic(readme, new_readme)
    print(f"wrote {target} and the README's long-context table")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.long.cells", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("list")
    run = sub.add_parser("run")
    run.add_argument("cells", nargs="+", choices=sorted(CELLS), metavar="CELL")
    run.add_argument("--rerun", action="store_true")
    report = sub.add_parser("report")
    report.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.verb == "list":
        for name in CELLS:
            print(f"{name}: {' '.join(command(name))}")
        return 0
    if args.verb == "report":
        return write_report(args.check)
    for name in args.cells:
        if not args.rerun and (DOCS / "cells" / name / "predictions.jsonl").is_file():
            print(f"{name}: already run (docs/long/cells/{name}); --rerun to score it again")
            continue
        make_export(name)
        code = subprocess.call(command(name, args.rerun), cwd=REPO)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
