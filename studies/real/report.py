"""The real study's report: one table per (context length, task), 95 % bootstrap intervals, a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .study import RealStudy

from acre_train.eval.metrics import bootstrap_ci


def _rows(cell: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (cell / "predictions.jsonl").read_text(encoding="utf-8").splitlines() if line]


def collect(study: "RealStudy", kept: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One record per (length, task, row) over the finished cells.

    ``kept``: an earlier report's records; those of a cell whose folder is gone (a session on another
    machine) stay, marked ``kept``, so a report can grow cell by cell across machines.
    """
    from .study import MODELS

    out = []
    for length in study.config.lengths:
        for task in study.config.tasks:
            for model in MODELS:
                cell = study.cell_dir(length, task, model)
                if not (cell / "summary.json").is_file():
                    names = set(MODELS[model].values())
                    out += [dict(r, kept=True) for r in kept
                            if r["length"] == length and r["task"] == task and r["row"] in names]
                    continue
                rows = _rows(cell)
                for method in dict.fromkeys(r["method"] for r in rows):
                    mine = [r for r in rows if r["method"] == method]
                    kind = method.split(":")[0]
                    mean, low, high = bootstrap_ci([100.0 * r["score"] for r in mine])
                    contexts = {r.get("context_index"): r["prepare_s"] for r in mine}
                    recall = [100.0 * r["refill_recall"] for r in mine if r.get("refill_recall") is not None]
                    ranks = sorted(r["refill_rank"] for r in mine if r.get("refill_rank") is not None)
                    _, recall_low, recall_high = bootstrap_ci(recall)
                    out.append({
                        "length": length, "task": task, "row": MODELS[model][kind],
                        "method": method, "n": len(mine), "score": mean, "ci_low": low, "ci_high": high,
                        "kv_pct": 100.0 * sum(r["kv_attended"] / r["prompt_tokens"] for r in mine) / len(mine),
                        "prefill_s": sum(contexts.values()) / len(contexts),
                        "answer_s": sum(r["answer_s"] for r in mine) / len(mine),
                        "refill_recall": sum(recall) / len(recall) if recall else None,
                        "refill_recall_ci": [recall_low, recall_high] if recall else None,
                        "refill_rank_median": ranks[len(ranks) // 2] if ranks else None,
                        "num_l1": sum(r.get("acre_num_l1") or 0 for r in mine) / len(mine),
                    })
    return out


def markdown(records: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    for length in dict.fromkeys(r["length"] for r in records):
        for task in dict.fromkeys(r["task"] for r in records if r["length"] == length):
            lines += [f"#### {task}, {length} context tokens\n",
                      "| row | n | score (95 % CI) | KV attended % | prefill s / context | answer s / question "
                      "| refill recall % (95 % CI) | evidence span rank, median (of L1 entries) |",
                      "|---|---:|---|---:|---:|---:|---:|---:|"]
            for r in (r for r in records if r["length"] == length and r["task"] == task):
                recall = "–" if r["refill_recall"] is None else f"{r['refill_recall']:.0f}"
                if r.get("refill_recall_ci"):
                    recall += " ({:.0f}–{:.0f})".format(*r["refill_recall_ci"])
                rank = "–" if r.get("refill_rank_median") is None else f"{r['refill_rank_median']} (of {r['num_l1']:.0f})"
                mark = " †" if r.get("kept") else ""
                lines.append(f"| {r['row']} (`{r['method']}`){mark} | {r['n']} | {r['score']:.1f} ({r['ci_low']:.1f}–{r['ci_high']:.1f}) "
                             f"| {r['kv_pct']:.1f} | {r['prefill_s']:.1f} | {r['answer_s']:.2f} | {recall} | {rank} |")
            lines.append("")
    if any(r.get("kept") for r in records):
        lines.append("† kept from an earlier run of the study (its per-question rows are not on this machine).\n")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """One panel per (length, task): every row's score with its 95 % interval, labelled with its KV share.

    Rows go down the y axis (many ACRE rows attend the same KV share, so a score-vs-KV scatter
    stacks their labels on one another); ACRE rows are blue, the baselines grey.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((r["length"], r["task"]) for r in records))
    columns = min(2, len(cells))
    grid_rows = -(-len(cells) // columns)
    most = max(sum(1 for r in records if (r["length"], r["task"]) == c) for c in cells)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(7.5 * columns, 0.32 * most * grid_rows + 1.2 * grid_rows),
                             squeeze=False)
    for ax, (length, task) in zip(axes.flat, cells):
        rows = [r for r in records if r["length"] == length and r["task"] == task]
        for y, r in enumerate(rows):
            colour = "tab:blue" if r["row"].startswith("acre") else "dimgray"
            ax.errorbar(r["score"], y, xerr=[[r["score"] - r["ci_low"]], [r["ci_high"] - r["score"]]],
                        fmt="o", capsize=3, color=colour)
        full = [r["score"] for r in rows if r["method"] == "full"]
        if full:  # the reference every row is read against
            ax.axvline(full[0], color="dimgray", linestyle="--", linewidth=0.8)
        ax.set_yticks(range(len(rows)), [f"{r['row']}  ({r['kv_pct']:.0f} % KV)" for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{task}, {length} context tokens", fontsize=9)
        ax.set_xlabel("score (mean × 100, 95 % CI)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    for ax in list(axes.flat)[len(cells):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(study: "RealStudy") -> Path:
    previous = study.root / "report.json"
    kept = json.loads(previous.read_text()) if previous.is_file() else []
    records = collect(study, kept)
    out = study.root / "report.md"
    (study.root / "report.json").write_text(json.dumps(records, indent=2) + "\n")
    if records:
        plot(records, study.root / "report.png")
    out.write_text(markdown(records) + "\n", encoding="utf-8")
    return out
