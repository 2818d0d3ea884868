"""Which refill selection brings the *whole* evidence back? Token windows against whole spans, offline.

Not part of the installed package. Run from a checkout (after ``studies/scorer/run.py`` made its root)::

    python studies/scorer/windows.py dump --root checkpoints/scorer-study --cell 2048/squad
    python studies/scorer/windows.py compare --root checkpoints/scorer-study --cell 2048/squad

``dump`` runs the engine's own scoring pass on the *dev* questions that ``calibrate`` uses (SQuAD
training articles, needles at seed 1000; never the evaluation's) and keeps, per question, the ``l2``
scorer's raw-key attention mass per query head and token (mean over the question's tokens) at the
scoring layer, with the evidence ranges, span bounds and budget ``k``. ``compare`` then replays
every selection rule on those masses, with the same token budget (``k`` spans of ``l`` tokens), and
prints whole-evidence recall and token coverage per rule: whole spans (``select_spans``, with and
without neighbours), windows of other widths on finer start grids, and the product's grown refill
(``grow_tokens``). Nothing here is evaluated on held-out questions: it decided which selection the
product offers (``refill.grow``), which ``acre-train calibrate`` then sweeps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import DEV_SEED, log  # noqa: E402

# cell -> (export under ROOT/exports, dev questions, scoring layers to keep)
CELLS = {
    "2048/squad": ("stage2-long", 100, (7,), 4),
    "4096/niah_multikey": ("stage1-long", 60, (3,), 0),
}


def dump(root: Path, cell: str, out: Path) -> None:
    from acre_train.eval.harness import group_by_context
    from acre_train.eval.methods.acre import evidence_token_ranges
    from acre_train.eval.prompt import prepare_example
    from acre_train.eval.tasks import resolve_tasks
    from acre_train.infer import AcreEngine
    from acre_train.infer.load import load_export
    from acre_train.infer.settings import inference_settings
    from acre_train.modeling.scoring import _grouped_logits

    length, task = int(cell.split("/")[0]), cell.split("/")[1]
    name, count, layers, sinks = CELLS[cell]
    export = root / "exports" / name
    if name == "stage2-long" and not (export / "config.json").is_file():
        import run as study

        export = study.export(root)
    model, tokenizer, data = load_export(export, dtype=torch.float32)
    cache_settings, refill = inference_settings(data)
    engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)
    examples = resolve_tasks(task, tokenizer, length, count, DEV_SEED, squad_path=root / "squad-train.json",
                             questions_per_context=4)
    rows = []
    for group in group_by_context([prepare_example(tokenizer, ex, 512) for ex in examples]):
        first = group[0]
        cache = engine.build([*first.prefix_ids, *(t for d in first.doc_ids for t in d)], progress=False)
        for prepared in group:
            evidence = evidence_token_ranges(tokenizer, prepared)
            plan, k = engine.open_chunk(cache, prepared.suffix_ids)
            if not evidence or not 0 < k < cache.num_l1:
                continue
            queries = engine.question_queries(cache, plan, num_tail=len(cache.tail_ids), layers=list(layers))
            mass = {}
            for layer in layers:  # [H, n, N2] per query head and question token (fp16 to keep it small)
                logits = _grouped_logits(queries.at_text(model, layer), queries.l2_keys(model, cache, layer))
                masked = logits.masked_fill(cache.sink_tokens(sinks), float("-inf")) if sinks else logits
                mass[f"{layer}:{sinks}"] = torch.softmax(masked, -1).numpy().astype(np.float16)
            rows.append({"mass": mass, "evidence": np.array(evidence), "bounds": cache.span_bounds.numpy(), "k": k,
                         "num_ctx": cache.num_context_tokens, "first_chunk": cache_settings.first_chunk,
                         "stride": cache_settings.stride})
        log(f"{len(rows)} questions")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, np.array(rows, dtype=object), allow_pickle=True)
    log(f"wrote {out}")


# ------------------------------------------------------------------------------ selection rules
# Every score pools as the product's scorers do: per question token, max over query heads of the mass a
# span (window) holds, then the mean over the question's tokens.

def window_scores(mass: np.ndarray, width: int, starts: np.ndarray) -> np.ndarray:
    """``[H, n, N]`` mass -> one score per window ``[s, s + width)``."""
    csum = np.concatenate([np.zeros(mass.shape[:2] + (1,), np.float32), np.cumsum(mass, -1, dtype=np.float32)], -1)
    return (csum[..., starts + width] - csum[..., starts]).max(0).mean(0)


def span_scores(mass: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    csum = np.concatenate([np.zeros(mass.shape[:2] + (1,), np.float32), np.cumsum(mass, -1, dtype=np.float32)], -1)
    return (csum[..., bounds[1:]] - csum[..., bounds[:-1]]).max(0).mean(0)


def _budget(row) -> tuple[np.ndarray, int, int]:
    bounds = row["bounds"]
    return bounds, int(bounds[-1]), row["k"] * int(np.diff(bounds).max())


def spans_rule(row, neighbors: bool) -> np.ndarray:
    from acre_train.modeling.span_choice import select_spans

    bounds, _, _ = _budget(row)
    mass = row["mass"]
    chosen = select_spans(torch.as_tensor(span_scores(mass, bounds)), row["k"], neighbors=neighbors).numpy()
    seen = np.zeros(mass.shape[-1], bool)
    for j in chosen:
        seen[bounds[j]:bounds[j + 1]] = True
    return seen


def windows_rule(row, width: int, stride: int, extend: bool) -> np.ndarray:
    """Greedy windows: the best window (starts on a ``stride`` grid) with no token taken yet is taken,
    until ``k * l`` tokens are; ``extend``: each taken window brings the better of its two adjacent
    windows (like neighbour refill), within the budget."""
    _, n_closed, budget = _budget(row)
    mass = row["mass"].astype(np.float32)
    starts = np.arange(0, n_closed - width + 1, stride)
    score = dict(zip(starts.tolist(), window_scores(mass[..., :n_closed], width, starts).tolist()))
    seen = np.zeros(mass.shape[-1], bool)
    used = 0
    for s in sorted(score, key=lambda x: -score[x]):
        if used + width > budget:
            break
        if seen[s:s + width].any():
            continue
        seen[s:s + width] = True
        used += width
        if extend and used + width <= budget:
            near = [c for c in (s - width, s + width) if c in score and not seen[c:c + width].any()]
            if near:
                c = max(near, key=lambda c: score[c])
                seen[c:c + width] = True
                used += width
    return seen


def grow_rule(row, seeds: int, shape: str = "attention") -> np.ndarray:
    """The product's token-granular refill (``refill.grow``, ``refill.grow_shape``: ``modeling/span_choice.py:grow_tokens``)."""
    from acre_train.modeling.span_choice import grow_tokens

    _, n_closed, budget = _budget(row)
    mass = [torch.from_numpy(row["mass"].astype(np.float32))]
    width = int(np.diff(row["bounds"]).max())
    taken = grow_tokens(mass, num_tokens=n_closed, budget=budget, width=width, seeds=seeds, heads="max",
                        shape=shape).numpy()
    return np.concatenate([taken, np.zeros(row["mass"].shape[-1] - n_closed, bool)])


def judge(row, seen: np.ndarray) -> tuple[bool, float]:
    seen = np.concatenate([seen, np.ones(max(0, int(row["num_ctx"]) - len(seen)), bool)])
    seen[int(row["bounds"][-1]):] = True  # pending tokens and the raw tail are always visible
    ev = row["evidence"]
    total = sum(b - a for a, b in ev)
    got = sum(int(seen[a:b].sum()) for a, b in ev)
    return got == total, got / max(1, total)


def compare(path: Path) -> None:
    rows = list(np.load(path, allow_pickle=True))
    for r in rows:
        r["mass"] = next(iter(r["mass"].values()))
    width = int(np.diff(rows[0]["bounds"]).max())
    rules = {f"spans{' +neighbors' if near else ''}": (lambda r, near=near: spans_rule(r, near)) for near in (False, True)}
    for w in (width // 2, width, 2 * width):
        for stride in sorted({w, w // 2, w // 4, 1}):
            for ext in (False, True):
                rules[f"windows w{w} s{stride}{' +ext' if ext else ''}"] = \
                    lambda r, w=w, stride=stride, ext=ext: windows_rule(r, w, stride, ext)
    for seeds in (1, 2, 3, 4, 6):
        rules[f"grow={seeds}"] = lambda r, seeds=seeds: grow_rule(r, seeds)
        rules[f"grow={seeds},centered"] = lambda r, seeds=seeds: grow_rule(r, seeds, "centered")
    results = []
    for name, rule in rules.items():
        judged = [judge(r, rule(r)) for r in rows]
        results.append((100 * np.mean([j[0] for j in judged]), 100 * np.mean([j[1] for j in judged]), name))
    results.sort(reverse=True)
    print(f"{len(rows)} dev questions, k median {int(np.median([r['k'] for r in rows]))}, span {width} tokens")
    print("| rule | whole evidence % | coverage % |\n|---|---:|---:|")
    for whole, cov, name in results:
        print(f"| {name} | {whole:.1f} | {cov:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("dump", "compare"))
    parser.add_argument("--root", default="checkpoints/scorer-study")
    parser.add_argument("--cell", default="2048/squad", choices=sorted(CELLS))
    args = parser.parse_args(argv)
    root = Path(args.root)
    out = root / "windows" / (args.cell.replace("/", "-") + ".npy")
    if args.what == "dump":
        dump(root, args.cell, out)
    else:
        compare(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
