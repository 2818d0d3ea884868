"""Where does the calibrated one-region refill still miss the evidence, and what would bring it back? Offline, on dev.

Not part of the installed package. Run from a checkout, after ``studies/scorer/run.py`` (or ``ladder.py``)
made the root's ``stage2-sim-long`` export::

    python studies/scorer/regions.py dump --root checkpoints/scorer-study
    python studies/scorer/regions.py compare --root checkpoints/scorer-study

The 2K SQuAD cell's calibrated setting (``l2:layers=7+9,heads=max,sinks=4,keep_sinks=1,query=question
+grow=1,sentences``) brings the whole evidence back for 85 of the 100 dev questions and 87.5 % of the
held-out ones. ``dump`` runs the product's own selection (``modeling/ranking.py:choose_refill``) on the
*dev* questions ``calibrate`` uses (SQuAD training articles, one question per context, seed 1000; never
the evaluation's) and keeps what it was given: the per-token mass, the tokens taken before any region
(kept sinks), the sentence ends, the evidence and the product's own choice. ``compare`` checks that the
replay equals the product's choice, says for each miss why it missed (the region elsewhere, or beside
the evidence and cut), and replays other region rules on the same masses within the same budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import DEV_SEED, log  # noqa: E402
from sentences import judge  # noqa: E402

SETTING = {"scorer": "l2:layers=7+9,heads=max,sinks=4,keep_sinks=1,query=question", "grow": 1,
           "grow_shape": "sentences"}
EXPORT = "stage2-sim-long"


def dump(root: Path, out: Path, count: int = 100) -> None:
    import acre_train.modeling.ranking as ranking
    from acre_train.eval.methods.acre import evidence_token_ranges
    from acre_train.eval.prompt import prepare_example
    from acre_train.eval.tasks import resolve_tasks
    from acre_train.infer import AcreEngine
    from acre_train.infer.load import load_export
    from acre_train.infer.settings import inference_settings

    model, tokenizer, data = load_export(root / "exports" / EXPORT, dtype=torch.float32)
    cache_settings, refill = inference_settings(data, SETTING)
    engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)
    scorer = refill.scorer
    layers = scorer.resolved_layers(model.config.num_hidden_layers)
    seen: dict = {}
    product_grow = ranking.grow_tokens

    def capture(mass, **kw):  # what the product's selection is given, kept as it was given
        seen.update(mass=[m.cpu() for m in mass], **kw)
        return product_grow(mass, **kw)

    ranking.grow_tokens = capture
    examples = resolve_tasks("squad", tokenizer, 2048, count, DEV_SEED, squad_path=root / "squad-train.json")
    rows = []
    for ex in examples:
        prepared = prepare_example(tokenizer, ex, 512)
        ids = [*prepared.prefix_ids, *(t for d in prepared.doc_ids for t in d)]
        cache = engine.build(ids, progress=False)
        evidence = evidence_token_ranges(tokenizer, prepared)
        plan, k = engine.open_chunk(cache, prepared.suffix_ids)
        if not evidence or not 0 < k < cache.num_l1:
            continue
        queries = engine.question_queries(cache, plan, num_tail=len(cache.tail_ids), layers=layers)
        _, chosen = ranking.choose_refill(model, cache, queries, scorer, k, grow=1, grow_shape="sentences")
        rows.append({"mass": [m.numpy().astype(np.float32) for m in seen["mass"]],
                     "taken": seen["taken"].numpy().copy(), "budget": seen["budget"], "width": seen["width"],
                     "ends": seen["sentence_ends"].numpy(), "chosen": chosen.numpy(), "evidence": np.array(evidence),
                     "bounds": cache.span_bounds.numpy(), "k": k, "ids": np.array(ids),
                     "num_ctx": cache.num_context_tokens, "id": ex.id})
        if len(rows) % 10 == 0:
            log(f"{len(rows)} questions")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, np.array(rows, dtype=object), allow_pickle=True)
    log(f"wrote {out}")


def seg(mass, starts, stops) -> np.ndarray:
    """The product's pooled mass of each segment (max over heads of the segment's sum, as the scorer pools)."""
    from acre_train.modeling.scoring import segment_scores

    return segment_scores(mass, torch.as_tensor(starts), torch.as_tensor(stops), "max").numpy()


def product(row, mass, seeds: int = 1, shape: str = "sentences") -> np.ndarray:
    from acre_train.modeling.span_choice import grow_tokens

    return grow_tokens(mass, num_tokens=len(row["taken"]), budget=row["budget"], width=row["width"], seeds=seeds,
                       heads="max", taken=torch.from_numpy(row["taken"]), shape=shape,
                       sentence_ends=torch.from_numpy(row["ends"])).numpy()


def sentences_of(row) -> np.ndarray:
    """``[S + 1]`` cuts: sentence ``i`` is ``[cuts[i], cuts[i + 1])``."""
    n = len(row["taken"])
    return np.unique(np.concatenate([[0], np.flatnonzero(row["ends"][:n]) + 1, [n]]))


def free(row) -> int:
    return int(row["budget"]) - int(row["taken"].sum())


def free_masked(row, mass):
    keep = torch.ones(mass[0].shape[-1])
    keep[: len(row["taken"])] = torch.from_numpy(~row["taken"]).float()
    return [m * keep for m in mass]


def top_sentences(row, mass, key: str, context: int = 0) -> np.ndarray:
    """Whole sentences, best first by ``key`` (``sum``: their mass; ``mean``: mass per token), while they fit
    the free budget; ``context``: each taken sentence brings up to that many tokens of its neighbours."""
    taken = row["taken"].copy()
    cuts = sentences_of(row)
    m = free_masked(row, mass)
    a, b = cuts[:-1], cuts[1:]
    score = seg(m, a, b)
    if key == "mean":
        score = score / np.maximum(1, b - a)
    left = free(row)
    for i in np.argsort(-score, kind="stable"):
        size = int((~taken[a[i]:b[i]]).sum())
        if size == 0:
            continue
        if size > left:
            continue
        taken[a[i]:b[i]] = True
        left -= size
        for lo, hi in ((max(0, a[i] - context), a[i]), (b[i], min(len(taken), b[i] + context))):
            extra = np.flatnonzero(~taken[lo:hi])[:left] + lo
            taken[extra] = True
            left -= len(extra)
    return taken


def sentence_fill(row, mass) -> np.ndarray:
    """The product's region, whose leftover budget (the even widening that cuts a sentence at each edge) goes
    to whole neighbouring sentences instead, the better-attended side first."""
    base = product(row, mass)
    region = base & ~row["taken"]
    idx = np.flatnonzero(region)
    if len(idx) == 0:
        return base
    cuts = sentences_of(row)
    # Shrink the region to the whole sentences inside it, then add whole sentences on either side.
    lo = cuts[np.searchsorted(cuts, idx[0], side="left")]
    hi = cuts[np.searchsorted(cuts, idx[-1] + 1, side="right") - 1]
    taken = row["taken"].copy()
    if hi <= lo:
        return base
    taken[lo:hi] = True
    left = free(row) - int(region[lo:hi].sum())
    m = free_masked(row, mass)
    while True:
        i, j = np.searchsorted(cuts, lo) - 1, np.searchsorted(cuts, hi) + 1
        options = []
        if i >= 0 and lo - cuts[i] <= left:
            options.append((float(seg(m, [cuts[i]], [lo])[0]), cuts[i], hi))
        if j < len(cuts) and cuts[j] - hi <= left:
            options.append((float(seg(m, [hi], [cuts[j]])[0]), lo, cuts[j]))
        if not options:
            break
        _, nlo, nhi = max(options)
        left -= (lo - nlo) + (nhi - hi)
        taken[nlo:lo] = True
        taken[hi:nhi] = True
        lo, hi = nlo, nhi
    return taken


def chunk_starts(row, n: int, first_chunk: int = 1024, stride: int = 512) -> np.ndarray:
    """``[N2]`` bool: the first ``n`` tokens of the context and of every chunk (the study's geometry)."""
    t = np.arange(row["mass"][0].shape[-1])
    return (t < n) | ((t >= first_chunk) & ((t - first_chunk) % stride < n))


def sink_rule(row, mass, unscored: int = 0, out_of_softmax: int = 4) -> np.ndarray:
    """One region on sentences with ``keep_sinks=tokens`` (the first span whole, the 4 sink tokens of every
    later chunk kept) instead of whole sink spans. ``unscored``: the first N tokens of every chunk count for
    no region (their mass zeroed, the product's ``unscored``); ``out_of_softmax``: the first N leave the
    softmax instead (the product's ``sinks``; the dump's mass already has the first 4 out)."""
    from acre_train.modeling.span_choice import grow_tokens

    n, width = len(row["taken"]), int(row["width"])
    taken = chunk_starts(row, 4)[:n]
    taken[:width] = True
    out = []
    for m in mass:
        m = m.numpy().copy()
        if out_of_softmax > 4:  # renormalised, as if they had never been in the softmax
            m[..., chunk_starts(row, out_of_softmax)] = 0.0
            m = m / m.sum(-1, keepdims=True)
        if unscored:
            m[..., chunk_starts(row, unscored)] = 0.0
        out.append(torch.from_numpy(m))
    return grow_tokens(out, num_tokens=n, budget=row["budget"], width=width, seeds=1, heads="max",
                       taken=torch.from_numpy(taken), shape="sentences", sentence_ends=torch.from_numpy(row["ends"])).numpy()


def compare(root: Path, path: Path) -> None:
    rows = list(np.load(path, allow_pickle=True))
    masses = [[torch.from_numpy(m) for m in r["mass"]] for r in rows]
    same = sum(bool((product(r, m) == r["chosen"][: len(r["taken"])]).all()) for r, m in zip(rows, masses))
    print(f"{len(rows)} dev questions; the replay equals the product's choice for {same}; k median "
          f"{int(np.median([r['k'] for r in rows]))}, free budget median {int(np.median([free(r) for r in rows]))} "
          f"tokens, sentence median {int(np.median([np.median(np.diff(sentences_of(r))) for r in rows]))} tokens")
    rules = {"product: one region on sentences": lambda r, m: product(r, m),
             "two regions on sentences": lambda r, m: product(r, m, 2),
             "whole-sentence fill": sentence_fill,
             "top sentences by mass": lambda r, m: top_sentences(r, m, "sum"),
             "top sentences by mass per token": lambda r, m: top_sentences(r, m, "mean"),
             "top sentences by mass, 16 tokens either side": lambda r, m: top_sentences(r, m, "sum", 16),
             "keep_sinks=tokens (sinks=4)": lambda r, m: sink_rule(r, m)}
    for n in (16, 24):
        rules[f"keep_sinks=tokens, sinks={n} (out of the softmax)"] = lambda r, m, n=n: sink_rule(r, m, 0, n)
    for n in (8, 16, 32):
        rules[f"keep_sinks=tokens, sinks=4, unscored={n}"] = lambda r, m, n=n: sink_rule(r, m, n)
    results = {name: [judge(r, rule(r, m)) for r, m in zip(rows, masses)] for name, rule in rules.items()}
    print("| rule | whole evidence % | coverage % | overlap % |\n|---|---:|---:|---:|")
    for name, judged in results.items():
        j = np.array(judged, dtype=float)
        print(f"| {name} | {100 * j[:, 0].mean():.0f} | {100 * j[:, 1].mean():.1f} | {100 * j[:, 2].mean():.0f} |")
    print("\nmisses of the product:")
    for r, m, (whole, cov, over) in zip(rows, masses, results["product: one region on sentences"]):
        if whole:
            continue
        ev = r["evidence"]
        n = len(r["taken"])
        region = np.flatnonzero(product(r, m) & ~r["taken"])
        cuts = sentences_of(r)
        sent = seg(free_masked(r, m), cuts[:-1], cuts[1:])
        holding = [i for i in range(len(cuts) - 1) if cuts[i] < ev[0][1] and cuts[i + 1] > ev[0][0]]
        rank = [int((sent > sent[i]).sum()) for i in holding]
        print(f"  {r['id']}: evidence {ev.tolist()} ({sum(b - a for a, b in ev)} tok, ctx {n}), region "
              f"{region[0] if len(region) else '-'}..{region[-1] + 1 if len(region) else '-'}, coverage {cov:.2f}; "
              f"evidence sentences rank {rank} of {len(cuts) - 1}, lengths {[int(cuts[i + 1] - cuts[i]) for i in holding]}")


def main(argv: list[str] | None = None) -> int:
    from run import offline_main

    return offline_main(__doc__, "regions", dump, compare, argv)


if __name__ == "__main__":
    sys.exit(main())
