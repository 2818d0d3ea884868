"""Does a region that ends on sentence boundaries bring the whole answer sentence back? Offline, on dev.

Not part of the installed package. Run from a checkout, after ``grow.py --name sink-tokens`` made its
export (a copy of the refill-simulated stage 1+2 export)::

    python studies/scorer/sentences.py dump --root checkpoints/scorer-study
    python studies/scorer/sentences.py compare --root checkpoints/scorer-study

The 2K SQuAD cell's committed scorer (``l2:layers=7+9,heads=max,sinks=4,keep_sinks=1 +grow=1,densest``)
places one region of the budget's share where the question's raw-key mass is densest, and cuts the answer
sentence at the region's edge for about a quarter of the questions (docs/real-base.md). ``dump`` keeps,
per *dev* question (SQuAD training articles, the questions ``calibrate`` uses; never the evaluation's),
the product's own per-token mass (``modeling/ranking.py:question_mass``), the tokens the kept sinks
take, the context's token ids and the evidence ranges. ``compare`` replays the product's ``densest``
selection on them and, beside it, regions made of whole sentences (sentence ends found from the
tokens' text), and prints whole-evidence recall, coverage and overlap per rule.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import DEV_SEED, log  # noqa: E402

SCORER = "l2:layers=7+9,heads=max,sinks=4,keep_sinks=1"
EXPORT = "sink-tokens-2048-squad"


def dump(root: Path, out: Path, count: int = 100) -> None:
    from acre_train.eval.harness import group_by_context
    from acre_train.eval.methods.acre import evidence_token_ranges
    from acre_train.eval.prompt import prepare_example
    from acre_train.eval.tasks import resolve_tasks
    from acre_train.infer import AcreEngine
    from acre_train.infer.load import load_export
    from acre_train.infer.settings import inference_settings
    from acre_train.modeling.ranking import forced_spans, question_mass
    from acre_train.modeling.scorer_spec import ScorerSettings
    from acre_train.modeling.span_choice import span_tokens

    model, tokenizer, data = load_export(root / "exports" / EXPORT, dtype=torch.float32)
    cache_settings, refill = inference_settings(data)
    engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)
    scorer = ScorerSettings.parse(SCORER)
    examples = resolve_tasks("squad", tokenizer, 2048, count, DEV_SEED, squad_path=root / "squad-train.json",
                             questions_per_context=4)
    rows = []
    for group in group_by_context([prepare_example(tokenizer, ex, 512) for ex in examples]):
        first = group[0]
        ids = [*first.prefix_ids, *(t for d in first.doc_ids for t in d)]
        cache = engine.build(ids, progress=False)
        for prepared in group:
            evidence = evidence_token_ranges(tokenizer, prepared)
            plan, k = engine.open_chunk(cache, prepared.suffix_ids)
            if not evidence or not 0 < k < cache.num_l1:
                continue
            layers = scorer.resolved_layers(model.config.num_hidden_layers)
            queries = engine.question_queries(cache, plan, num_tail=len(cache.tail_ids), layers=layers)
            mass = question_mass(model, cache, queries, scorer)
            forced = forced_spans(cache, scorer)
            taken = span_tokens(cache.span_bounds, torch.nonzero(forced).flatten()[:k])
            rows.append({"mass": [m.numpy().astype(np.float16) for m in mass], "taken": taken.numpy(),
                         "evidence": np.array(evidence), "bounds": cache.span_bounds.numpy(), "k": k,
                         "ids": np.array(ids), "num_ctx": cache.num_context_tokens})
        log(f"{len(rows)} questions")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, np.array(rows, dtype=object), allow_pickle=True)
    log(f"wrote {out}")


def densest(row, mass, ends: np.ndarray | None = None, shape: str = "densest") -> np.ndarray:
    """The product's selection (``grow_tokens``, one seed) on the dumped mass."""
    from acre_train.modeling.span_choice import grow_tokens

    bounds = row["bounds"]
    n, width = int(bounds[-1]), int(np.diff(bounds).max())
    taken = grow_tokens(mass, num_tokens=n, budget=row["k"] * width, width=width, seeds=1, heads="max",
                        taken=torch.from_numpy(row["taken"]), shape=shape,
                        sentence_ends=None if ends is None else torch.from_numpy(ends))
    return taken.numpy()


def free_mass(row, mass) -> np.ndarray:
    """Per token: the pooled mass (max over heads per question token, mean over tokens and layers) of
    tokens not taken yet."""
    n = int(row["bounds"][-1])
    per = np.mean([m[..., :n].max(0).mean(0) for m in (x.numpy() for x in mass)], axis=0)
    return per * ~row["taken"]


def sentence_region(row, mass, ends: np.ndarray, fill: str, near: np.ndarray | None = None) -> np.ndarray:
    """One region of whole sentences (at most the free budget) holding the most mass; ``fill``: what the
    budget left over does: ``none``, ``even`` (both sides alike), or ``dense`` (the densest way).
    ``near`` ``[N]`` bool: only regions overlapping these tokens (the densest window) compete."""
    bounds = row["bounds"]
    n, width = int(bounds[-1]), int(np.diff(bounds).max())
    taken = row["taken"].copy()
    budget = row["k"] * width - int(taken.sum())
    per = free_mass(row, mass)
    csum = np.concatenate([[0.0], np.cumsum(per)])
    cuts = np.concatenate([[0], np.flatnonzero(ends[:n]) + 1, [n]])
    cuts = np.unique(cuts)
    best, region = -1.0, None
    j = 0
    for i in range(len(cuts) - 1):  # sentences cuts[i]..cuts[j]: the longest run from i within the budget
        j = max(j, i + 1)
        while j + 1 < len(cuts) and cuts[j + 1] - cuts[i] <= budget:
            j += 1
        a, b = cuts[i], cuts[j]
        if b - a > budget:  # one sentence longer than the budget: its densest window
            win = csum[a + budget:b + 1] - csum[a:b - budget + 1]
            a = a + int(np.argmax(win))
            b = a + budget
        if near is not None and not near[a:b].any():
            continue
        if csum[b] - csum[a] > best:
            best, region = csum[b] - csum[a], (a, b)
    a, b = region
    left = budget - (b - a) - int(taken[a:b].sum())
    if fill == "even" and left > 0:
        a, b = max(0, a - left // 2), min(n, b + (left - left // 2))
    elif fill == "dense" and left > 0:
        opts = [(csum[min(n, b + left - x)] - csum[max(0, a - x)], x) for x in range(left + 1)]
        x = max(opts)[1]
        a, b = max(0, a - x), min(n, b + left - x)
    taken[a:b] = True
    return taken


def fits(row) -> bool:
    """Could one region of the free budget hold the whole evidence (refilled, taken or in the tail)?"""
    n, width = int(row["bounds"][-1]), int(np.diff(row["bounds"]).max())
    need = np.zeros(int(row["num_ctx"]), bool)
    for a, b in row["evidence"]:
        need[a:b] = True
    need[n:] = False
    need[:n] &= ~row["taken"]
    idx = np.flatnonzero(need)
    return len(idx) == 0 or idx[-1] - idx[0] + 1 <= row["k"] * width - int(row["taken"].sum())


def judge(row, seen: np.ndarray) -> tuple[bool, float, bool]:
    seen = np.concatenate([seen, np.ones(max(0, int(row["num_ctx"]) - len(seen)), bool)])
    ev = row["evidence"]
    total = sum(b - a for a, b in ev)
    got = sum(int(seen[a:b].sum()) for a, b in ev)
    return got == total, got / max(1, total), got > 0


def compare(root: Path, path: Path) -> None:
    from acre_train.data.tokenizer import auto_tokenizer
    from acre_train.infer.sentences import sentence_ends

    tokenizer = auto_tokenizer(str(root / "exports" / EXPORT), trust_remote_code=False)
    rows = list(np.load(path, allow_pickle=True))
    rules = {"densest (committed)": lambda r, m, e: densest(r, m),
             "grow shape `sentences` (the product's)": lambda r, m, e: densest(r, m, e, "sentences")}
    for fill in ("none", "even", "dense"):
        rules[f"sentences, fill {fill}"] = lambda r, m, e, fill=fill: sentence_region(r, m, e, fill)
    for fill in ("none", "even"):
        rules[f"densest, snapped to sentences, fill {fill}"] = \
            lambda r, m, e, fill=fill: sentence_region(r, m, e, fill, near=densest(r, m) & ~r["taken"])
    def core(r, m, share):  # the densest window's middle ``share``
        win = densest(r, m) & ~r["taken"]
        idx = np.flatnonzero(win)
        cut = int(len(idx) * (1 - share) / 2)
        out = np.zeros_like(win)
        out[idx[cut:len(idx) - cut]] = True
        return out

    for share in (0.5, 0.25):
        rules[f"densest, snapped around its middle {share:.0%}, fill even"] = \
            lambda r, m, e, share=share: sentence_region(r, m, e, "even", near=core(r, m, share))
    results = {name: [] for name in rules}
    lengths = []
    for row in rows:
        mass = [torch.from_numpy(m.astype(np.float32)) for m in row["mass"]]
        ends = sentence_ends(tokenizer, row["ids"].tolist()).numpy()
        lengths.append(np.diff(np.flatnonzero(ends[: int(row["bounds"][-1])])).mean())
        for name, rule in rules.items():
            results[name].append(judge(row, rule(row, mass, ends)))
    print(f"{len(rows)} dev questions; k median {int(np.median([r['k'] for r in rows]))}; "
          f"mean sentence {np.mean(lengths):.0f} tokens; one region placed by an oracle could hold the whole "
          f"evidence for {100 * np.mean([fits(r) for r in rows]):.0f} %")
    print("| rule | whole evidence % | coverage % | overlap % |\n|---|---:|---:|---:|")
    for name, judged in results.items():
        j = np.array(judged, dtype=float)
        print(f"| {name} | {100 * j[:, 0].mean():.0f} | {100 * j[:, 1].mean():.1f} | {100 * j[:, 2].mean():.0f} |")


def main(argv: list[str] | None = None) -> int:
    from run import offline_main

    return offline_main(__doc__, "sentences", dump, compare, argv)


if __name__ == "__main__":
    sys.exit(main())
