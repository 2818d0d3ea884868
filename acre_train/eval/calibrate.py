"""``acre-train calibrate EXPORT --data DEV``: pick the refill scorer on questions whose evidence is known.

For every dev question the export's engine builds the context's bi-layer cache once (shared by the
questions asked of it) and runs one scoring pass that captures the question's queries at every
layer of the sweep. Every setting of the sweep (scorer × layer × head pooling × sink tokens × kept
sinks × selection: whole spans, with or without neighbours, or tokens from 1-4 seeds, grown by attention
or centred on them) then ranks and selects from those queries, at the export's geometry and budget
``k``, and is scored by what it brought back:

* ``covered``: share of questions whose whole evidence was visible after refilling (the criterion);
* ``coverage``: share of evidence tokens visible; ``recall``: share of evidence ranges overlapped;
* ``rank``: median rank of the best-scored span holding evidence.

The best setting (most ``covered``, then ``coverage``, then the lower median rank, then the simpler
setting) is written into the export's ``config.json`` (``acre.inference.scorer`` / ``neighbors`` /
``grow`` / ``grow_shape``), which ``chat``, ``generate`` and ``eval`` then use; the whole table goes beside it
(``calibration.json``, ``calibration.md``). With ``--cost-slack P`` the settings within ``P`` points of
the best's ``covered`` come first, cheapest scoring pass first (``score_layers``: the layers a
question runs before its refill, the last scoring layer + 1), so a shallow scorer that loses one dev
question of thirty-two is stored over a deep one. Inference only: nothing is trained. Calibrate on a dev
split (training articles, needles at other seeds), never on the questions you report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..infer.placement import Placement, add_placement_arguments, requested_device
from ..modeling.scorer_spec import ScorerSettings
from ..modeling.selection_words import GROW_SHAPES, KEEP_SINKS, QUERIES
from ..infer.settings import selection_suffix
from ..modeling.selection import PATH_KEYS, LengthBands, Selection


@dataclass(frozen=True)
class Candidate:
    """One setting of the sweep."""

    scorer: ScorerSettings
    neighbors: bool
    grow: int = 0
    grow_shape: str = "attention"

    def describe(self) -> str:
        return self.scorer.describe() + selection_suffix(self.neighbors, self.grow, self.grow_shape)

    def selection(self, positions: str = "compact") -> Selection:
        """This setting as the typed selection an export stores (``positions``: the export's own)."""
        return Selection(scorer=self.scorer, neighbors=self.neighbors, grow=self.grow, grow_shape=self.grow_shape,
                         positions=positions)

    def simplicity(self) -> tuple:
        """Lower = simpler (the tie-break): fewer options switched on."""
        s = self.scorer
        return (int(self.neighbors) + int(self.grow > 0) + int(bool(s.keep_sinks)) + int(s.sinks > 0) + int(s.heads != "mean")
                + int(s.learned) + int(self.grow_shape != "attention") + int(s.query != "all") + int(s.unscored > 0),
                len(s.layers), self.grow)


def sweep(num_layers: int, *, kinds: Sequence[str] = ("l1", "l2", "bounds"),
          layers: Sequence[int | Sequence[int]] | None = None,
          heads: Sequence[str] = ("mean", "max"), sinks: Sequence[int] = (0, 4),
          neighbors: Sequence[bool] = (False, True), learned_layers: Sequence[int] = (),
          grow: Sequence[int] = (), grow_shapes: Sequence[str] = ("attention",),
          keep_sinks: Sequence[str] = ("spans",), queries: Sequence[str] = ("all",),
          unscored: Sequence[int] = (0,)) -> list[Candidate]:
    """The settings to compare. ``layers``: one scoring layer, or a tuple of layers whose scores are
    averaged (one setting); default: every third layer and the last. ``learned_layers``: the layers of
    the export's learned scorer, swept again with ``learned=1``. ``grow``: seed counts of
    token-granular refill, swept beside the span rules for every ``l2`` setting, in each of ``grow_shapes``.
    ``keep_sinks``: the ways of keeping sinks swept beside not keeping them (``tokens`` only where tokens
    are grown: for whole spans it is ``spans``). ``queries``: which of the question's tokens every setting
    pools over, ``all`` and/or ``question`` (its own words, not the template around it). ``unscored``: the
    chunk-start tokens whose mass counts for no refill, swept for every ``l2`` setting.

    >>> len(sweep(4, kinds=("l1",), layers=(0, 3), sinks=(0,)))
    8
    >>> sorted({c.scorer.layers for c in sweep(4, kinds=("l1",), layers=(0, (1, 3)), sinks=(0,))})
    [(0,), (1, 3)]
    >>> len(sweep(4, kinds=("l1",), layers=(0, 3), sinks=(0,), learned_layers=(3,)))
    12
    >>> grid = sweep(4, kinds=("l2",), layers=(0,), heads=("max",), neighbors=(False,), grow=(1,), keep_sinks=("spans", "tokens"))
    >>> sorted((c.grow, c.scorer.keep_sinks) for c in grid if c.scorer.sinks)
    [(0, ''), (0, 'spans'), (1, ''), (1, 'spans'), (1, 'tokens')]
    >>> len(sweep(4, kinds=("l1",), layers=(0, 3), sinks=(0,), queries=("all", "question")))
    16
    >>> [c.scorer.describe() for c in sweep(4, kinds=("l1", "l2"), layers=(0,), heads=("max",), sinks=(4,),
    ...                                     neighbors=(False,), unscored=(0, 16)) if c.scorer.kind == "l2"]
    ['l2:layers=0,heads=max,sinks=4', 'l2:layers=0,heads=max,sinks=4,keep_sinks=1', 'l2:layers=0,heads=max,sinks=4,keep_sinks=1,unscored=16']
    """
    layers = list(layers) if layers is not None else sorted({*range(0, num_layers, 3), num_layers - 1})
    out = []
    grid = [(layer, False) for layer in layers] + [(layer, True) for layer in learned_layers]
    for kind, (layer, learned), pool, near, query in itertools.product(kinds, grid, heads, neighbors, queries):
        for sink, keep in ([(0, "")] if kind == "l1" else [(s, k) for s in sinks for k in ("", *keep_sinks) if s or not k]):
            for quiet in (unscored if kind == "l2" and keep else (0,)):  # unscored needs kept sinks
                scorer = ScorerSettings(kind, _layer_set(layer), pool, int(sink), keep, learned, query, int(quiet))
                if keep != "tokens":
                    out.append(Candidate(scorer, bool(near)))
                if kind == "l2" and not near:
                    out.extend(Candidate(scorer, False, int(g), shape) for g in grow if g > 0 for shape in grow_shapes)
    return out


def _layer_set(layer: int | Sequence[int]) -> tuple[int, ...]:
    return (int(layer),) if isinstance(layer, int) else tuple(int(x) for x in layer)


def calibrate(model, tokenizer, examples, candidates: Sequence[Candidate], *, overrides: dict[str, Any] | None = None,
              chunk_tokens: int = 512, progress: bool = True) -> list[dict[str, Any]]:
    """One row per candidate (``covered``, ``coverage``, ``recall``, ``rank``, ``n``), best first."""
    from tqdm.auto import tqdm

    from ..infer import AcreEngine
    from ..modeling.ranking import choose_refill
    from ..infer.settings import inference_settings
    from .harness import group_by_context
    from .methods.acre import evidence_token_ranges, evidence_visibility
    from .prompt import prepare_example

    cache_settings, refill = inference_settings(model.config, overrides or {})
    engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)
    n_layers = model.config.num_hidden_layers
    wanted = sorted({x for c in candidates for x in c.scorer.resolved_layers(n_layers)})
    tallies: list[list[dict[str, Any]]] = [[] for _ in candidates]
    groups = group_by_context([prepare_example(tokenizer, ex, chunk_tokens) for ex in examples])
    bar = tqdm(total=sum(len(g) for g in groups), desc="calibrate", unit="question", disable=not progress)
    skipped, budgets = 0, []
    for group in groups:
        first = group[0]
        cache = engine.build([*first.prefix_ids, *(t for d in first.doc_ids for t in d)], progress=False)
        for prepared in group:
            bar.update(1)
            evidence = evidence_token_ranges(tokenizer, prepared)
            plan, k = engine.open_chunk(cache, prepared.suffix_ids)
            if not evidence or not 0 < k < cache.num_l1:
                skipped += 1
                continue
            budgets.append((k, cache.num_l1))
            queries = engine.question_queries(cache, plan, num_tail=len(cache.tail_ids), layers=wanted)
            for tally, cand in zip(tallies, candidates):
                scores, tokens = choose_refill(model, cache, queries, cand.scorer, k, neighbors=cand.neighbors,
                                               grow=cand.grow, grow_shape=cand.grow_shape)
                tally.append(evidence_visibility(evidence, cache, tokens, scores))
    bar.close()
    if not any(tallies):
        raise ValueError(f"no dev question could rank spans ({skipped} skipped: no known evidence, or k is 0 "
                         "or every span at this geometry); use longer contexts or examples with evidence")
    rows = []
    k_median, m_median = (sorted(b[i] for b in budgets)[len(budgets) // 2] for i in (0, 1))
    for cand, tally in zip(candidates, tallies):
        ranks = sorted(t["refill_rank"] for t in tally if t["refill_rank"] is not None)
        rows.append({"setting": cand.describe(), "scorer": cand.scorer.as_dict(), "neighbors": cand.neighbors,
                     "grow": cand.grow, "grow_shape": cand.grow_shape,
                     "n": len(tally), "skipped": skipped, "k": k_median, "num_l1": m_median,
                     "covered": 100.0 * sum(t["refill_coverage"] >= 1.0 for t in tally) / len(tally),
                     "coverage": 100.0 * sum(t["refill_coverage"] for t in tally) / len(tally),
                     "recall": 100.0 * sum(t["refill_recall"] for t in tally) / len(tally),
                     "rank": ranks[len(ranks) // 2] if ranks else None,
                     "score_layers": max(cand.scorer.resolved_layers(n_layers)) + 1, "_simple": cand.simplicity()})
    rows.sort(key=lambda r: (-r["covered"], -r["coverage"], r["rank"] if r["rank"] is not None else 1e9, r["_simple"]))
    for r in rows:
        del r["_simple"]
    return rows


def prefer_cheaper(rows: list[dict[str, Any]], slack: float) -> list[dict[str, Any]]:
    """``rows`` (best first) with those within ``slack`` points of the best ``covered`` moved to the
    front, the fewest ``score_layers`` first (ties keep their order); the rest follow unchanged.

    >>> rows = [{"covered": 59.4, "score_layers": 10}, {"covered": 56.2, "score_layers": 4},
    ...         {"covered": 50.0, "score_layers": 1}]
    >>> [r["score_layers"] for r in prefer_cheaper(rows, 3.2)]
    [4, 10, 1]
    >>> prefer_cheaper(rows, 0.0) == rows
    True
    """
    if slack < 0:
        raise ValueError(f"--cost-slack takes points of whole evidence >= 0, got {slack}")
    if slack == 0 or not rows:
        return rows
    near = [r for r in rows if r["covered"] >= rows[0]["covered"] - slack]
    return sorted(near, key=lambda r: r["score_layers"]) + rows[len(near):]


def markdown(rows: list[dict[str, Any]], top: int = 15) -> str:
    """The best ``top`` settings, and the best of each scorer kind, as one table."""
    best_of_kind = {}
    for r in rows:
        best_of_kind.setdefault(r["scorer"]["kind"], r)
    shown = rows[:top] + [r for r in best_of_kind.values() if r not in rows[:top]]
    out = ["| # | setting | whole evidence % | coverage % | overlap recall % | median rank | layers scored |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in shown:
        out.append(f"| {rows.index(r) + 1} | `{r['setting']}` | {r['covered']:.1f} | {r['coverage']:.1f} | "
                   f"{r['recall']:.1f} | {r['rank'] if r['rank'] is not None else '–'} | {r.get('score_layers', '–')} |")
    return "\n".join(out) + "\n"


def band_limits(lengths: Sequence[int]) -> list[int | None]:
    """Where each calibrated length's band ends: halfway (geometrically) to the next length; the last is open.

    >>> band_limits([4096, 16384, 65536])
    [8192, 32768, None]
    """
    lengths = sorted(lengths)
    return [int(round((a * b) ** 0.5)) for a, b in zip(lengths, lengths[1:])] + [None]


def write_choice(export: Path, per_length: Sequence[tuple[int, list[dict[str, Any]]]], meta: dict[str, Any]) -> Selection | LengthBands:
    """Store the best setting (one calibrated length) or one per length band (several) in
    ``export/config.json``, and the tables beside it (each file atomically). The export's stored
    ``positions`` and question path (``close_tail``, ``refill_after_tail``, ``reuse_score_pass``) are kept."""
    from ..files import write_text_atomic

    config_path = export / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    inference = config.setdefault("acre", {}).setdefault("inference", {})
    positions = inference.get("positions", "compact")
    tail = {key: bool(inference.get(key, False)) for key in PATH_KEYS}
    per_length = sorted(per_length, key=lambda item: item[0])
    chosen = [Selection(**{**_best_selection(rows, positions).__dict__, **tail}) for _, rows in per_length]
    inference.update(chosen[0].to_dict())
    result: Selection | LengthBands = chosen[0]
    if len(chosen) > 1:
        result = LengthBands(tuple(zip(band_limits([n for n, _ in per_length]), chosen)))
        inference["bands"] = result.describe()
    else:
        inference.pop("bands", None)
    body = {**meta, "chosen": chosen[0].describe(), "rows": per_length[0][1]}  # one length: the layout studies read
    if len(chosen) > 1:
        body = {**meta, "chosen": result.describe(),
                "lengths": [{"context_tokens": n, "rows": rows} for n, rows in per_length]}
    write_text_atomic(export / "calibration.json", json.dumps(body, indent=2) + "\n")
    parts = ["# Refill selection calibration\n"]
    for (n, rows), selection in zip(per_length, chosen):
        parts.append(f"## {n:,}-token contexts\n\n{meta['data']}: {rows[0]['n']} questions, k = {rows[0]['k']} of "
                     f"{rows[0]['num_l1']} spans (medians); chosen: `{selection.describe()}`\n\n" + markdown(rows))
    if len(chosen) > 1:
        parts.append("## Length bands stored\n\n" + "\n".join(f"- `{line}`" for line in result.describe()) + "\n")
    write_text_atomic(export / "calibration.md", "\n".join(parts))
    write_text_atomic(config_path, json.dumps(config, indent=2) + "\n")
    return result


def _best_selection(rows: list[dict[str, Any]], positions: str) -> Selection:
    best = rows[0]
    return Selection(scorer=ScorerSettings.parse(best["scorer"]), neighbors=best["neighbors"], grow=best.get("grow", 0),
                     grow_shape=best.get("grow_shape", "attention"), positions=positions,
                     max_refill=best.get("max_refill"))


# ------------------------------------------------------------------------------------------ CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", help="a folder written by 'acre-train export'")
    parser.add_argument("--data", required=True,
                        help="dev questions with known evidence: a task JSONL file (rows with 'gold_spans'), or "
                             "built-ins: squad (with --squad), niah_multikey, niah_single, ... Never the eval split.")
    parser.add_argument("--squad", default=None, help="SQuAD JSON for --data squad (e.g. the training articles)")
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[2048],
                        help="built-in data: context length(s); several store one choice per length band, the band "
                             "ending halfway to the next length (default: 2048)")
    parser.add_argument("--num-examples", type=int, default=100, help="built-in data: questions (default: 100)")
    parser.add_argument("--seed", type=int, default=1000,
                        help="built-in data: seed (default: 1000; use one your evaluation does not)")
    parser.add_argument("--questions-per-context", type=int, default=4,
                        help="built-in squad / niah_multikey: questions sharing one cache (default: 4)")
    parser.add_argument("--scorers", default="l1,l2,bounds", help="scorer kinds to sweep (default: l1,l2,bounds)")
    parser.add_argument("--layers", default=None,
                        help="layers to sweep, e.g. 3,7,9,5+7+9 (a '+' group is one setting averaging those layers; "
                             "default: every third and the last)")
    parser.add_argument("--heads", default="mean,max", help="head pooling to sweep (default: mean,max)")
    parser.add_argument("--sinks", default="0,4", help="sink tokens per chunk start to sweep (default: 0,4)")
    parser.add_argument("--keep-sinks", default="spans",
                        help="ways of keeping the sinks swept beside dropping them: spans, tokens (grown refills "
                             "only: the first span whole, then each chunk's sink tokens) (default: spans)")
    parser.add_argument("--unscored", default="0",
                        help="l2: chunk-start tokens whose mass places no refill (they stay in the softmax), "
                             "e.g. 0,16 (default: 0)")
    parser.add_argument("--neighbors", default="0,1", help="neighbour refill off/on to sweep (default: 0,1)")
    parser.add_argument("--grow", default="0,1,2,3,4",
                        help="token-granular refill (l2 scorers): seed counts to sweep, 0 = whole spans (default: 0,1,2,3,4)")
    parser.add_argument("--grow-shapes", default="attention,centered,densest,sentences",
                        help="how grown regions take their tokens, swept for every seed count "
                             "(default: attention,centered,densest,sentences)")
    parser.add_argument("--queries", default="all,question",
                        help="which question tokens each setting pools over: all (the template around the question "
                             "too) and/or question (its own words) (default: all,question)")
    parser.add_argument("--max-refill", type=int, nargs="+", default=None, metavar="ETA",
                        help="the refill budget in tokens (eta) to calibrate at: one for every length, or one per "
                             "--context-tokens; stored with each band's choice (default: the export's eta)")
    parser.add_argument("--cost-slack", type=float, default=0.0, metavar="POINTS",
                        help="among settings within POINTS of the best's whole-evidence share, store the one whose "
                             "scoring pass runs the fewest layers (a question's cost before its refill; default: 0, "
                             "evidence decides)")
    parser.add_argument("--dry-run", action="store_true", help="print the table, change nothing")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    add_placement_arguments(parser)
    parser.add_argument("--no-progress", action="store_true")


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown:
        raise ValueError(f"--{what}: unknown {unknown}; choose from {', '.join(allowed)}")
    return names


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace("+", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated integers, got {text!r}") from None


def _layer_sets(text: str) -> list[tuple[int, ...]]:
    """``"3,7,5+7+9"`` -> ``[(3,), (7,), (5, 7, 9)]``."""
    try:
        sets = [tuple(int(x) for x in item.split("+")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--layers takes comma-separated layers or '+' groups (e.g. 3,7,5+7+9), got {text!r}") from None
    if not sets:
        raise ValueError("--layers names no layer")
    return sets


def run(args: argparse.Namespace) -> int:
    """Calibrate one export; a second ``calibrate`` of the same export while one runs is refused at once
    (both would write its config.json), a dry run excepted."""
    from ..files import FolderLock

    if args.dry_run:
        return _run(args)
    with FolderLock(Path(args.export), "calibration"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ..modeling.learned_scorer import query_map_of
    from ..infer.load import load_export
    from ..modeling.export_format import check_export_dir
    from ..infer.settings import inference_settings
    from .tasks import resolve_tasks

    export = Path(args.export)
    device = str(requested_device(args.device))  # a device this machine lacks: said before anything else
    check_export_dir(export)
    kinds = [k.strip() for k in args.scorers.split(",") if k.strip()]
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    model, tokenizer, data = load_export(export, device=device, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                         placement=Placement.from_args(args))
    if tokenizer is None:
        raise ValueError(f"{export} holds no tokenizer files; re-export it with its tokenizer")
    n_layers = model.config.num_hidden_layers
    candidates = sweep(n_layers, kinds=kinds, layers=_layer_sets(args.layers) if args.layers else None,
                       heads=heads, sinks=_ints(args.sinks, "sinks"), neighbors=[bool(x) for x in _ints(args.neighbors, "neighbors")],
                       learned_layers=qmap.layers if (qmap := query_map_of(model)) is not None else (),
                       grow=_ints(args.grow, "grow"), grow_shapes=_names(args.grow_shapes, GROW_SHAPES, "grow-shapes"),
                       keep_sinks=_names(args.keep_sinks, KEEP_SINKS, "keep-sinks"),
                       queries=_names(args.queries, QUERIES, "queries"), unscored=_ints(args.unscored, "unscored"))
    for c in candidates:  # a layer out of range fails before any cache is built
        c.scorer.resolved_layers(n_layers)
    if len(args.context_tokens) > 1 and Path(args.data).is_file():
        raise ValueError("several --context-tokens sweep built-in data; a task file has its own lengths")
    _, refill = inference_settings(data)
    lengths = sorted(set(args.context_tokens))
    etas = args.max_refill or [None]
    if len(etas) not in (1, len(lengths)):
        raise ValueError(f"--max-refill takes one eta, or one per --context-tokens ({len(lengths)}), got {len(etas)}")
    eta_of = dict(zip(lengths, etas * len(lengths) if len(etas) == 1 else etas))
    per_length, seconds = [], 0.0
    for length in lengths:
        examples = resolve_tasks(args.data, tokenizer, length, args.num_examples, args.seed,
                                 squad_path=args.squad, questions_per_context=args.questions_per_context)
        print(f"calibrating {len(candidates)} settings on {len(examples)} dev questions ({args.data}, {length:,} tokens)")
        tic = time.perf_counter()
        overrides = {"max_refill": eta_of[length]} if eta_of[length] is not None else {}
        rows = prefer_cheaper(calibrate(model, tokenizer, examples, candidates, overrides=overrides,
                                        progress=not args.no_progress), args.cost_slack)
        for r in rows:
            r["max_refill"] = eta_of[length]
        seconds += time.perf_counter() - tic
        print(markdown(rows))
        print(f"{length:,} tokens: {rows[0]['n']} questions; best: {rows[0]['setting']} "
              f"(whole evidence {rows[0]['covered']:.1f} %)")
        per_length.append((length, rows))
    meta = {"data": args.data, "squad": args.squad, "context_tokens": sorted(set(args.context_tokens)),
            "seed": args.seed, "cost_slack": args.cost_slack, "seconds": round(seconds, 1), "before": refill.describe_selection()}
    print(f"calibrated in {seconds:.0f}s (was {meta['before']})")
    if args.dry_run:
        print("dry run: the export is unchanged")
        return 0
    chosen = write_choice(export, per_length, meta)
    shown = chosen.describe() if isinstance(chosen, Selection) else " | ".join(chosen.describe())
    print(f"wrote {shown} into {export / 'config.json'}; table: {export / 'calibration.md'}")
    return 0
    print(f"wrote the chosen scorer into {export / 'config.json'}; table: {export / 'calibration.md'}")
    return 0
