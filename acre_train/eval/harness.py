"""Run methods over examples; write predictions JSONL, a JSON summary, a Markdown table and a plot.

Python API::

    from acre_train.eval import evaluate, build_task, parse_methods
    report = evaluate(model, tokenizer, build_task("squad", tokenizer, 4096, 20),
                      parse_methods("full,cachefocus,infoflow"), out_dir="eval_out")
    report.summary["overall"]["cachefocus"]["score"]

Every method answers every example with the same prompt pieces, the same greedy decoding and the
same stop tokens. ``score`` is each example's primary metric (its ``metric`` field).

Examples whose prompt differs only in the question share a context: every method prepares it once
(``EvalMethod.prepare``: full attention's prefix KV, ACRE's bi-layer cache, CacheFocus/InfoFlow's
per-document caches) and answers each question over it. Rows carry the context's preparation time
(``prepare_s``, once per context in the summary) apart from the question's own (``answer_s``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from . import metrics
from ..measure import PeakMemory, Timer
from .methods.base import EvalMethod, GenerationConfig
from .prompt import PreparedExample, prepare_example
from .examples import Example

COST_KEYS = ("kv_attended", "tokens_prefilled", "token_layers_computed", "token_layers_recomputed", "kv_bytes",
             "prepare_s", "answer_s", "ttft_s", "wall_s", "memory_added_bytes")


@dataclass
class EvalConfig:
    max_new_tokens: int = 32
    chunk_tokens: int = 512
    recall_k: int = 5
    progress: bool = True


@dataclass
class EvalReport:
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)


def stop_ids(model, tokenizer) -> set[int]:
    """Where every row's answers end (the same ids as chat/generate: data.prompt.stop_token_ids)."""
    from ..data.prompt import stop_token_ids

    return stop_token_ids(tokenizer, model.config, getattr(model, "generation_config", None))


def _device(model) -> torch.device:
    from ..infer.placement import execution_device

    return execution_device(model)


def context_key(prepared: PreparedExample) -> tuple:
    """What a method's ``prepare`` depends on: the prompt up to the end of the context."""
    return tuple(prepared.prefix_ids), tuple(tuple(d) for d in prepared.doc_ids)


def group_by_context(prepared: Sequence[PreparedExample]) -> list[list[PreparedExample]]:
    """Examples sharing a context, in first-seen order (one group per distinct context)."""
    groups: dict[tuple, list[PreparedExample]] = {}
    for p in prepared:
        groups.setdefault(context_key(p), []).append(p)
    return list(groups.values())


def run_context(model, tokenizer, method: EvalMethod, group: Sequence[PreparedExample], generation: GenerationConfig,
                recall_k: int, context_index: int = 0) -> list[dict[str, Any]]:
    """One method on every question of one context: the context prepared once, each question answered."""
    device = _device(model)
    with torch.no_grad(), PeakMemory(device) as prep_mem:
        timer = Timer(device)
        state = method.prepare(model, tokenizer, group[0])
        prepare_s = timer.elapsed()
    rows = []
    for prepared in group:
        with torch.no_grad(), PeakMemory(device) as mem:
            timer = Timer(device)
            result = method.answer(model, tokenizer, prepared, state, generation)
            answer_s = timer.elapsed()
        cost = result.cost
        # Over the prepare block's start: the prepared state stays held while each question is answered.
        added = max(prep_mem.peak_bytes, mem.peak_bytes) - (prep_mem.peak_bytes - prep_mem.added_bytes)
        cost.prepare_s, cost.wall_s, cost.memory_added_bytes = prepare_s, prepare_s + answer_s, added
        row = _row(prepared, method, result, recall_k)
        row.update({"answer_s": answer_s, "context_index": context_index, "questions_on_context": len(group)})
        rows.append(row)
    del state
    return rows


def run_one(model, tokenizer, method: EvalMethod, prepared: PreparedExample, generation: GenerationConfig,
            recall_k: int) -> dict[str, Any]:
    """One method on one example: prediction, metrics and cost as a flat dict."""
    return run_context(model, tokenizer, method, [prepared], generation, recall_k)[0]


def _row(prepared: PreparedExample, method: EvalMethod, result, recall_k: int) -> dict[str, Any]:
    ex = prepared.example
    scores = metrics.score_answer(result.prediction, ex.answers, ex.substring_mode)
    row: dict[str, Any] = {"id": ex.id, "task": ex.task, "method": method.label(), "prediction": result.prediction,
                           "answers": ex.answers, **scores, "score": scores[ex.metric]}
    gold = prepared.gold_docs
    row[f"recall@{recall_k}"] = (metrics.recall_at_k(result.doc_ranking, gold, recall_k)
                                 if gold and result.doc_ranking is not None else None)
    row["evidence_recall"] = (metrics.evidence_recall(result.kept_docs, gold)
                              if gold and result.kept_docs is not None else None)
    row.update(result.cost.to_dict())
    row.update({"prompt_tokens": len(prepared), "num_docs": prepared.num_docs, "gold_docs": gold,
                "kept_docs": result.kept_docs, "doc_ranking": result.doc_ranking, **result.extra})
    return row


def evaluate(model, tokenizer, examples: Sequence[Example], methods: Sequence[EvalMethod], *,
             config: EvalConfig | None = None, out_dir: str | Path | None = None) -> EvalReport:
    """Answer every example with every method; summarise; write files when ``out_dir`` is given."""
    from tqdm.auto import tqdm

    config = config or EvalConfig()
    if not examples:
        raise ValueError("no examples to evaluate")
    generation = GenerationConfig(config.max_new_tokens, stop_ids(model, tokenizer))
    model.eval()
    groups = group_by_context([prepare_example(tokenizer, ex, config.chunk_tokens) for ex in examples])
    for method in methods:  # every row can answer every example, or nothing runs
        for group in groups:
            for prepared in group:
                method.check_example(prepared)
    rows: list[dict[str, Any]] = []
    progress = Progress(Path(out_dir), plan_fingerprint(model, groups, methods, config)) if out_dir is not None else None
    done = progress.load() if progress is not None else {}
    if done:
        print(f"eval: resuming {out_dir}: {sum(map(len, done.values()))} answers kept from an earlier run", file=sys.stderr)
    bar = tqdm(total=len(examples) * len(methods), desc="eval", unit="answer", disable=not config.progress)
    for index, group in enumerate(groups):
        for method in methods:
            bar.set_postfix_str(f"{group[0].example.task} {method.label()}", refresh=False)
            got = done.get((index, method.label()))
            if got is None:
                try:
                    got = run_context(model, tokenizer, method, group, generation, config.recall_k, index)
                except ValueError as exc:  # a row that cannot answer this context: keep what finished
                    kept = f"; the {len(rows)} finished answers are kept in {progress.path}, and the same command " \
                           "resumes after the row is fixed" if progress is not None else ""
                    raise ValueError(f"row {method.label()!r} on context {index} ({group[0].example.id}): {exc}{kept}") \
                        from exc
                if progress is not None:
                    progress.add(got)
            rows.extend(got)
            bar.update(len(group))
    bar.close()
    order = {ex.id: i for i, ex in enumerate(examples)}
    rows.sort(key=lambda r: (order[r["id"]], [m.label() for m in methods].index(r["method"])))
    report = EvalReport(rows, summarize(rows, [m.label() for m in methods]))
    if out_dir is not None:
        report.files = write_outputs(report, Path(out_dir))
        progress.finish()
    return report


PARTIAL = "predictions.partial.jsonl"


def plan_fingerprint(model, groups: Sequence[Sequence[PreparedExample]], methods: Sequence[EvalMethod],
                     config: EvalConfig) -> str:
    """What an eval's answers depend on: every prompt's tokens, the rows, the decoding budget, the model's
    name, dtype and size. A partial run is resumed only under the same fingerprint."""
    digest = hashlib.sha256()
    for group in groups:
        for prepared in group:
            digest.update(json.dumps([prepared.example.id, prepared.prompt_ids(), prepared.example.answers]).encode())
    first = next(model.parameters())
    digest.update(json.dumps([[m.label() for m in methods], config.max_new_tokens, config.chunk_tokens,
                              str(getattr(model.config, "_name_or_path", "")), str(first.dtype),
                              sum(p.numel() for p in model.parameters())]).encode())
    return digest.hexdigest()


class Progress:
    """The finished answers of one eval, appended per (context, row) as they finish, so that a failing
    row or a kill loses nothing and the same command resumes (``predictions.partial.jsonl`` beside the
    outputs; its first line is the plan's fingerprint, a torn last line is dropped)."""

    def __init__(self, out_dir: Path, fingerprint: str):
        self.path, self.fingerprint = out_dir / PARTIAL, fingerprint

    def load(self) -> dict[tuple[int, str], list[dict[str, Any]]]:
        """Rows of every (context, row) an earlier run of the same plan finished; starts afresh otherwise."""
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.is_file() else []
        if not lines or lines[0] != json.dumps({"plan": self.fingerprint}):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"plan": self.fingerprint}) + "\n", encoding="utf-8")
            return {}
        done: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for n, line in enumerate(lines[1:], start=1):
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut short: drop it, that (context, row) runs again
                self.path.write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
                break
            done[(batch["context_index"], batch["method"])] = batch["rows"]
        return done

    def add(self, rows: list[dict[str, Any]]) -> None:
        line = json.dumps({"context_index": rows[0]["context_index"], "method": rows[0]["method"], "rows": rows},
                          ensure_ascii=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def _mean(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def _group(rows: list[dict[str, Any]], labels: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    metric_keys = [k for k in rows[0] if k in {"score", "qa_f1", "exact_match", "substring", "rouge_l",
                                               "evidence_recall"} or k.startswith("recall@")]
    for label in labels:
        mine = [r for r in rows if r["method"] == label]
        if not mine:
            continue
        entry: dict[str, Any] = {"n": len(mine)}
        entry.update(metrics.aggregate([{k: r[k] for k in metric_keys} for r in mine]))
        entry.update({k: _mean([r.get(k) for r in mine]) for k in COST_KEYS})
        # The context's preparation counts once per context, not once per question asked of it.
        per_context = {r.get("context_index", i): r["prepare_s"] for i, r in enumerate(mine)}
        entry["prepare_s"] = _mean(list(per_context.values()))
        entry["contexts"] = len(per_context)
        if any(r.get("refill_coverage") is not None for r in mine):
            entry.update(metrics.refill_split(mine))
            entry["refill_recall"] = _mean([r.get("refill_recall") for r in mine])
            entry["refill_recall"] = None if entry["refill_recall"] is None else 100.0 * entry["refill_recall"]
            ranks = sorted(r["refill_rank"] for r in mine if r.get("refill_rank") is not None)
            entry["refill_rank_median"] = ranks[len(ranks) // 2] if ranks else None
        out[label] = entry
    base = out.get("full")
    for entry in out.values():  # cost ratios to `full`, the reference row
        for k in ("ttft_s", "memory_added_bytes", "kv_attended", "token_layers_computed"):
            b = base.get(k) if base else None
            entry[f"{k}_vs_full"] = entry[k] / b if b and entry.get(k) is not None else None
    return out


def summarize(rows: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """``{"overall": {method: {...}}, "by_task": {task: {method: {...}}}}``, metrics as means × 100."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    return {"overall": _group(rows, labels),
            "by_task": {t: _group([r for r in rows if r["task"] == t], labels) for t in tasks}}


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown_table(summary: dict[str, Any]) -> str:
    """One table per task plus an overall one."""
    cols = [("score", "score", 1), ("qa_f1", "F1", 1), ("exact_match", "EM", 1), ("substring", "substr", 1),
            ("rouge_l", "ROUGE-L", 1), (None, "recall@k", 1), ("evidence_recall", "evid. recall", 1),
            ("kv_attended", "KV attended", 0), ("tokens_prefilled", "prefilled", 0),
            ("token_layers_recomputed", "tok-layers recomp.", 0), ("prepare_s", "prefill s/context", 2), ("answer_s", "answer s/question", 2), ("ttft_s", "TTFT s", 3),
            ("ttft_s_vs_full", "TTFT/full", 2), ("memory_added_bytes", "added MiB", 1)]
    out: list[str] = []
    sections = [("overall", summary["overall"])] + list(summary["by_task"].items())
    for title, group in sections:
        out.append(f"### {title}\n")
        out.append("| method | n | " + " | ".join(c[1] for c in cols) + " |")
        out.append("|---|---:|" + "---:|" * len(cols))
        for label, e in group.items():
            cells = []
            for key, _, digits in cols:
                if key is None:
                    key = next((k for k in e if k.startswith("recall@")), "")
                v = e.get(key)
                if key == "memory_added_bytes" and v is not None:
                    v = v / 2**20
                cells.append(_fmt(v, digits))
            out.append(f"| {label} | {e['n']} | " + " | ".join(cells) + " |")
        out.append("")
        out.extend(_refill_table(group))
    out.append("Metrics are means × 100. score = each example's primary metric; recall@k over the method's "
               "document ranking; evidence recall over the documents it kept. ROUGE-L: rouge-score rougeL F.")
    return "\n".join(out) + "\n"


def _refill_table(group: dict[str, Any]) -> list[str]:
    """The refilling rows read as recall × answered-when-found (empty when no row refills)."""
    rows = {label: e for label, e in group.items() if e.get("refill_coverage") is not None}
    if not rows:
        return []

    def part(e: dict[str, Any], name: str) -> str:
        if e.get(f"score_when_{name}") is None:
            return "– (n=0)"
        low, high = e[f"score_when_{name}_ci"]
        return f"{e[f'score_when_{name}']:.1f} ({low:.0f}–{high:.0f}, n={e[f'score_when_{name}_n']})"

    out = ["| method | recall (overlap) | coverage (tokens) | whole evidence | median rank | "
           "score when refilled | score when missed |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, e in rows.items():
        out.append(f"| {label} | {_fmt(e.get('refill_recall'))} | {_fmt(e['refill_coverage'])} | "
                   f"{_fmt(e['refill_covered'])} | {_fmt(e.get('refill_rank_median'))} | {part(e, 'refilled')} | "
                   f"{part(e, 'missed')} |")
    out.append("")
    return out


def plot(summary: dict[str, Any], path: Path) -> None:
    """Quality (score) against mean attended KV entries, one point per method, one panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, e in summary["overall"].items():
        if e.get("kv_attended") is None or e.get("score") is None:
            continue
        ax.scatter(e["kv_attended"], e["score"], s=36)
        ax.annotate(label, (e["kv_attended"], e["score"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("KV entries attended at the first decoding step (mean per layer)")
    ax.set_ylabel("score (mean × 100)")
    ax.set_title("Quality vs attended-KV budget")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: EvalReport, out_dir: Path) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"predictions": out_dir / "predictions.jsonl", "summary": out_dir / "summary.json",
             "table": out_dir / "results.md", "plot": out_dir / "quality_vs_kv.png"}
    with open(files["predictions"], "w", encoding="utf-8") as f:
        for r in report.rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    files["summary"].write_text(json.dumps(report.summary, indent=2) + "\n", encoding="utf-8")
    files["table"].write_text(markdown_table(report.summary), encoding="utf-8")
    plot(report.summary, files["plot"])
    return {k: str(v) for k, v in files.items()}
