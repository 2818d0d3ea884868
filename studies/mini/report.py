"""Tables and the plot of the miniature study from ``root/eval/results.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROW_ORDER = ("full", "truncated (base window)", "truncated (ACRE budget)", "acre", "acre-l1", "cachefocus",
             "infoflow", "vanilla-sft (full)", "acre (stage 1 only)")


def _order(labels):
    def key(label: str):
        for i, prefix in enumerate(ROW_ORDER):
            if label == prefix or label.startswith(prefix + ":"):
                return (i, label)
        return (len(ROW_ORDER), label)
    return sorted(labels, key=key)


def table(results: dict[str, Any]) -> str:
    """One Markdown table: rows = methods, columns = score and KV attended (% of the prompt) per length."""
    lengths = list(results["lengths"])
    labels = _order({m for L in lengths for m in results["lengths"][L]["summary"]["overall"]})
    head = "| method | " + " | ".join(f"{L}: score | {L}: KV % of full" for L in lengths) + " |"
    out = [head, "|---|" + "---:|---:|" * len(lengths)]
    for label in labels:
        cells = []
        for L in lengths:
            e = results["lengths"][L]["summary"]["overall"].get(label)
            full = results["lengths"][L]["summary"]["overall"].get("full")
            if e is None:
                cells += ["–", "–"]
                continue
            kv = e.get("kv_attended")
            pct = 100 * kv / full["kv_attended"] if full and kv is not None and full.get("kv_attended") else None
            cells += [f"{e['score']:.1f}", f"{pct:.0f}%" if pct is not None else "–"]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def refill_table(results: dict[str, Any]) -> str:
    """Refill recall (evidence reached by the refilled spans or the raw tail) vs the visible share."""
    lengths = [L for L in results["lengths"] if results["lengths"][L].get("refill")]
    if not lengths:
        return ""
    labels = _order({m for L in lengths for m in results["lengths"][L]["refill"]})
    out = ["| row | " + " | ".join(f"{L}: evidence reached | {L}: context visible (≈ chance)" for L in lengths) + " |",
           "|---|" + "---:|---:|" * len(lengths)]
    for label in labels:
        cells = []
        for L in lengths:
            e = results["lengths"][L]["refill"].get(label)
            cells += [f"{e['refill_recall']:.0f}% (n={e['n']})", f"{e['visible_share']:.0f}%"] if e else ["–", "–"]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def by_task(results: dict[str, Any]) -> str:
    out = []
    for L, entry in results["lengths"].items():
        tasks = entry["summary"]["by_task"]
        names = list(tasks)
        labels = _order({m for t in names for m in tasks[t]})
        out.append(f"**{L} tokens** (score per task)\n")
        out.append("| method | " + " | ".join(names) + " |")
        out.append("|---|" + "---:|" * len(names))
        for label in labels:
            out.append(f"| {label} | " + " | ".join(
                f"{tasks[t][label]['score']:.1f}" if label in tasks[t] else "–" for t in names) + " |")
        out.append("")
    return "\n".join(out)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(results["lengths"])
    labels = _order({m for L in lengths for m in results["lengths"][L]["summary"]["overall"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [int(L) for L in lengths]
    for label in labels:
        ys = [results["lengths"][L]["summary"]["overall"].get(label, {}).get("score") for L in lengths]
        kv = [results["lengths"][L]["summary"]["overall"].get(label, {}).get("kv_attended") for L in lengths]
        if all(y is None for y in ys):
            continue
        axes[0].plot(xs, ys, marker="o", label=label)
        axes[1].plot(xs, kv, marker="o", label=label)
    for ax, title, ylabel in ((axes[0], "quality", "score (mean x 100)"),
                              (axes[1], "attended KV entries (first decoded token, per layer)", "KV entries")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    window = results.get("config", {}).get("window")
    if window:
        for ax in axes:
            ax.axvline(window, color="grey", ls="--", lw=1)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def base_check_lines(check: dict[str, Any]) -> list[str]:
    """The base model's self-check (``study.self_check``) as a sentence and a small table."""
    lines = [f"Base self-check (full attention, seed {check['seed']}): {check['task']} at {check['context_tokens']} "
             f"tokens {check['score']:.2f} over {check['examples']} examples; answer NLL "
             f"{check['answer_nll_per_token']} nats/digit (chance {check['digit_chance_nll']}).", "",
             "| teacher-forced | exact answers | first digit | digits |", "|---|---:|---:|---:|"]
    for d in check.get("drills", {}).values():
        lines.append(f"| drill, {d['facts']} fact(s) | {d['exact']:.2f} | {d['first_digit']:.2f} | – |")
    for n in check.get("needles", []):
        lines.append(f"| {n['task']} @ {n['context_tokens']} | {n['exact']:.2f} | {n['first_digit']:.2f} | "
                     f"{n['digits']:.2f} |")
    return lines + [""]


def write_report(root: str | Path) -> Path:
    root = Path(root)
    results = json.loads((root / "eval" / "results.json").read_text())
    timings = json.loads((root / "timings.json").read_text()) if (root / "timings.json").is_file() else {}
    plot(results, root / "eval" / "miniature.png")
    base = root / "base_model" / "mini_eval.json"
    lines = ["# Miniature study results\n", table(results), "", refill_table(results), "", by_task(results),
             "Step times (s): " + ", ".join(f"{k} {v}" for k, v in timings.items()), ""]
    if base.is_file():
        lines += base_check_lines(json.loads(base.read_text()))
    path = root / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
